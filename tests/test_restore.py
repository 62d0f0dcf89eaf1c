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
from torch import nn

from conftest import REPO, free_port, run
from inproc import Regression
from orchestrator import Guard, parse_policy

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
