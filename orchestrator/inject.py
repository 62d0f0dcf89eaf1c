"""Where a Guard meets the fault injection of drills and tests (the policy's ``faults``).

With no faults (every production run) this does nothing and imports nothing: the Guard's
components stay as built, and its healthy step runs no fault code. With some,
:func:`orchestrator.faults.install` wraps the components the faults perturb.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.guard import Guard


def inject(guard: Guard) -> None:
    """Wrap ``guard``'s components with the faults its policy asks for, if any."""
    if guard.policy.faults:
        from orchestrator.faults import install

        install(guard)
