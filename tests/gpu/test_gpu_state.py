"""The user's own state on a GPU: its tensors are copied into the ring on the side stream,
the ones the loop body updates before ``guard.step`` (a counter) before the forward runs,
so a rollback restores them bit for bit with the model.

Skipped without CUDA (CI has none). On a GPU node: ``python -m pytest tests/gpu -v``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from inproc import events
from stateful_worker import run

from conftest import assert_bitwise_equal
from orchestrator import parse_policy

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (tests/gpu runs on a GPU node)"
)

EXACT: dict[str, Any] = {"adjust": {"lr_factor": 1.0}, "quarantine": {"enabled": False}}


@pytest.mark.timeout(300)
def test_user_state_on_the_gpu_rolls_back_bit_for_bit(tmp_path: Path) -> None:
    def train(d: Path, policy: dict[str, Any]) -> dict[str, Any]:
        args = {"policy": parse_policy(policy), "run_dir": str(d)}
        _, final = run(args, 40, device="cuda")
        return final

    clean = train(tmp_path / "clean", EXACT)
    faults = [{"kind": "nan_grad", "step": 23}, {"kind": "nan_grad", "step": 25}]
    faulty = train(tmp_path / "faulty", {**EXACT, "faults": faults})
    assert [e["details"]["to_step"] for e in events(tmp_path / "faulty", "rollback")] == [20, 20]
    assert faulty["ema"]["0.weight"].is_cuda and faulty["seen"].is_cuda
    assert_bitwise_equal(clean, faulty, "final")
