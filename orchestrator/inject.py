"""Where a Guard meets the fault injection of drills and tests (the policy's ``faults``, and
the file ``$ORCHESTRATOR_FAULTS`` names).

With no faults (every production run) this does nothing and imports nothing: the Guard's
components stay as built, and its healthy step runs no fault code. With some,
:func:`orchestrator.faults.install` wraps the components the faults perturb.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from orchestrator.protocol import ENV_FAULTS

if TYPE_CHECKING:
    from orchestrator.guard import Guard


def inject(guard: Guard) -> None:
    """Wrap ``guard``'s components with the faults asked for, if any."""
    if guard.policy.faults or os.environ.get(ENV_FAULTS):
        from orchestrator.faults import install

        install(guard)
