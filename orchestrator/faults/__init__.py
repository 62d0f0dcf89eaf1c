"""Fault injection for drills and tests (the policy's ``faults`` list; empty by default).

:func:`install` wraps the components of a Guard that the faults perturb; the Guard calls it
(through :mod:`orchestrator.inject`) only when the list is non-empty, so a production run
neither builds nor runs any of this. What each fault does is in :mod:`.injector`; where it
acts, in :mod:`.step` (the training step) and :mod:`.parts` (storage, health, shared
memory).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import yaml

from orchestrator.errors import PolicyError
from orchestrator.fault_kinds import Fault, SlowStepsFault
from orchestrator.faults.injector import FaultInjector, InjectedStorageError, fault_key
from orchestrator.faults.parts import corrupt_slot, wrap_durable, wrap_health
from orchestrator.faults.step import StepFaults
from orchestrator.policy import Policy, parse_policy
from orchestrator.protocol import ENV_FAULTS

if TYPE_CHECKING:
    from orchestrator.guard import Guard

__all__ = [
    "FaultInjector",
    "InjectedStorageError",
    "StepFaults",
    "corrupt_slot",
    "fault_key",
    "install",
    "requested",
    "wrap_durable",
    "wrap_health",
]


def install(guard: Guard) -> FaultInjector:
    """Inject the faults :func:`requested` into ``guard``'s components (after it built
    them, before its first health check and step)."""
    faults = requested(guard.policy)
    injector = FaultInjector(faults, guard.comm.global_rank, guard.run_dir, guard.journal)
    guard.lifecycle.faults = len(faults)  # run_start counts them, wherever they came from
    rank = guard.comm.global_rank
    pace = sum(
        f.seconds for f in faults if isinstance(f, SlowStepsFault) and f.rank in (None, rank)
    )
    StepFaults(guard, injector, pace).install()
    wrap_durable(guard.durable, injector)
    if guard.health is not None:
        wrap_health(guard.health, injector)
    return injector


def requested(policy: Policy) -> list[Fault]:
    """The faults to inject: the policy's own, then those of the file
    ``$ORCHESTRATOR_FAULTS`` names (a YAML list, as the policy's ``faults``), if set.

    Raises:
        PolicyError: that file cannot be read or holds no valid fault list.
    """
    path = os.environ.get(ENV_FAULTS)
    if not path:
        return list(policy.faults)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as err:
        raise PolicyError(f"${ENV_FAULTS}={path}: cannot read a fault list: {err}") from None
    extra = parse_policy({"faults": data or []}, source=f"${ENV_FAULTS}={path}").faults
    return [*policy.faults, *extra]
