"""Acceptance of the Accelerate integration (docs/accelerate.md): the real Accelerate, 2 CPU
ranks under torchrun (gloo), examples/train_accelerate.py (gradient accumulation 2,
clipping, bf16 autocast, an LR schedule, Accelerate's seedable shuffling loader).

Every comparison is bit for bit on whole tensors, every rank: the model, the inner
optimizer's state, the scheduler's state (and the per-micro-batch losses where the two runs
saw the same batches). Processes, not threads: Accelerate's state is process-wide.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import (
    assert_bitwise_equal,
    final_states,
    free_port,
    kinds,
    prequarantined,
    run,
    spawn,
    train_cmd,
    wait,
)
from orchestrator.stream import StreamSource

pytest.importorskip("accelerate")

pytestmark = pytest.mark.timeout(240)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_accelerate.py"
STEPS = 40  # 16 optimizer steps per epoch: the runs cross two epoch boundaries
EXACT = {"adjust": {"lr_factor": 1.0}}  # adjustment off: replays must match a clean run
POISON = 123  # met on rank 1 at step 4 (the seedable sampler's order, seed 0)
FAST = {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5}


def start(run_dir: Path, *args: str, policy: dict[str, Any] | None = None) -> Any:
    cmd, env = train_cmd(run_dir, 2, "--steps", str(STEPS), *args, policy=policy, script=EXAMPLE)
    # Two runs start at once here. A port picked beforehand can be taken by the other run's
    # connections before this torchrun binds it (EADDRINUSE, seen with the CPU saturated);
    # the standalone rendezvous binds one of the OS's choosing.
    at = cmd.index("--master-addr")
    cmd[at : at + 4] = ["--standalone"]
    return spawn(cmd, env)


def finish(*procs: Any) -> None:
    for proc in procs:
        r = wait(proc, timeout=180)
        assert r.returncode == 0, r.stdout[-3000:]


def model_state(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a run leaves, less its loss record (runs with re-runs and replays record more)."""
    keys = ("model", "optim", "sched", "steps", "accelerator_step")
    return [{k: s[k] for k in keys} for s in states]


def evaluations(states: list[dict[str, Any]]) -> list[dict[int, torch.Tensor]]:
    """Each rank's evaluations (every 10 committed steps) by step. A rollback commits the
    steps after its snapshot again (bit for bit): their evaluation runs again, the same."""
    by_step: list[dict[int, torch.Tensor]] = []
    for s in states:
        mine: dict[int, torch.Tensor] = {}
        for step, value in s["evals"]:
            assert step not in mine or torch.equal(mine[step], value), f"step {step} differs"
            mine[step] = value
        by_step.append(mine)
    return by_step


def assert_committed(states: list[dict[str, Any]]) -> None:
    """The Guard's committed steps are the optimizer steps Accelerate applied: the inner
    optimizer's step count, the scheduler's (Accelerate steps it once per process per
    optimizer step) and Accelerate's micro-batch counter."""
    for s in states:
        assert s["steps"] == STEPS
        assert all(int(v["step"]) == STEPS for v in s["optim"]["state"].values())
        assert s["sched"]["last_epoch"] == 2 * STEPS
        assert s["accelerator_step"] == 2 * STEPS  # gradient accumulation 2


def assert_replicas_agree(states: list[dict[str, Any]]) -> None:
    first, *rest = model_state(states)
    for other in rest:
        assert_bitwise_equal(first, other, "replicas")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Accelerate alone (``--plain``) and the same script with the Guard, no incident."""
    base = tmp_path_factory.mktemp("healthy")
    plain, guarded = base / "plain", base / "guarded"
    finish(start(plain, "--plain"), start(guarded, policy=EXACT))
    return plain, guarded


def test_healthy_run_is_accelerate_alone_bit_for_bit(healthy: tuple[Path, Path]) -> None:
    plain, guarded = (final_states(d) for d in healthy)
    assert len(plain) == len(guarded) == 2
    for rank, (a, b) in enumerate(zip(plain, guarded, strict=True)):
        assert a["losses"].numel() == 2 * STEPS
        assert [step for step, _ in a["evals"]] == [10, 20, 30, 40]
        # Accelerate alone resets its micro-batch counter at each end of its loader (it is
        # 16 here); the Guard keeps it at the micro-batches of the committed steps.
        del a["accelerator_step"], b["accelerator_step"]
        assert_bitwise_equal(a, b, f"rank{rank}")  # losses, model, optimizer, scheduler
    assert_committed(final_states(healthy[1]))
    assert_replicas_agree(final_states(healthy[1]))
    assert kinds(healthy[1], "incident") == []


def test_poison_quarantined_and_transient_rolled_back_bit_for_bit(tmp_path: Path) -> None:
    """A poisoned sample (quarantined, rolled back to step 0 after 7 re-runs) and a transient
    NaN gradient on rank 1 at step 30: the final state is a clean run's whose ledger held the
    sample from the start. The re-runs move Accelerate's own accumulation counter; left
    there, ``accumulate`` would fall off the Guard's step boundaries (this run then gives
    up: every step applies gradients out of phase)."""
    faults = [
        {"kind": "poison_sample", "sample": POISON},
        {"kind": "nan_grad", "step": 30, "rank": 1},
    ]
    ref = prequarantined(tmp_path, [POISON])
    d = tmp_path / "run"
    # With a loader worker: the Guard's loader takes the prepared loader's worker settings.
    workers = ("--workers", "1")
    finish(
        start(ref, *workers, policy=EXACT), start(d, *workers, policy={**EXACT, "faults": faults})
    )
    assert [e["details"]["samples"] for e in kinds(d, "quarantine")] == [[POISON]]
    rollbacks = [(e["details"]["from_step"], e["details"]["to_step"]) for e in kinds(d, "rollback")]
    assert rollbacks == [(4, 0), (30, 20)]
    states = final_states(d)
    assert_bitwise_equal(model_state(final_states(ref)), model_state(states), "final")
    assert_bitwise_equal(evaluations(final_states(ref)), evaluations(states), "evaluations")
    assert_committed(states)
    assert_replicas_agree(states)


def test_rollback_at_last_micro_then_more_steps_replicas_agree(
    tmp_path: Path, healthy: tuple[Path, Path]
) -> None:
    """A NaN in micro-batch 1 of 2 (the one whose backward all-reduces), rolled back, then
    20 more steps: the replicas agree and the run equals the healthy one, bit for bit."""
    d = tmp_path / "run"
    fault = {"kind": "nan_grad", "step": 20, "rank": 0, "micro": 1}
    finish(start(d, policy={**EXACT, "quarantine": {"enabled": False}, "faults": [fault]}))
    assert [e["details"]["from_step"] for e in kinds(d, "rollback")] == [20]
    states = final_states(d)
    assert_bitwise_equal(model_state(final_states(healthy[1])), model_state(states), "final")
    # Step 20 was evaluated, rolled back past (to 10) and committed again: evaluated twice.
    assert [step for step, _ in states[0]["evals"]] == [10, 20, 20, 30, 40]
    assert_bitwise_equal(evaluations(final_states(healthy[1])), evaluations(states), "evals")
    assert_committed(states)
    assert_replicas_agree(states)


def test_sigkilled_rank_restarts_and_resumes_bit_for_bit(
    tmp_path: Path, healthy: tuple[Path, Path]
) -> None:
    d = tmp_path / "run"
    policy = {
        **EXACT,
        "persist": {"every_steps": 10},
        "supervisor": FAST,
        "faults": [{"kind": "crash", "step": 25, "rank": 0}],
    }
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
                "--steps", str(STEPS), "--save-final", str(d / "final")]  # fmt: skip
    launch = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
              "--run-dir", str(d), "--"]  # fmt: skip
    r: subprocess.CompletedProcess[str] = run([*launch, *torchrun])
    assert r.returncode == 0, r.stdout[-3000:]
    (restart,) = kinds(d, "restart")
    assert restart["details"]["cause"] == "crash" and restart["step"] == 25
    (resume,) = kinds(d, "resume")
    assert resume["attempt"] == 1 and resume["details"]["snapshot_step"] in (10, 20)
    states = final_states(d)
    assert_bitwise_equal(model_state(final_states(healthy[1])), model_state(states), "final")
    assert_committed(states)


def test_rollback_to_the_first_snapshot_replays_epoch_0() -> None:
    """A user sampler's loader restored to the position before its first pass replays
    epoch 0 (it asked the sampler for epoch -1: another order)."""

    class Recording(torch.utils.data.Sampler[int]):
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __iter__(self) -> Any:
            return iter(range(8))

        def __len__(self) -> int:
            return 8

    sampler = Recording()
    source = StreamSource(
        list(range(8)), 2, rank=0, world_size=1, quarantined=set(), sampler=sampler
    )
    initial = source.position()
    source.open("")
    first = source.fetch()
    source.restore(*initial)
    source.open("")
    again = source.fetch()
    assert first is not None and again is not None and first[0] == again[0] == [0, 1]
    assert sampler.epochs == [0, 0]


USAGE = """
import sys, torch
from accelerate import Accelerator
from orchestrator.errors import UsageError
from orchestrator.integrations.accelerate import guard_accelerate

run_dir = sys.argv[1]
accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
data = [{"x": torch.full((4,), float(i))} for i in range(32)]
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
ordered = torch.utils.data.DataLoader(data, batch_size=2)
shuffled = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
model, opt, ordered, shuffled, sched = accelerator.prepare(model, opt, ordered, shuffled, sched)

# optimizer.step() only when Accelerate syncs: the micro-batches before accumulate as usual
guard = guard_accelerate(accelerator, run_dir=run_dir + "/a")
for batch in guard.batches(ordered, max_steps=4):
    with accelerator.accumulate(model):
        accelerator.backward(model(batch["x"]).mean())
        if accelerator.sync_gradients:
            opt.step(); sched.step(); opt.zero_grad()
guard.close()
print("steps", guard.global_step, opt.state_dict()["state"].get(0), sched.scheduler.last_epoch)

# no optimizer.step() at all: refused at the step's last micro-batch
guard = guard_accelerate(accelerator, run_dir=run_dir + "/b")
try:
    for batch in guard.batches(ordered, max_steps=4):
        with accelerator.accumulate(model):
            accelerator.backward(model(batch["x"]).mean())
except UsageError as err:
    print("refused", "optimizer.step()" in str(err))
guard.close(persist=False)

# a RandomSampler whose order is not a function of the epoch: refused, saying what to do
guard = guard_accelerate(accelerator, run_dir=run_dir + "/c")
try:
    next(guard.batches(shuffled, max_steps=4))
except UsageError as err:
    print("refused", "use_seedable_sampler=True" in str(err))
guard.close(persist=False)

# an Accelerate without an internal the integration reads: named at start, with the version
del accelerator.step
try:
    guard_accelerate(accelerator, run_dir=run_dir + "/d")
except UsageError as err:
    print("refused", "has no 'step'" in str(err) and "Accelerate 1." in str(err))
"""


def test_step_only_on_sync_and_what_is_refused(tmp_path: Path) -> None:
    """One process: a body that steps only when Accelerate syncs commits every step; a body
    without optimizer.step(), a loader whose shuffle cannot be replayed and an Accelerate
    without an internal the integration reads are refused, saying so."""
    r = run([sys.executable, "-c", USAGE, str(tmp_path)], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith(("steps", "refused"))]
    assert lines == ["steps 4 None 4", *["refused True"] * 3], r.stdout[-3000:]


SCALER = """
import os, sys, torch
sys.path[:0] = sys.argv[2].split(os.pathsep)
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from conftest import assert_bitwise_equal
from train_accelerate import MLP, Regression, plain_batches, train_step
from orchestrator import parse_policy
from orchestrator.integrations.accelerate import guard_accelerate

def run(guarded):
    acc = Accelerator(gradient_accumulation_steps=2, cpu=True,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    # Accelerate's fp16 needs a GPU; its GradScaler path is the same with a CPU scaler, at a
    # scale so large that the first step overflows (skipped, the scale halved).
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126)
    set_seed(0)
    model = MLP(16, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    loader = torch.utils.data.DataLoader(Regression(64, 16), batch_size=4, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    if guarded:
        guard = guard_accelerate(acc, parse_policy({}), run_dir=sys.argv[1])
        batches = guard.batches(loader, max_steps=20)
    else:
        batches = plain_batches(acc, loader, 20)
    losses = [train_step(acc, model, opt, sched, batch) for batch in batches]
    if guarded:
        guard.close()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
            "scaler": acc.scaler.state_dict(), "losses": torch.stack(losses)}

alone, guarded = run(False), run(True)
assert_bitwise_equal(alone, guarded, "alone vs guarded")
print("skipped", 20 - guarded["sched"]["last_epoch"], "scale", guarded["scaler"]["scale"])
"""


def test_grad_scaler_overflow_skips_as_accelerate_alone(tmp_path: Path) -> None:
    """With Accelerate's GradScaler, an overflowed step is skipped by the scaler, the
    scheduler skips it too, and the whole run (scaler state included) is Accelerate alone's,
    bit for bit (one process: two Accelerators, one after the other)."""
    here = Path(__file__).resolve().parent
    paths = f"{here}{os.pathsep}{here.parent / 'examples'}"
    r = run([sys.executable, "-c", SCALER, str(tmp_path / "run"), paths], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    assert f"skipped 1 scale {2.0**125}" in r.stdout, r.stdout[-3000:]
