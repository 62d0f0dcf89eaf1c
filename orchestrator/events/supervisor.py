"""The records of the events the supervisor writes (rank -1), and its helpers (the
shared-memory flush, buddy replication, alerts, the Prometheus endpoint)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator import protocol as P
from orchestrator.events.base import Record, kind

__all__ = [
    "AttemptStart",
    "AttemptEnd",
    "Restart",
    "Hang",
    "NodeLost",
    "Flush",
    "Replicated",
    "ReplicateFailed",
    "BuddyRestore",
    "SupervisorExit",
    "StopRequested",
    "Alert",
    "ExporterStarted",
    "CrashNotCounted",
    "EndpointUnreachable",
    "AttemptLeft",
    "LauncherLingered",
    "HangDetectionPaused",
    "HangDetectionResumed",
    "RankReplaced",
    "InplaceFailed",
]


@kind(P.EVENT_ATTEMPT_START, "supervisor")
@dataclass(frozen=True, kw_only=True)
class AttemptStart(Record):
    node: str | None = None
    host: str | None = None  # older journals name the host only
    cmd: list[str] | None = None


@kind(P.EVENT_ATTEMPT_END, "supervisor")
@dataclass(frozen=True, kw_only=True)
class AttemptEnd(Record):
    outcome: str | None = None
    returncode: int | None = None
    best_step: int | None = None
    ended_at: float | None = None  # when its processes were gone
    progress_time: float | None = None  # the ranks' last progress, as the supervisor saw it
    node: str | None = None
    host: str | None = None


@kind(P.EVENT_RESTART, "supervisor")
@dataclass(frozen=True, kw_only=True)
class Restart(Record):
    cause: str | None = None
    returncode: int | None = None
    restart: int | None = None
    next_attempt: int | None = None
    delay_s: float | None = None
    node: str | None = None


@kind(P.EVENT_HANG, "supervisor")
@dataclass(frozen=True, kw_only=True)
class Hang(Record):
    stalled_ranks: dict[str, Any] | None = None
    suspects: list[int] | None = None
    culprits: list[dict[str, Any]] | None = None  # by, step, phase, answered, state
    stacks: Any = None  # where the dumps are
    node: str | None = None


@kind(P.EVENT_NODE_LOST, "supervisor")
@dataclass(frozen=True, kw_only=True)
class NodeLost(Record):
    why: str | None = None
    node: str | None = None


@kind(P.EVENT_FLUSH, "supervisor")
@dataclass(frozen=True, kw_only=True)
class Flush(Record):
    flushed: bool | None = None
    step: int | None = None
    url: str | None = None
    committed_by: Any = None  # present: another node's rank committed it first
    node: str | None = None


@kind(P.EVENT_REPLICATED, "supervisor")
@dataclass(frozen=True, kw_only=True)
class Replicated(Record):
    to: str | None = None
    bytes: int | None = None
    seconds: float | None = None


@kind(P.EVENT_REPLICATE_FAILED, "supervisor")
@dataclass(frozen=True, kw_only=True)
class ReplicateFailed(Record):
    to: str | None = None
    reason: str | None = None


@kind(P.EVENT_BUDDY_RESTORE, "supervisor")
@dataclass(frozen=True, kw_only=True)
class BuddyRestore(Record):
    bytes: int | None = None


@kind(P.EVENT_SUPERVISOR_EXIT, "supervisor")
@dataclass(frozen=True, kw_only=True)
class SupervisorExit(Record):
    exit_code: int
    reason: str
    node: str | None = None


@kind(P.EVENT_STOP_REQUESTED, "supervisor")
@dataclass(frozen=True, kw_only=True)
class StopRequested(Record):
    signal: str | None = None
    signal_time: float | None = None  # when the first signal arrived
    node: str | None = None


@kind(P.EVENT_ALERT, "supervisor")
@dataclass(frozen=True, kw_only=True)
class Alert(Record):
    alert: str | None = None
    returncode: int | None = None
    error: str | None = None


@kind(P.EVENT_EXPORTER, "supervisor")
@dataclass(frozen=True, kw_only=True)
class ExporterStarted(Record):
    port: int | None = None
    error: str | None = None


@kind("crash_not_counted", "supervisor")
@dataclass(frozen=True, kw_only=True)
class CrashNotCounted(Record):
    why: str | None = None


@kind("endpoint_unreachable", "supervisor")
@dataclass(frozen=True, kw_only=True)
class EndpointUnreachable(Record):
    endpoint: str | None = None
    why: Any = None


@kind("attempt_left", "supervisor")
@dataclass(frozen=True, kw_only=True)
class AttemptLeft(Record):
    why: Any = None


@kind("launcher_lingered", "supervisor")
@dataclass(frozen=True, kw_only=True)
class LauncherLingered(Record):
    seconds: float | None = None


@kind("hang_detection_paused", "supervisor")
@dataclass(frozen=True, kw_only=True)
class HangDetectionPaused(Record):
    error: Any = None


@kind("hang_detection_resumed", "supervisor")
@dataclass(frozen=True, kw_only=True)
class HangDetectionResumed(Record):
    error: Any = None
    seconds: float | None = None


@kind("rank_replaced", "supervisor")
@dataclass(frozen=True, kw_only=True)
class RankReplaced(Record):
    """The node agent started a dead rank again alone (in place, issue 33)."""

    rank: int
    cause: str  # "exit", "signal" or "hang"
    generation: int  # the generation the replacement joined
    returncode: int | None = None  # the dead process's (negative: the signal)
    pid_old: int | None = None
    pid_new: int | None = None
    decided: float | None = None  # when the agent decided (time.time())
    joined: float | None = None  # when every rank had joined the new generation
    seconds: float | None = None  # decided -> joined
    spare: bool | None = None  # a warm spare took the rank (supervisor.in_place_spares)


@kind("inplace_failed", "supervisor")
@dataclass(frozen=True, kw_only=True)
class InplaceFailed(Record):
    """The node agent gave up replacing dead ranks in place: every rank is stopped and the
    supervisor restarts the attempt (issue 33)."""

    reason: str
    ranks: list[int]  # the dead ranks it could not replace
    cause: str | None = None  # "exit", "signal" or "hang"
    generation: int | None = None  # the generation that broke or did not form
