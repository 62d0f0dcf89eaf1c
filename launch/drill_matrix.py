"""The drill's matrix (launch/drill.py): the engines, the faults (one column each: what is
injected, what the job must end with, what it is compared with), the policy every cell runs
under, and the :class:`Cell` that records one run's verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orchestrator.errors import EXIT_GAVE_UP, EXIT_PREEMPTED, EXIT_UNHEALTHY

SEED, SAMPLES, BATCH = 7, 1024, 8  # the examples' data (sampler seed, samples, batch per rank)


@dataclass(frozen=True)
class Engine:
    name: str
    script: str
    args: tuple[str, ...]
    needs: str | None = None  # a module that must be importable


ENGINES = (
    Engine("ddp", "train_gpt.py", ()),
    Engine("fsdp2", "train_gpt.py", ("--fsdp",)),
    Engine("fsdp1", "train_gpt.py", ("--fsdp1",)),
    Engine("zero1", "train_gpt_deepspeed.py", ("--zero-stage", "1"), "deepspeed"),
    Engine("zero2", "train_gpt_deepspeed.py", ("--zero-stage", "2"), "deepspeed"),
    Engine("zero3", "train_gpt_deepspeed.py", ("--zero-stage", "3"), "deepspeed"),
)


@dataclass(frozen=True)
class Fault:
    """One column of the matrix. ``faults(world)``: the policy's fault list; ``expect``: the
    exit code the job must end with; ``bitwise``: whether its final state must equal the
    clean run's; ``again``: then run the same command again, which must finish."""

    name: str
    what: str
    faults: Callable[[int], list[dict[str, Any]]]
    expect: int = 0
    bitwise: bool = True
    policy: dict[str, Any] = field(default_factory=dict)
    again: bool = False
    reference: str = "clean"  # which clean run it is compared with
    tier: str | None = None  # the tier the restart must resume from (else the cell fails)
    replicas: bool = False  # only where ranks hold the state alike (replica digests)
    agent: bool = False  # launched by the node agent (--nproc-per-node): in-place recovery


def _poison_id(world: int, step: int = 17) -> int:
    """A sample the examples first meet at ``step``, on the last rank."""
    from orchestrator.data import GuardBatchSampler

    sampler = GuardBatchSampler(SAMPLES, BATCH, rank=0, world_size=world, seed=SEED)
    return int(sampler.global_batch_at(0, step * BATCH * world)[world * BATCH - 3])


# The cells about the durable tier restart from it: a shared-memory ring (the default,
# where the node has room) would resume from memory and leave the durable files untested.
DURABLE_ONLY: dict[str, Any] = {"snapshot": {"shared_memory": False}}

FAULTS = (
    Fault("nan", "NaN gradient at step 23 (last rank)",
          lambda w: [{"kind": "nan_grad", "step": 23, "rank": w - 1}]),
    Fault("poison", "a sample that is NaN every time (step 17)",
          lambda w: [{"kind": "poison_sample", "sample": _poison_id(w)}], reference="poison"),
    Fault("crash", "SIGKILL of the last rank at step 27",
          lambda w: [{"kind": "crash", "step": 27, "rank": w - 1}]),
    Fault("hang", "rank 0 blocks forever at step 27",
          lambda w: [{"kind": "hang", "step": 27, "rank": 0}]),
    Fault("crash_inplace", "SIGKILL of the last rank at step 27, under the node agent",
          lambda w: [{"kind": "crash", "step": 27, "rank": w - 1}], agent=True),
    Fault("hang_inplace", "the last rank blocks forever at step 27, under the node agent",
          lambda w: [{"kind": "hang", "step": 27, "rank": w - 1}], agent=True),
    Fault("preempt", "SIGTERM to the supervisor at step 25, then the same command",
          lambda w: [{"kind": "preempt", "step": 25}], expect=EXIT_PREEMPTED, again=True),
    Fault("storage", "3 durable writes fail (transient)",
          lambda w: [{"kind": "storage_error", "op": "write", "times": 3}]),
    Fault("kill_write", "rank 0 killed between manifest and COMMITTED (step 20)",
          lambda w: [{"kind": "kill_persist", "phase": "manifest", "step": 20}],
          policy=DURABLE_ONLY),
    Fault("bad_manifest", "manifest of step 20 garbage, then a crash at 27",
          lambda w: [{"kind": "corrupt_manifest", "step": 20},
                     {"kind": "crash", "step": 27, "rank": w - 1, "after_persist": True}],
          policy=DURABLE_ONLY),
    Fault("bad_shm", "newest shared-memory slot corrupted, then a crash at 27",
          lambda w: [{"kind": "corrupt_shm", "step": 26, "rank": 0},
                     {"kind": "crash", "step": 27, "rank": w - 1}],
          policy={"snapshot": {"shared_memory": True}}, tier="shm"),
    Fault("divergence", "the last rank's weights drift by 1e-3 at step 25 (a snapshot step)",
          lambda w: [{"kind": "perturb_params", "step": 25, "rank": w - 1}], replicas=True),
    Fault("lr_blowup", "the LR 100x from step 24 for 10 steps (a broken schedule)",
          lambda w: [{"kind": "lr_blowup", "step": 24, "factor": 100.0, "steps": 10}]),
    Fault("crash_sample", "a sample that raises in the loop body (step 17), every attempt",
          lambda w: [{"kind": "crash_sample", "sample": _poison_id(w)}], reference="poison"),
    Fault("broken", "NaN gradients on every step from 25 (a model broken for good)",
          lambda w: [{"kind": "broken_grads", "step": 25, "rank": w - 1}],
          expect=EXIT_GAVE_UP, bitwise=False),
    Fault("unhealthy", "rank 0's collectives carry a wrong value (pre-flight)",
          lambda w: [{"kind": "corrupt_allreduce", "rank": 0}], expect=EXIT_UNHEALTHY,
          bitwise=False, policy={"health": {"preflight": True, "timeout_s": 20}}),
    Fault("absent", "the last rank never enters the health check",
          lambda w: [{"kind": "miss_health", "rank": w - 1}], expect=EXIT_UNHEALTHY,
          bitwise=False, policy={"health": {"preflight": True, "timeout_s": 10}}),
)  # fmt: skip
# Engines whose model state is sharded: no two ranks hold it alike.
SHARDED = frozenset({"fsdp2", "fsdp1", "zero3"})
# Engines whose survivors re-form in place (Engine.rebind): an agent cell of theirs must show
# an in-place recovery. The others' agent cells must fall back to a full restart, bit for bit.
IN_PLACE = frozenset({"ddp", "fsdp2", "zero1", "zero2"})
QUICK = ("nan", "crash", "hang", "crash_inplace", "preempt", "kill_write", "bad_manifest")

DRILL_POLICY: dict[str, Any] = {
    "snapshot": {"every_steps": 5, "keep": 3},
    "persist": {"every_steps": 10, "keep": 3},
    "adjust": {"lr_factor": 1.0},
    "supervisor": {
        "backoff_s": 0.5,
        "backoff_max_s": 2.0,
        "hang_timeout_s": 10.0,
        "heartbeat_interval_s": 0.5,
        "grace_s": 20.0,
        "max_unhealthy": 0,
    },
}


@dataclass
class Cell:
    engine: str
    fault: str
    what: str
    expected: str
    outcome: str = ""
    passed: bool = False
    exit_codes: list[int] = field(default_factory=list)
    bitwise: str = "-"  # yes, NO, or - (not promised)
    recovery_s: float | None = None  # fault -> next completed step
    steps_lost: int | None = None
    in_place: str = "-"  # agent cells: "yes: ..." (sources) or "no: ..." (the fallback's reason)
    data_lost: list[str] = field(default_factory=list)
    seconds: float = 0.0
    run_dir: str = ""


def choose(names: str | None, pool: tuple[Any, ...], what: str) -> list[Any]:
    if names is None:
        return list(pool)
    by = {x.name: x for x in pool}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by]
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {', '.join(by)}")
    return [by[n] for n in wanted]
