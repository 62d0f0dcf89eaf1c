"""Fault injection for drills and tests (the policy's ``faults`` list; empty by default).

:func:`install` wraps the components of a Guard that the faults perturb; the Guard calls it
(through :mod:`orchestrator.inject`) only when the list is non-empty, so a production run
neither builds nor runs any of this. What each fault does is in :mod:`.injector`; where it
acts, in :mod:`.step` (the training step) and :mod:`.parts` (storage, health, shared
memory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.faults.injector import FaultInjector, InjectedStorageError, fault_key
from orchestrator.faults.parts import corrupt_slot, wrap_durable, wrap_health
from orchestrator.faults.step import StepFaults

if TYPE_CHECKING:
    from orchestrator.guard import Guard

__all__ = [
    "FaultInjector",
    "InjectedStorageError",
    "StepFaults",
    "corrupt_slot",
    "fault_key",
    "install",
    "wrap_durable",
    "wrap_health",
]


def install(guard: Guard) -> FaultInjector:
    """Inject ``guard.policy.faults`` into ``guard``'s components (after it built them,
    before its first health check and step)."""
    injector = FaultInjector(
        guard.policy.faults, guard.comm.global_rank, guard.run_dir, guard.journal
    )
    StepFaults(guard, injector).install()
    wrap_durable(guard.durable, injector)
    if guard.health is not None:
        wrap_health(guard.health, injector)
    return injector
