"""The policy's sections about the state kept: ``snapshot`` (the in-memory ring) and
``persist`` (the durable tier).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.policy_base import _auto, _int_or_auto, _Section


class SnapshotPolicy(_Section):
    every_steps: int = Field(
        10,
        ge=1,
        description="Take an in-memory snapshot every N steps; auto: chosen from its measured "
        "stall and the incidents' rate (tune section).",
    )
    auto_every_steps: bool = Field(
        False, description="Set by every_steps: auto (the interval is chosen while training)."
    )
    keep: int = Field(
        2,
        ge=2,
        le=64,  # each slot is a whole copy of the rank's state in host memory
        description="Ring slots per rank (>= 2: the newest may not be sealed yet); "
        "host buffers are allocated once and reused.",
    )
    seal_after_steps: int = Field(
        1, ge=1, description="Clean steps after a snapshot's own step before it may be used."
    )
    min_age_steps: int = Field(
        0,
        ge=0,
        description="Roll back only to a snapshot at least this many steps older "
        "than the bad step (use > 0 when damage may precede detection).",
    )
    max_host_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Budget for the ring on this host (all local ranks together); "
        "null means only the free host memory limits it.",
    )
    shared_memory: bool | Literal["auto"] = Field(
        "auto",
        description="Keep the ring in node shared memory (files under shm_dir): a restart "
        "on the same node resumes from it instead of the durable tier. auto: there under "
        "the supervisor (`orchestrator launch`, which keeps it across restarts and removes "
        "it) when shm_dir has room for the ring of every local rank plus headroom, checked "
        "at start, else private memory with one shm_fallback event saying why; true: there "
        "or a failed start; false: private memory.",
    )
    shm_dir: str = Field(
        "/dev/shm", description="Where the shared-memory ring lives (a tmpfs on each node)."
    )
    replicate: Literal["none", "buddy"] = Field(
        "none",
        description="buddy: each node's supervisor copies its newest complete sealed slot "
        "into another node's shared memory (over TCP, off the training processes), so a "
        "node that is replaced or loses its ring resumes from that copy instead of the "
        "durable tier. Needs shared_memory: true and the supervisor under several nodes.",
    )

    _every = field_validator("every_steps", mode="before")(classmethod(_int_or_auto))

    @model_validator(mode="before")
    @classmethod
    def _auto_interval(cls, data: Any) -> Any:
        return _auto(data, 10)

    @model_validator(mode="after")
    def _age_reachable(self) -> SnapshotPolicy:
        if self.replicate != "none" and self.shared_memory is not True:
            # auto could leave the ring in private memory (no room), with nothing to copy.
            raise ValueError(
                f"replicate={self.replicate!r} copies the shared-memory ring: set "
                "shared_memory: true too (auto may keep the ring in private memory), or "
                "replicate: none"
            )
        if self.auto_every_steps:
            return self  # the tuner keeps (keep-1)*every_steps above both (tuning.py)
        history = self.every_steps * (self.keep - 1)
        if self.seal_after_steps > history:
            raise ValueError(
                f"seal_after_steps={self.seal_after_steps} exceeds (keep-1)*every_steps="
                f"{history}: every snapshot would be overwritten before it is sealed; raise "
                "keep or every_steps, or lower seal_after_steps"
            )
        if self.min_age_steps > history:
            raise ValueError(
                f"min_age_steps={self.min_age_steps} can never be met: the sealed snapshots "
                f"span at most (keep-1)*every_steps={history} steps; raise keep or "
                "every_steps, or lower min_age_steps"
            )
        return self


class PersistPolicy(_Section):
    enabled: bool = Field(True, description="Write sealed snapshots to durable storage.")
    url: str | None = Field(
        None,
        description="fsspec URL (file://, s3://, gs://, memory://, or a path); null "
        "means RUN_DIR/snapshots.",
    )
    every_steps: int | None = Field(
        100,
        ge=1,
        description="Persist the sealed snapshot of every N-th step (a multiple of "
        "snapshot.every_steps); null: time-based only; auto: chosen from the writes' "
        "measured cost and the restarts' rate (tune section).",
    )
    auto_every_steps: bool = Field(
        False, description="Set by every_steps: auto (the interval is chosen while training)."
    )
    every_s: float | None = Field(
        None,
        gt=0,
        description="Also persist the next sealed snapshot once this many seconds "
        "passed since the last (rank 0's clock decides, for all ranks).",
    )
    keep: int = Field(2, ge=1, description="Committed snapshots kept (the newest always is).")
    keep_every_steps: int | None = Field(
        None, ge=1, description="Also keep forever those whose step is a multiple of this."
    )
    required: bool = Field(
        False,
        description="Stop training (exit 1, restartable) when a snapshot cannot be "
        "persisted after its retries; false: journal persist_failed and go on.",
    )
    retries: int = Field(5, ge=1, description="Attempts per storage operation (tenacity).")
    retry_max_wait_s: float = Field(
        10.0, gt=0, description="Cap of the exponential backoff (with jitter) between attempts."
    )
    commit_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long rank 0 waits for every rank's part before it "
        "gives up on committing a snapshot.",
    )
    resume: bool = Field(
        True, description="On start, restore the newest valid committed snapshot, if any."
    )
    local_dir: str | None = Field(
        None,
        description="Node-local tier (e.g. /dev/shm/orchestrator): also keep the "
        "latest snapshot there, so a restart on the same nodes skips remote storage.",
    )
    signing_key_file: str | None = Field(
        None,
        description="A file holding the key that signs each manifest (HMAC-SHA256; "
        "$ORCHESTRATOR_SIGNING_KEY wins): a snapshot whose files or manifest changed is "
        "then refused as tampered, and unsigned ones are refused. Without a key a "
        "checksum can only say corrupt.",
    )

    _every = field_validator("every_steps", mode="before")(classmethod(_int_or_auto))

    @model_validator(mode="before")
    @classmethod
    def _auto_interval(cls, data: Any) -> Any:
        return _auto(data, 100)

    @model_validator(mode="after")
    def _has_trigger(self) -> PersistPolicy:
        if self.enabled and self.every_steps is None and self.every_s is None:
            raise ValueError("enabled persistence needs every_steps or every_s (or both)")
        return self
