"""In-place recovery (issue 33) with the model and its snapshots on a GPU: rank 1 SIGKILLed
at step 27 under ``orchestrator launch --nproc-per-node 2``; rank 0's process stays, and
the final state equals an uninterrupted run's bit for bit on both ranks. On one GPU both
ranks share it over gloo (CUDA tensors through gloo's host staging); with two, NCCL.

Skipped without CUDA (CI has none). On a GPU node: ``python -m pytest tests/gpu -v -s``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from conftest import assert_bitwise_equal, kinds, run

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (tests/gpu runs on a GPU node)"
)
WORKER = Path(__file__).resolve().parent / "inplace_gpu_worker.py"
POLICY: dict[str, Any] = {
    "adjust": {"lr_factor": 1.0},
    "quarantine": {"enabled": False},
    "health": {"preflight": False},
    "snapshot": {"every_steps": 5, "keep": 3},
    "persist": {"every_steps": 10},
    "supervisor": {"backoff_s": 0.2},
}
CRASH = [{"kind": "crash", "step": 27, "rank": 1}]


def launch(tmp: Path, name: str, policy: dict[str, Any]) -> Path:
    d = tmp / name
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path), "--run-dir",
           str(d), "--nproc-per-node", "2", str(WORKER), "--out", str(d / "out")]  # fmt: skip
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OMP_NUM_THREADS": "1"}
    r = run(cmd, env={**os.environ, **env}, timeout=240)
    assert r.returncode == 0, r.stdout[-4000:]
    said = [x for x in r.stdout.splitlines() if "in-place" in x or "falls back" in x]
    print(f"\n{name}: " + "\n".join(said[-12:]))
    return d


def finals(d: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(d / "out" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "no-shm"])
def test_a_dead_rank_is_replaced_in_place_on_the_gpu_bit_for_bit(tmp_path: Path, shm: bool) -> None:
    snap = {**POLICY["snapshot"], "shared_memory": shm}
    clean = launch(tmp_path, "clean", {**POLICY, "snapshot": snap})
    faulty = launch(tmp_path, "faulty", {**POLICY, "snapshot": snap, "faults": CRASH})
    print(json.dumps([e["details"] for e in kinds(faulty, "inplace_failed")])[:3000])
    starts = [json.loads(x) for x in (faulty / "out" / "starts.jsonl").read_text().splitlines()]
    assert sorted(s["rank"] for s in starts) == [0, 1, 1], starts  # rank 0 started once
    (ev,) = kinds(faulty, "inplace_recovery")
    print(f"\ninplace ({'shm' if shm else 'no shm'}): {json.dumps(ev['details'])[:1500]}")
    info = json.loads((faulty / "out" / "rank0.json").read_text())
    print(f"device {info['device']} backend {info['backend']}")
    assert info["pid"] == next(s["pid"] for s in starts if s["rank"] == 0)
    for r, (a, b) in enumerate(zip(finals(clean), finals(faulty), strict=True)):
        assert_bitwise_equal(a, b, f"rank {r}")
    assert_bitwise_equal(finals(faulty)[0], finals(faulty)[1], "replicas")
