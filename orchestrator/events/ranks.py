"""The records of the events the ranks write about training (the Guard's decisions and
what it saw); the durable tier's and the run directory's are in
:mod:`orchestrator.events.files`, the supervisor's in :mod:`orchestrator.events.supervisor`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator import protocol as P
from orchestrator.events.base import Record, kind

__all__ = [
    "RunStart",
    "FirstStep",
    "SnapshotTaken",
    "SnapshotSkipped",
    "Incident",
    "Diagnosis",
    "Quarantine",
    "Rollback",
    "InplaceRecovery",
    "Adjust",
    "Recovered",
    "Confirm",
    "RestoreMismatch",
    "DivergenceCulprit",
    "DivergenceUnresolved",
    "CrashSuspected",
    "CrashProbesClean",
    "LoopError",
    "ZeroGradients",
    "UpdateRatioLow",
    "Health",
    "Unhealthy",
    "GaveUp",
    "Preempting",
    "Preempted",
    "RunEnd",
    "Fault",
    "Interval",
]


@kind("run_start")
@dataclass(frozen=True, kw_only=True)
class RunStart(Record):
    world_size: int | None = None
    run_dir: str | None = None
    policy_digest: str | None = None
    quarantined: int | None = None  # how many ids the ledger held at the start
    faults: int | None = None


@kind("first_step")
@dataclass(frozen=True, kw_only=True)
class FirstStep(Record):
    """The first completed step of a process (goodput's end of its startup)."""

    resumed: bool | None = None


@kind("snapshot")
@dataclass(frozen=True, kw_only=True)
class SnapshotTaken(Record):
    stall_ms: float = 0.0  # the training loop's stall for the copy
    tier: str | None = None  # memory, shm
    bytes: int | None = None
    copied_bytes: int | None = None
    initial: bool | None = None


@kind("snapshot_skipped")
@dataclass(frozen=True, kw_only=True)
class SnapshotSkipped(Record):
    reason: str | None = None


@kind("incident")
@dataclass(frozen=True, kw_only=True)
class Incident(Record):
    reason: str | None = None  # non_finite, spike, divergence, overflow, crash
    cause: str | None = None  # data, unexplained
    why: str | None = None
    budget: str | None = None
    loss: float | None = None
    grad_norm: float | None = None
    origin_ranks: list[int] | None = None
    samples: list[Any] | None = None
    batch_ids: list[Any] | None = None


@kind("diagnosis")
@dataclass(frozen=True, kw_only=True)
class Diagnosis(Record):
    incident_step: int
    classification: str | None = None
    actions: list[str] | None = None
    located: list[dict[str, Any]] | None = None  # module, direction, rank (first first)
    origin_ranks: list[int] | None = None


@kind("quarantine")
@dataclass(frozen=True, kw_only=True)
class Quarantine(Record):
    samples: list[int]
    reason: str | None = None
    ledger: str | None = None
    persisted: bool = True  # written to the ledger (older journals: always)
    total: int | None = None  # quarantined so far (ids; a range counts its width)
    samples_seen: int | None = None
    # Windows of a token stream (orchestrator/samplers.py): the [lo, hi) id ranges of the
    # windows overlapping the samples, and what the data budget charged for the whole
    # quarantine (the draws seen that it takes away).
    ranges: list[list[int]] = field(default_factory=list)
    lost: float | None = None


@kind("rollback")
@dataclass(frozen=True, kw_only=True)
class Rollback(Record):
    to_step: int
    from_step: int | None = None
    min_age_met: bool | None = None
    restore_ms: float | None = None


@kind("inplace_recovery")
@dataclass(frozen=True, kw_only=True)
class InplaceRecovery(Record):
    """Rank(s) replaced in place (issue 33, orchestrator/rejoin.py); the step is the one
    every rank resumed from. ``sources``: by rank, where its state came from and why;
    ``times``: wall-clock seconds (time.time()) of the fault (the agent's word), the
    survivors' detection, leaving the group, re-forming it, the heal's end and the first
    step committed after it (when the event is written)."""

    generation: int
    replaced: list[int]
    cause: str | None = None
    error: str | None = None
    sources: dict[str, Any] = field(default_factory=dict)
    times: dict[str, Any] = field(default_factory=dict)


@kind("adjust")
@dataclass(frozen=True, kw_only=True)
class Adjust(Record):
    phase: str | None = None  # cut, kept, rewarm_start, restored
    lr_multiplier: float | None = None
    hold_steps: int | None = None
    rewarm_steps: int | None = None
    loss_scale_factor: float | None = None


@kind("recovered")
@dataclass(frozen=True, kw_only=True)
class Recovered(Record):
    incident: dict[str, Any] = field(default_factory=dict)  # the incident (incident.py)

    @property
    def incident_step(self) -> int | None:
        s = self.incident.get("step")
        return s if isinstance(s, int) and not isinstance(s, bool) else None

    @property
    def started_at(self) -> float | None:
        t = self.incident.get("started_at")
        return float(t) if isinstance(t, int | float) and not isinstance(t, bool) else None


@kind("confirm")
@dataclass(frozen=True, kw_only=True)
class Confirm(Record):
    samples: list[Any] | None = None
    on_step: int | None = None


@kind("restore_mismatch")
@dataclass(frozen=True, kw_only=True)
class RestoreMismatch(Record):
    snapshot_step: int | None = None


@kind("divergence_culprit")
@dataclass(frozen=True, kw_only=True)
class DivergenceCulprit(Record):
    ranks: list[int] | None = None
    hosts: Any = None
    by: str | None = None


@kind("divergence_unresolved")
@dataclass(frozen=True, kw_only=True)
class DivergenceUnresolved(Record):
    distances: Any = None


@kind("crash_suspected")
@dataclass(frozen=True, kw_only=True)
class CrashSuspected(Record):
    micro: int | None = None
    ranks: list[int] | None = None


@kind("crash_probes_clean")
@dataclass(frozen=True, kw_only=True)
class CrashProbesClean(Record):
    micro: int | None = None
    samples: list[int] = field(default_factory=list)


@kind("loop_error")
@dataclass(frozen=True, kw_only=True)
class LoopError(Record):
    error: str | None = None
    micro: int | None = None
    probe: bool | None = None


@kind("zero_gradients")
@dataclass(frozen=True, kw_only=True)
class ZeroGradients(Record):
    hint: str | None = None


@kind("update_ratio_low")
@dataclass(frozen=True, kw_only=True)
class UpdateRatioLow(Record):
    ratio: float | None = None


@kind("health")
@dataclass(frozen=True, kw_only=True)
class Health(Record):
    healthy: bool | None = None
    reason: str | None = None
    seconds: float | None = None


@kind(P.EVENT_UNHEALTHY)
@dataclass(frozen=True, kw_only=True)
class Unhealthy(Record):
    reason: str | None = None
    ranks: list[int] | None = None
    hosts: list[str] = field(default_factory=list)  # what the scheduler should leave out
    failed: dict[str, Any] | None = None


@kind(P.EVENT_GAVE_UP)
@dataclass(frozen=True, kw_only=True)
class GaveUp(Record):
    why: str | None = None
    reason: str | None = None  # e.g. ledger_unreadable (with ledger, line)
    ledger: str | None = None
    line: int | None = None
    rollbacks: int | None = None


@kind(P.EVENT_PREEMPTING)
@dataclass(frozen=True, kw_only=True)
class Preempting(Record):
    pass


@kind(P.EVENT_PREEMPTED)
@dataclass(frozen=True, kw_only=True)
class Preempted(Record):
    persisted: bool | None = None
    url: str | None = None
    durable_step: int | None = None
    steps_lost: int | None = None


@kind(P.EVENT_RUN_END)
@dataclass(frozen=True, kw_only=True)
class RunEnd(Record):
    status: str | None = None  # finished, stopped, not_closed, ...
    steps: int | None = None
    quarantined: list[Any] = field(default_factory=list)
    samples_seen: int | None = None
    incidents: int | None = None
    rollbacks: int | None = None


@kind("fault")
@dataclass(frozen=True, kw_only=True)
class Fault(Record):
    """An injected fault fired (by the rank it fired on)."""

    key: str | None = None
    fault: dict[str, Any] = field(default_factory=dict)


@kind("interval")
@dataclass(frozen=True, kw_only=True)
class Interval(Record):
    cost_s: float | None = None  # the write cost measured (tier persist)
    tier: str | None = None
    old: Any = None  # every_steps before and after
    new: Any = None
