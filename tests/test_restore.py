"""A rollback restores into the live tensors (issue 30): after it every parameter, buffer
and optimizer-state tensor of every engine is the same object with the same storage as
before, holding the snapshot's bits on every rank, and the step after it replays bit for
bit; so no second copy of the state is ever built, which the host memory a rollback adds
(measured on CPU) shows too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from inproc import Regression
from torch import nn

from conftest import REPO, free_port, run
from orchestrator import Guard, parse_policy
from orchestrator.errors import PolicyError

pytestmark = pytest.mark.timeout(300)

WORKER = str(REPO / "tests" / "restore_worker.py")


def torchrun(*args: str) -> str:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), WORKER, *args,
    ]  # fmt: skip
    r = run(cmd, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:]
    return r.stdout


@pytest.mark.parametrize("engine", ["ddp", "fsdp1", "fsdp2", "zero1", "zero2", "zero3"])
def test_a_rollback_restores_into_the_live_tensors(engine: str) -> None:
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    out = torchrun("--engine", engine)
    assert "RESTORE-OK rank 0" in out and "RESTORE-OK rank 1" in out, out[-4000:]


def test_a_rollback_adds_far_less_than_a_copy_of_the_state() -> None:
    """64 MiB of parameters under AdamW: 192 MiB of state. Restoring by load_state_dict
    (the optimizer's state rebuilt from copies) added about 128 MiB at its peak; in place,
    next to nothing."""
    r = run([sys.executable, WORKER, "--peak", "64"], timeout=120)
    assert r.returncode == 0, r.stdout[-4000:]
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("PEAK ")]
    peak = json.loads(line[5:])
    assert peak["state_bytes"] >= 192 * 2**20
    assert peak["added_bytes"] < peak["state_bytes"] // 20, peak


def test_a_snapshot_of_batchnorm_statistics_is_the_state_before_the_forward(
    tmp_path: Path,
) -> None:
    """The snapshot of each step is taken before the step's forward, which writes the
    running statistics in place: what the ring holds of them equals a synchronous copy
    taken right before that forward (on a GPU the forward waits for their copy; on CPU
    the same code path copies them first, synchronously)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    policy = {"snapshot": {"every_steps": 1, "keep": 4}, "persist": {"enabled": False}}
    guard = Guard(parse_policy(policy), model=model, optimizer=opt, run_dir=str(tmp_path))
    bn = model[1]
    assert isinstance(bn, nn.BatchNorm1d)
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def before_forward(*_: object) -> None:
        seen.setdefault(guard.global_step, {k: v.clone() for k, v in bn.state_dict().items()})

    model.register_forward_pre_hook(before_forward)
    loader = guard.dataloader(Regression(), batch_size=8, seed=1)
    checked = 0
    for x, y in guard.batches(loader, max_steps=6):
        loss = nn.functional.mse_loss(model(x).squeeze(-1), y)
        guard.backward(loss)
        guard.step(loss)
        step = guard.global_step - 1
        snap = guard.ring.at(step)
        assert snap is not None
        saved = snap.host("model")
        for k, v in seen[step].items():
            assert torch.equal(saved[f"1.{k}"], v), (step, k)
        assert not torch.equal(saved["1.running_mean"], bn.running_mean), "the forward ran"
        checked += 1
    guard.close()
    assert checked == 6


@pytest.mark.parametrize("var", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])
def test_the_ring_budget_counts_the_ranks_of_either_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, var: str
) -> None:
    """torchrun says LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE: either way the
    host-memory check counts 8 ranks on the node, not 1."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    model = nn.Linear(1024, 1024)  # 4 MiB of parameters, 12 MiB with Adam's state
    policy = parse_policy({"snapshot": {"keep": 2, "max_host_memory_gb": 0.1}})
    guard = Guard(policy, model=model, optimizer=torch.optim.Adam(model.parameters()),
                  run_dir=str(tmp_path / "one"))  # fmt: skip
    guard.close()  # one rank: 24 MiB fit in 0.1 GiB
    monkeypatch.setenv(var, "8")
    with pytest.raises(PolicyError, match=r"8 local rank\(s\) x 2 slots"):
        Guard(policy, model=model, optimizer=torch.optim.Adam(model.parameters()),
              run_dir=str(tmp_path / "eight"))  # fmt: skip


def test_ring_slots_are_made_before_training_at_their_reserved_size() -> None:
    """Every slot's host memory is made at the first capture (before training), sized for
    the engine's estimate: the optimizer state the first step creates lands in it, so no
    later capture allocates on the training thread."""
    from orchestrator.engines import engine_for
    from orchestrator.snapshot import SnapshotRing, slot_bytes

    model = nn.Linear(64, 64)
    engine = engine_for(model, torch.optim.Adam(model.parameters()), None, None, None)
    ring = SnapshotRing(3, reserve_bytes=engine.estimate_state_bytes())

    def storages() -> set[int]:
        return {b.untyped_storage().data_ptr() for s in ring.snapshots() for b in s.buffers}

    first = ring.capture(0, engine.state())
    assert first is not None and len(storages()) == 1  # one arena per slot
    made = {a.data_ptr() for a in ring._arenas if a is not None}
    assert len(made) == 3  # every slot's, at the first capture
    # at the size the host-memory check budgets (no rounding up to a power of two)
    budget = slot_bytes(engine.estimate_state_bytes())
    assert all(a is not None and a.numel() == budget for a in ring._arenas)
    first.sealed = True
    model(torch.randn(4, 64)).sum().backward()
    engine.commit(1.0)  # Adam creates its state: the snapshot grows three times
    for step in (1, 2, 3, 4):
        assert ring.capture(step, engine.state()) is not None
        ring.seal_through(step, 1)
    assert storages() == made  # the grown state fit in the slots made before training


def test_a_tensor_lr_is_restored_into_its_tensor_never_aliasing_the_snapshot() -> None:
    """Schedulers fill_ a tensor LR in place: restored, it is the optimizer's own tensor
    again, holding the snapshot's value, and the snapshot stays as it was."""
    from orchestrator.engines import engine_for
    from orchestrator.snapshot import SnapshotRing

    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.1))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine = engine_for(model, opt, sched, None, None)

    def step() -> None:
        model(torch.randn(8, 4)).sum().backward()
        engine.commit(1.0)

    step()
    lr = opt.param_groups[0]["lr"]
    snap = SnapshotRing(2).capture(1, engine.state())
    assert snap is not None
    kept = [b.clone() for b in snap.buffers]
    step()
    engine.restore(snap, 1.0)
    assert opt.param_groups[0]["lr"] is lr and torch.equal(lr, torch.tensor(0.05))
    step()
    step()
    assert all(torch.equal(a, b) for a, b in zip(kept, snap.buffers, strict=True))
