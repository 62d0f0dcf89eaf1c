"""Finite divergence caught by default (``detect.spike``, on by default): 2 ranks, DDP, gloo,
the example GPT, the default policy plus one injected fault. A spike is re-run like a NaN:
outlier samples that reproduce it alone, and still spike on an older state, are quarantined;
an LR gone wrong quarantines nothing and is cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import kinds, train
from orchestrator.data import GuardBatchSampler

pytestmark = pytest.mark.timeout(300)


# An LR blow-up (a spike that cuts the LR and quarantines nothing) runs as threads in
# tests/test_fast_decisions.py.


def outliers(count: int, samples: int, world: int = 2, batch: int = 8) -> list[int]:
    """``count`` samples the example meets at steps 25, 35, ... (after the detector's
    min_history), each on the last rank."""
    sampler = GuardBatchSampler(samples, batch, rank=0, world_size=world, seed=7)
    return [
        sampler.global_batch_at(0, step * batch * world)[world * batch - 3]
        for step in range(25, 25 + 10 * count, 10)
    ]


def test_outlier_samples_are_quarantined_and_nothing_else(tmp_path: Path) -> None:
    """8 finite outliers (a loss 10 higher than the others') in 2048 samples."""
    bad = outliers(8, 2048)
    d = tmp_path / "run"
    faults = [{"kind": "outlier_sample", "sample": i, "extra": 10.0} for i in bad]
    r = train(d, 2, "--steps", "128", "--samples", "2048", policy={"faults": faults}, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    ledger = [json.loads(x)["sample"] for x in (d / "quarantine.jsonl").read_text().splitlines()]
    assert ledger and set(ledger) <= set(bad), ledger
    assert len(ledger) >= 6, ledger  # nearly every outlier is caught, none innocent
    for e in kinds(d, "incident"):
        assert e["details"]["reason"] == "spike_loss" and e["details"]["cause"] == "data", e
    assert not kinds(d, "gave_up")
    assert kinds(d, "run_end")[-1]["details"]["status"] == "finished"
