"""NaN forensics: fp16 precision told from data, the fp32 re-run inside the loop's own
autocast, a NaN tied to the step's dropout. (A deterministic origin located to its module
and direction, and a one-shot NaN classified transient, on 2 gloo ranks: in
tests/test_fast_decisions.py.)"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import free_port, kinds, run

pytestmark = pytest.mark.timeout(300)


# A NaN module located on each rank, and a one-shot NaN gradient classified transient, run
# as threads in tests/test_fast_decisions.py (2 gloo ranks, DDP, no torchrun).


@pytest.mark.parametrize(
    ("args", "faults", "expected"),
    [
        (["--big"], [], "precision"),  # inf in fp16, finite in fp32
        ([], [{"kind": "poison_sample", "sample": 5}], "data_or_model"),  # NaN at any precision
    ],
    ids=["precision", "data_or_model"],
)
def test_fp16_forensics_tells_precision_from_data(
    tmp_path: Path, args: list[str], faults: list[dict[str, object]], expected: str
) -> None:
    d = tmp_path / "run"
    d.mkdir()
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"diagnose": {"rerun": True}, "faults": faults}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(Path(__file__).parent / "fp16_model.py"), *args]  # fmt: skip
    r = run(cmd, env={"RUN_DIR": str(d), "ORCHESTRATOR_POLICY": str(policy)})
    assert r.returncode == 0, r.stdout[-3000:]
    (diag,) = kinds(d, "diagnosis")
    assert diag["details"]["classification"] == expected
    # The fp32 re-run leaves DDP's gradient hooks in place: the replicas never drift (it
    # once swapped parameters' dtype in place, which dropped them: the replica digest
    # caught the drift as divergence incidents at the next snapshot).
    assert all(e["details"]["reason"] != "divergence" for e in kinds(d, "incident"))
    (q,) = kinds(d, "quarantine")
    assert q["details"]["samples"] == ([77] if expected == "precision" else [5])
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 30


# --- the fp32 re-run and the step's RNG, in one process ---------------------------------
class _Trap(torch.nn.Module):
    """Records the dtype its input (a Linear's output) had in every forward at ``step``;
    with ``bf16_nan`` its output is NaN whenever that input is bf16 (a value the format
    cannot hold: the fp32 re-run is finite); with ``mask_nan`` it is NaN whenever its
    dropout mask is the one the real step drew (a NaN tied to the step's randomness)."""

    def __init__(self, step: int, bf16_nan: bool = False, mask_nan: bool = False) -> None:
        super().__init__()
        self.step, self.bf16_nan, self.mask_nan = step, bf16_nan, mask_nan
        self.now = -1  # the Guard's step, set by the loop
        self.seen: list[torch.dtype] = []
        self.masks: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.nn.functional.dropout(torch.ones(16), 0.5, training=True) == 0
        if self.now != self.step:
            return x
        self.seen.append(x.dtype)
        self.masks.append(mask)
        bad = (self.bf16_nan and x.dtype == torch.bfloat16) or (
            self.mask_nan and torch.equal(mask, self.masks[0])
        )
        return x * float("nan") if bad else x


def _forensics(run_dir: Path, trap: _Trap, autocast: bool) -> list[dict[str, Any]]:
    from inproc import Regression, events

    from orchestrator import Guard, parse_policy

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), trap, torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    policy = {
        "diagnose": {"rerun": True},
        "quarantine": {"enabled": False},
        "persist": {"enabled": False},
        "snapshot": {"every_steps": 5},
    }
    guard = Guard(parse_policy(policy), model=model, optimizer=opt, run_dir=str(run_dir))
    loader = guard.dataloader(Regression(), batch_size=8, seed=1)
    for x, y in guard.batches(loader, max_steps=12):
        trap.now = guard.global_step if guard.rollbacks == 0 else -1  # the replay is clean
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x).squeeze(-1)
        loss = torch.nn.functional.mse_loss(out.float(), y)
        guard.backward(loss)
        guard.step()
    guard.close()
    return events(run_dir, "diagnosis")


@pytest.mark.timeout(60)
def test_fp32_rerun_is_fp32_inside_the_loops_own_autocast(tmp_path: Path) -> None:
    """fp32 parameters, ``torch.autocast('cpu', bf16)`` in the loop body: the step ran in
    bf16, so forensics re-runs it in fp32, and the loop's autocast stays off in there."""
    trap = _Trap(step=7, bf16_nan=True)
    (diag,) = _forensics(tmp_path / "run", trap, autocast=True)
    # The real step and the whole-step re-run in bf16, then the fp32 re-run.
    assert trap.seen == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert diag["step"] == 7 and diag["details"]["classification"] == "precision"
    assert diag["details"]["located"] == [{"module": "1", "direction": "forward", "rank": 0}]
    assert not torch.is_autocast_enabled("cpu")  # all as it was after the re-run
    with torch.autocast("cpu", dtype=torch.bfloat16):  # and autocast works again
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16


@pytest.mark.timeout(60)
def test_a_nan_tied_to_the_steps_dropout_reproduces_in_the_rerun(tmp_path: Path) -> None:
    """The re-run starts from the RNG the bad step started from: the same dropout mask,
    the same NaN: reproducible (``deterministic``), not ``transient``."""
    trap = _Trap(step=7, mask_nan=True)
    (diag,) = _forensics(tmp_path / "run", trap, autocast=False)
    assert len(trap.masks) == 2 and torch.equal(trap.masks[0], trap.masks[1])
    assert diag["details"]["classification"] == "deterministic"
