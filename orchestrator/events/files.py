"""The records of the events about files: the durable tier's writes, retention and
resumes, where the snapshot ring lives, the quarantine ledger's writes, and the run
directory's own files (journal, metrics, heartbeats) when a write fails. Written by the
ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.events.base import Record, kind

__all__ = [
    "Persist",
    "PersistRetry",
    "PersistFailed",
    "PersistSkipped",
    "PersistPrune",
    "PersistPruneFailed",
    "PersistInvalidate",
    "PersistLocal",
    "PersistLocalFailed",
    "PersistRequiredFailed",
    "SnapshotInvalid",
    "StorageUnreachable",
    "Resume",
    "ShmFallback",
    "LedgerFailed",
    "LedgerWritten",
    "HeartbeatFailed",
    "WriteFailed",
    "JournalFailed",
]


@kind("persist")
@dataclass(frozen=True, kw_only=True)
class Persist(Record):
    url: str | None = None
    bytes: int | None = None
    write_s: float | None = None


@kind("persist_retry")
@dataclass(frozen=True, kw_only=True)
class PersistRetry(Record):
    op: str | None = None
    error: str | None = None


@kind("persist_failed")
@dataclass(frozen=True, kw_only=True)
class PersistFailed(Record):
    error: str | None = None


@kind("persist_skipped")
@dataclass(frozen=True, kw_only=True)
class PersistSkipped(Record):
    snapshot_step: int | None = None
    reason: str | None = None


@kind("persist_prune")
@dataclass(frozen=True, kw_only=True)
class PersistPrune(Record):
    deleted_steps: list[int] = field(default_factory=list)


@kind("persist_prune_failed")
@dataclass(frozen=True, kw_only=True)
class PersistPruneFailed(Record):
    error: str | None = None
    url: str | None = None


@kind("persist_invalidate")
@dataclass(frozen=True, kw_only=True)
class PersistInvalidate(Record):
    uncommitted_steps: list[int] = field(default_factory=list)
    url: str | None = None


@kind("persist_local")
@dataclass(frozen=True, kw_only=True)
class PersistLocal(Record):
    url: str | None = None
    seconds: float | None = None


@kind("persist_local_failed")
@dataclass(frozen=True, kw_only=True)
class PersistLocalFailed(Record):
    error: str | None = None
    url: str | None = None


@kind("persist_required_failed")
@dataclass(frozen=True, kw_only=True)
class PersistRequiredFailed(Record):
    url: str | None = None


@kind("snapshot_invalid")
@dataclass(frozen=True, kw_only=True)
class SnapshotInvalid(Record):
    snapshot_step: int | None = None
    reasons: Any = None


@kind("storage_unreachable")
@dataclass(frozen=True, kw_only=True)
class StorageUnreachable(Record):
    error: str | None = None
    url: str | None = None


@kind("resume")
@dataclass(frozen=True, kw_only=True)
class Resume(Record):
    snapshot_step: int
    tier: str | None = None  # durable, local, shm, buddy, ...
    url: str | None = None
    saved_world_size: int | None = None


@kind("shm_fallback")
@dataclass(frozen=True, kw_only=True)
class ShmFallback(Record):
    """snapshot.shared_memory: auto kept the ring in private memory: the tightest node's
    shm_dir had no room for it plus headroom (orchestrator/shm_room.py)."""

    need_bytes: int | None = None
    headroom_bytes: int | None = None
    free_bytes: int | None = None
    path: str | None = None  # snapshot.shm_dir
    node: str | None = None
    why: str | None = None
    remedy: str | None = None


@kind("ledger_failed")
@dataclass(frozen=True, kw_only=True)
class LedgerFailed(Record):
    samples: list[int] = field(default_factory=list)
    ranges: list[list[int]] = field(default_factory=list)  # [lo, hi) id ranges
    error: str | None = None


@kind("ledger_written")
@dataclass(frozen=True, kw_only=True)
class LedgerWritten(Record):
    samples: list[int] = field(default_factory=list)
    ranges: list[list[int]] = field(default_factory=list)  # [lo, hi) id ranges


@kind("heartbeat_failed")
@dataclass(frozen=True, kw_only=True)
class HeartbeatFailed(Record):
    error: str | None = None


@kind("write_failed")
@dataclass(frozen=True, kw_only=True)
class WriteFailed(Record):
    file: str | None = None  # metrics, policy.yaml
    path: str | None = None
    error: str | None = None


@kind("journal_failed")
@dataclass(frozen=True, kw_only=True)
class JournalFailed(Record):
    error: str | None = None
    since: float | None = None
    seconds: float | None = None
    lost: int | None = None
