"""NaN forensics on 2 real gloo ranks (DDP): a deterministic origin is located to its
module and direction; a one-shot NaN is classified transient and nothing is quarantined."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import kinds, train

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
