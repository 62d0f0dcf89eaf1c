"""The policy's sections: one pydantic v2 model per YAML section (the ``faults`` list's
models are in :mod:`orchestrator.fault_kinds`). Each field's description is what
``configs/default.yaml`` says about it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    # No inf or nan: a duration of .inf or .nan would silently disable what it bounds.
    # Frozen: a loaded policy never changes (what the tuner changes is in tuning.Intervals).
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, frozen=True
    )


def _auto(data: Any, placeholder: int) -> Any:
    """``every_steps: auto`` in YAML becomes ``auto_every_steps: true`` and a placeholder
    interval, replaced at start by tune.initial_*."""
    if isinstance(data, dict) and data.get("every_steps") == "auto":
        data = {**data, "every_steps": placeholder, "auto_every_steps": True}
    return data


def _int_or_auto(cls: Any, value: Any) -> Any:
    """``every_steps`` (after :func:`_auto`): an integer, said so with ``auto`` named."""
    if isinstance(value, str) and not value.strip().isdigit():  # "10" still reads as 10
        raise ValueError(f"{value!r} is neither an integer nor auto")
    return value


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
    shared_memory: bool = Field(
        False,
        description="Keep the ring in node shared memory (files under shm_dir): a restart "
        "on the same node resumes from it instead of the durable tier.",
    )
    shm_dir: str = Field(
        "/dev/shm", description="Where the shared-memory ring lives (a tmpfs on each node)."
    )
    replicate: Literal["none", "buddy"] = Field(
        "none",
        description="buddy: each node's supervisor copies its newest complete sealed slot "
        "into another node's shared memory (over TCP, off the training processes), so a "
        "node that is replaced or loses its ring resumes from that copy instead of the "
        "durable tier. Needs shared_memory and the supervisor under several nodes.",
    )

    _every = field_validator("every_steps", mode="before")(classmethod(_int_or_auto))

    @model_validator(mode="before")
    @classmethod
    def _auto_interval(cls, data: Any) -> Any:
        return _auto(data, 10)

    @model_validator(mode="after")
    def _age_reachable(self) -> SnapshotPolicy:
        if self.replicate != "none" and not self.shared_memory:
            raise ValueError(
                f"replicate={self.replicate!r} copies the shared-memory ring: set "
                "shared_memory: true too, or replicate: none"
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


class SpikePolicy(_Section):
    enabled: bool = Field(
        True,
        description="Treat loss / grad-norm spikes as incidents (finite divergence: an LR "
        "blow-up, outlier samples). A loss spike is re-run like a NaN: samples that "
        "reproduce it alone are quarantined; one every sample shows cuts the LR.",
    )
    metrics: list[Literal["loss", "grad_norm"]] = Field(
        default_factory=lambda: ["loss"],  # type: ignore[arg-type]
        description="Which global values are watched.",
    )
    window: int = Field(
        100, ge=8, description="Steps of history for the noise (step-to-step changes)."
    )
    min_history: int = Field(20, ge=4, description="No spike decision before this many steps.")
    reference_steps: int = Field(
        5,
        ge=1,
        description="A value is compared with the median of this many last values, moved "
        "along a falling trend (the window's median step-to-step change): the level now.",
    )
    zscore: float = Field(
        7.0,
        gt=0,
        description="Spike when (x - reference) / noise exceeds this; noise = 1.4826 * "
        "median |step-to-step change - trend| / sqrt(2) over the window (a trend is not "
        "noise, as a window's spread around its median would make it).",
    )

    @model_validator(mode="after")
    def _history_fits(self) -> SpikePolicy:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history={self.min_history} exceeds window={self.window}: the decision "
                "would never be made; lower min_history or raise window"
            )
        return self


class ReplicasPolicy(_Section):
    enabled: bool = Field(
        True,
        description="Every snapshot carries a digest of the state training changes only in "
        "the optimizer step (parameters, and optimizer state where replicated), computed on "
        "the device. Where ranks hold that state alike (DDP, ZeRO-1/2 parameters) the "
        "replicas compare digests in a second tiny all-reduce at each snapshot step: a "
        "mismatch is a 'divergence' incident (roll back to the newest snapshot the replicas "
        "agreed on). Every engine checks a restored snapshot against its digest.",
    )
    sick_after: int = Field(
        2,
        ge=1,
        description="A rank named as the odd one out of this many divergences within "
        "escalation.window_steps is sick: stop with exit code 72 naming it and its host.",
    )


class OverflowPolicy(_Section):
    max_skips: int | None = Field(
        8,
        ge=1,
        description="A loss scaler skipping this many steps in a row (non-finite gradients "
        "each time) is an incident, 'persistent_overflow', not business as usual: a healthy "
        "scaler finds its scale within a few skips. null: never.",
    )
    min_loss_scale: float | None = Field(
        1.0,
        gt=0,
        description="A loss scale below this after a skip is a 'persistent_overflow' "
        "incident too (gradients overflow even unscaled). null: no floor.",
    )


class DetectPolicy(_Section):
    check_grads: bool = Field(
        True, description="Include the gradients in the finite check (the loss is always checked)."
    )
    spike: SpikePolicy = Field(default_factory=SpikePolicy)  # type: ignore[arg-type]
    replicas: ReplicasPolicy = Field(default_factory=ReplicasPolicy)  # type: ignore[arg-type]
    overflow: OverflowPolicy = Field(default_factory=OverflowPolicy)  # type: ignore[arg-type]


class ClipPolicy(_Section):
    max_norm: float | None = Field(
        None,
        gt=0,
        description="Clip gradients to this global L2 norm when a step commits, by the norm "
        "the finite check already computed (no second norm, no extra collective or host "
        "sync); the journal and metrics keep the norm before clipping. null: no clipping. "
        "DeepSpeed clips by its own gradient_clipping instead.",
    )


class QuarantinePolicy(_Section):
    enabled: bool = Field(True, description="Quarantine the samples of a bad step.")
    scope: Literal["step", "window"] = Field(
        "step",
        description="'step': the bad step's samples; 'window': also the samples of the "
        "window_steps steps before it (PaLM-style skip).",
    )
    window_steps: int = Field(0, ge=0, description="Steps before the bad one, for scope=window.")
    isolate: bool = Field(
        True,
        description="With scope=step, re-run sub-batches of the bad step (bisection) to "
        "quarantine only the samples that reproduce the non-finite value. A step that does not "
        "reproduce is treated as transient and quarantines nothing.",
    )
    ledger_url: str | None = Field(
        None, description="fsspec URL of the JSONL ledger; null means RUN_DIR/quarantine.jsonl."
    )
    max_fraction: float = Field(
        0.01,
        gt=0,
        le=1,
        description="Data budget: give up when the quarantined samples exceed this fraction of "
        "the distinct samples seen so far (more bad data than that says the data set, or the "
        "model on it, is the problem). Incidents explained by data are charged here, not to "
        "escalation.max_incidents.",
    )
    max_step_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="An incident whose isolated culprits are more than this fraction of the "
        "bad step's samples is not explained by data (a model or LR that diverges fails on "
        "every sample): nothing is quarantined and it counts as unexplained.",
    )
    budget_min_samples: int = Field(
        16,
        ge=0,
        description="Quarantining up to this many samples is always within the data budget "
        "(early in a run the fraction of the few samples seen says little).",
    )

    @model_validator(mode="after")
    def _window_has_size(self) -> QuarantinePolicy:
        if self.scope == "window" and self.window_steps < 1:
            raise ValueError("scope=window needs window_steps >= 1 (how many earlier steps)")
        return self


class AdjustPolicy(_Section):
    lr_factor: float = Field(
        0.5, gt=0, le=1, description="Multiply the LR by this on each incident (1.0: off)."
    )
    min_lr_factor: float = Field(
        0.01, gt=0, le=1, description="Floor of the cumulative LR multiplier."
    )
    hold_steps: int = Field(20, ge=0, description="Steps at the cut LR before re-warming.")
    rewarm_steps: int = Field(100, ge=0, description="Steps of linear ramp back to 1.0.")
    loss_scale_factor: float = Field(
        0.5, gt=0, le=1, description="Multiply a GradScaler's scale by this on each incident."
    )
    cut_lr_on_data: bool = Field(
        False,
        description="Cut the LR on incidents explained by data too (bad samples isolated and "
        "quarantined). Off: the cause was the sample, not the optimization.",
    )
    loss_scale_on_data: bool = Field(
        False,
        description="Apply loss_scale_factor on incidents explained by data too.",
    )


class EscalationPolicy(_Section):
    max_incidents: int = Field(
        3,
        ge=0,
        description="Give up when more unexplained incidents than this occur within "
        "window_steps (not reproducible, reproducible on every sample, a spike, or no "
        "isolation); incidents explained by bad samples count against the data budget "
        "(quarantine.max_fraction) instead.",
    )
    window_steps: int = Field(500, ge=1, description="Sliding window for the incident budget.")


class MetricsPolicy(_Section):
    enabled: bool = Field(True, description="Write RUN_DIR/metrics.jsonl (rank 0).")
    every_steps: int = Field(1, ge=1, description="Record every this many steps.")
    flush_every: int = Field(50, ge=1, description="Buffered lines written at a time...")
    flush_s: float = Field(
        5.0, gt=0, description="...or sooner, once this many seconds passed (a crash loses less)."
    )
    update_ratio_every: int = Field(
        100,
        ge=0,
        description="Measure the update-to-weight ratio every this many steps (0: never; "
        "costs one copy of rank 0's weights then).",
    )
    update_ratio_warn: float = Field(
        1e-3, gt=0, description="Journal update_ratio_low when the ratio stays below this"
    )
    update_ratio_patience: int = Field(
        3, ge=1, description="...for this many measurements in a row (a silent bf16 stall)."
    )


class HealthPolicy(_Section):
    preflight: bool = Field(
        False,
        description="Run the health checks when the Guard starts (and keep the first "
        "measured bandwidth as the baseline in RUN_DIR/health_baseline.json).",
    )
    on_incident: bool = Field(
        True, description="Run them on every incident, before deciding what to do."
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="Hard limit for a whole check on each rank: its collectives must "
        "complete within the first 75% of it (waited for on the host, NCCL included) and "
        "every rank's evidence must reach the store by 95%; a rank that does not answer in "
        "time is named (absent, or silent if it entered) instead of hanging the check. The "
        "health group's own timeout (NCCL's watchdog) is twice this, so this one fires "
        "first.",
    )
    bandwidth_mb: float = Field(
        16.0,
        gt=0,
        description="Size of the buffer all-reduced to measure bandwidth (MiB). 16 MiB suits "
        "CPUs and slow links; over NVLink or fast InfiniBand it measures latency: use 256 "
        "MiB or more there (1024 on NVLink 4), so one all-reduce takes milliseconds.",
    )
    bandwidth_reps: int = Field(3, ge=1, description="Timed all-reduces (median taken).")
    min_bandwidth_ratio: float = Field(
        0.5,
        gt=0,
        le=1,
        description="A measured bandwidth below this share of the baseline fails; the "
        "ranks that arrived last at the collectives are named.",
    )
    compute_size: int = Field(
        256, ge=16, description="Side of the seeded matrices of the compute self-test."
    )
    memory_mb: float = Field(
        16.0, ge=0, description="Memory pattern written and read back per rank (MiB)."
    )


Classification = Literal["transient", "deterministic", "precision", "data_or_model"]
Action = Literal["quarantine", "cut_lr", "health"]


def _default_actions() -> dict[Classification, list[Action]]:
    return {
        "transient": ["health"],  # suspect hardware: check it; no sample reproduces it
        "deterministic": ["quarantine", "cut_lr"],
        "precision": ["quarantine", "cut_lr"],
        "data_or_model": ["quarantine", "cut_lr"],
    }


class DiagnosePolicy(_Section):
    rerun: bool = Field(
        False,
        description="On an incident, re-run the failed step: not reproducible -> "
        "'transient'; reproducible -> 'deterministic' (with the first module whose "
        "output or gradient is non-finite), refined for fp16/bf16 models by an fp32 "
        "re-run into 'precision' (finite in fp32) or 'data_or_model'.",
    )
    actions: dict[Classification, list[Action]] = Field(
        default_factory=_default_actions,
        description="What each classification does, besides the rollback: quarantine "
        "(the samples that reproduce it), cut_lr (adjust section), health (run the health "
        "checks if health.on_incident has not already). A classification left out keeps "
        "its default.",
    )

    @field_validator("actions")
    @classmethod
    def _complete(cls, v: dict[Classification, list[Action]]) -> dict[Classification, list[Action]]:
        return {**_default_actions(), **v}


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


class SupervisorPolicy(_Section):
    max_restarts: int = Field(10, ge=0, description="Restarts before the supervisor gives up.")
    backoff_s: float = Field(
        2.0, ge=0, description="First restart delay; doubles each restart (with jitter)."
    )
    backoff_max_s: float = Field(120.0, ge=0, description="Cap of the restart delay.")
    max_unhealthy: int = Field(
        2, ge=0, description="Attempts ending UNHEALTHY (exit 72) tolerated before stopping."
    )
    crash_loop_attempts: int = Field(
        3,
        ge=1,
        description="Stop when this many attempts in a row made no step progress "
        "beyond the best step so far (a crash loop), instead of burning max_restarts.",
    )
    progress_runtime_s: float = Field(
        300.0,
        ge=0,
        description="An attempt that writes no heartbeats (a script without the "
        "Guard) counts as progress for the crash-loop rule if it ran at least this long.",
    )
    hang_timeout_s: float = Field(
        600.0,
        gt=0,
        description="No heartbeat progress from a rank for this long is a hang: "
        "the workers are stopped and restarted.",
    )
    start_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Also a hang if an attempt writes no heartbeat within this "
        "long (null: no limit; scripts without the Guard never write heartbeats).",
    )
    grace_s: float = Field(
        60.0,
        gt=0,
        description="After SIGTERM, how long the workers get (to finish the step "
        "and write a snapshot) before SIGKILL.",
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, description="Each rank's writer thread writes its heartbeat this often."
    )
    node_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Several nodes: how long the nodes wait for a node whose supervisor "
        "is gone (or never started), or for a rendezvous endpoint that does not answer, "
        "before the job ends with exit 77.",
    )


class ExportPolicy(_Section):
    prometheus_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Serve Prometheus metrics (orchestrator_*) from each node's supervisor on "
        "this port (0: a free one, said in the journal's exporter event); null: off. Needs "
        "`pip install prometheus-client` (the [metrics] extra).",
    )
    prometheus_addr: str = Field("0.0.0.0", description="Address the endpoint listens on.")
    tensorboard_dir: str | None = Field(
        None,
        description="Rank 0 also writes its metrics (loss, grad norm, LR, step time) as "
        "TensorBoard scalars there; null: off. Needs `pip install tensorboard`.",
    )


AlertOn = Literal["gave_up", "unhealthy", "crash_loop", "hang", "node_lost", "restarts_exhausted"]


class AlertsPolicy(_Section):
    command: list[str] | str | None = Field(
        None,
        description="Run by the supervisor when one of `events` happens, with the event as JSON "
        "on stdin (a list: argv; a string: through the shell); null: no alerts.",
    )
    events: list[AlertOn] = Field(
        default_factory=lambda: ["gave_up", "unhealthy", "crash_loop", "hang"],  # type: ignore[arg-type]
        description="What alerts: gave_up, unhealthy, crash_loop, hang, node_lost, "
        "restarts_exhausted.",
    )
    timeout_s: float = Field(30.0, gt=0, description="The command is killed after this long.")


class TunePolicy(_Section):
    """``snapshot.every_steps: auto`` and ``persist.every_steps: auto`` (orchestrator/tuning.py)."""

    every_steps: int = Field(
        200, ge=1, description="Reconsider the automatic intervals every this many steps."
    )
    prior_incident_mtbf_s: float = Field(
        6 * 3600.0, gt=0, description="Prior mean time between incidents (rollbacks)."
    )
    prior_restart_mtbf_s: float = Field(
        24 * 3600.0, gt=0, description="Prior mean time between restarts (crashes, hangs)."
    )
    prior_weight_s: float = Field(
        3600.0,
        gt=0,
        description="How much training time the priors are worth against what is observed.",
    )
    initial_snapshot_steps: int = Field(
        10, ge=1, description="snapshot.every_steps until the first tuning."
    )
    initial_persist_steps: int = Field(
        100, ge=1, description="persist.every_steps until the first tuning."
    )
    max_snapshot_steps: int = Field(1000, ge=1, description="The longest automatic interval.")
    max_persist_steps: int = Field(20000, ge=1, description="The longest automatic interval.")
