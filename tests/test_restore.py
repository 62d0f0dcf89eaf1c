"""A rollback restores into the live tensors (issue 30): after it every parameter, buffer
and optimizer-state tensor of every engine is the same object with the same storage as
before, holding the snapshot's bits on every rank, and the step after it replays bit for
bit; so no second copy of the state is ever built, which the host memory a rollback adds
(measured on CPU) shows too."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, free_port, run

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

