"""The policy's sections about running the job: ``health`` checks, ``metrics``, the
``supervisor``, ``export``, ``alerts`` and ``tune``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from orchestrator.policy_base import _Section


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
    store: str = Field(
        "auto",
        pattern=r"^(auto|files|tcp|tcp://\S+|etcd://\S+)$",
        description="Several nodes: where the supervisors agree on attempts, ends and lost "
        "nodes (docs/scale.md). auto: a TCPStore served by the supervisor of the launcher's "
        "rendezvous node, on the rendezvous port + 1 (files when the launcher names no "
        "endpoint); tcp: the same, or fail when there is none; tcp://host:port: a TCPStore "
        "there (served by the node whose address it is); etcd://host:port[,host:port]: the "
        "cluster's etcd; files: the run directory (every node reads every node's file: "
        "fine for a few nodes, N-squared opens on the shared file system past that).",
    )
    linger_s: float = Field(
        30.0,
        gt=0,
        description="How long a node's launcher may outlive its finished ranks before the "
        "supervisor ends it (torchrun's exit barrier waits up to 300 s for a peer launcher "
        "that may never come, e.g. a replaced node's, in another rendezvous round).",
    )
    in_place: bool = Field(
        True,
        description="Under `orchestrator launch --nproc-per-node N` (the node agent): a rank "
        "that dies is started again alone and the others stay (issue 33); false, or several "
        "nodes, or any failure of that path: every rank is stopped and restarted as before.",
    )
    in_place_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long the agent waits for every rank to join the next generation "
        "after replacing a dead one before it falls back to the full restart.",
    )
    in_place_max_per_attempt: int = Field(
        2,
        ge=1,
        description="In-place recoveries one attempt may make; the next death restarts "
        "every rank (so a rank that dies again and again meets the crash-loop and "
        "max_restarts rules, and the crash's samples their quarantine).",
    )
    in_place_spares: int = Field(
        1,
        ge=0,
        le=8,
        description="Warm spare processes each node's agent keeps (in place on): started "
        "ahead of need with the ranks' environment, they import torch and the orchestrator "
        "and wait, so a dead rank's replacement skips the process start (~2 s of the "
        "in-place recovery's time); each holds a process's memory (no GPU memory). 0: "
        "none, every replacement is a fresh process.",
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
