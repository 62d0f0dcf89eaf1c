"""NaN forensics on 2 real gloo ranks (DDP): a deterministic origin is located to its
module and direction; a one-shot NaN is classified transient and nothing is quarantined."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from conftest import free_port, kinds, run, train

pytestmark = pytest.mark.timeout(300)


def test_nan_module_is_located(tmp_path: Path) -> None:
    d = tmp_path / "run"
    policy = {
        "diagnose": {"rerun": True},
        "quarantine": {"enabled": False},
        "faults": [{"kind": "nan_module", "module": "blocks.2.attn", "step": 25}],
    }
    r = train(d, 2, "--layers", "3", "--steps", "40", policy=policy, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    (diag,) = kinds(d, "diagnosis")
    assert diag["details"]["incident_step"] == 25
    assert diag["details"]["classification"] == "deterministic"
    assert diag["details"]["located"] == [
        {"module": "blocks.2.attn", "direction": "forward", "rank": 0},
        {"module": "blocks.2.attn", "direction": "forward", "rank": 1},
    ]
    assert len(diag["details"]["batch_ids"]) == 2  # each rank's samples of the bad step
    (rec,) = kinds(d, "recovered")
    assert rec["details"]["incident"]["origin_module"] == "blocks.2.attn"
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 40


def test_one_shot_nan_grad_is_transient(tmp_path: Path) -> None:
    d = tmp_path / "run"
    policy = {
        "diagnose": {"rerun": True},
        "faults": [{"kind": "nan_grad", "step": 25, "rank": 1}],
    }
    r = train(d, 2, "--steps", "40", policy=policy, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    (diag,) = kinds(d, "diagnosis")
    assert diag["details"]["classification"] == "transient"
    assert diag["details"]["located"] == [] and diag["details"]["origin_ranks"] == [1]
    assert kinds(d, "quarantine") == []
    (rb,) = kinds(d, "rollback")
    assert rb["details"]["from_step"] == 25 and rb["details"]["to_step"] == 20
    (adj,) = [e for e in kinds(d, "adjust") if e["details"]["phase"] in ("cut", "kept")]
    assert adj["details"]["phase"] == "kept"  # a one-off says nothing about the LR
    assert [e["details"]["reason"] for e in kinds(d, "health")] == ["incident at step 25"]
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 40


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
