"""Finite divergence caught by default (``detect.spike``, on by default): 2 ranks, DDP, gloo,
the example GPT, the default policy plus one injected fault. A spike is re-run like a NaN:
outlier samples that reproduce it alone, and still spike on an older state, are quarantined;
an LR gone wrong quarantines nothing and is cut."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from conftest import kinds, train
from orchestrator.data import GuardBatchSampler
from orchestrator.detect import SpikeDetector
from orchestrator.policy import SpikePolicy

pytestmark = pytest.mark.timeout(300)


def test_an_lr_blowup_is_an_incident_that_cuts_the_lr_and_quarantines_nothing(
    tmp_path: Path,
) -> None:
    d = tmp_path / "run"
    fault = {"kind": "lr_blowup", "step": 40, "factor": 10.0, "steps": 10}
    r = train(d, 2, "--steps", "80", policy={"faults": [fault]}, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    incidents = kinds(d, "incident")
    assert incidents and all(e["details"]["reason"] == "spike_loss" for e in incidents)
    assert all(40 < e["step"] <= 50 for e in incidents)  # while the LR was wrong
    assert all(e["details"]["cause"] == "unexplained" for e in incidents)
    assert not kinds(d, "quarantine")
    assert not (d / "quarantine.jsonl").exists() or not (d / "quarantine.jsonl").read_text()
    cuts = [e for e in kinds(d, "adjust") if e["details"]["phase"] == "cut"]
    assert len(cuts) == len(incidents) and cuts[0]["details"]["lr_multiplier"] < 1.0
    assert kinds(d, "run_end")[-1]["details"]["status"] == "finished"


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


def decay(tau: float, sigma: float, seed: int, steps: int = 60) -> list[float]:
    """A healthy loss that falls smoothly and flattens: 2.8 + 8 exp(-t / tau) + noise."""
    rng = random.Random(seed)
    return [2.8 + 8 * math.exp(-t / tau) + rng.gauss(0, sigma) for t in range(steps)]


@pytest.mark.timeout(30)
def test_a_flattening_loss_is_no_spike_and_real_spikes_on_it_are_caught() -> None:
    """The default detector on a 60-step decay like a short nanoGPT run's: the detector
    before extrapolated the window's median slope, steeper than the slope now, and called
    11 of these healthy steps spikes (21 ... 54; a run gives up on max_incidents)."""
    xs = decay(30, 0.02, 96)
    det = SpikeDetector(SpikePolicy())
    for step, x in enumerate(xs):
        assert det.check({"loss": x}, step) is None, step
    assert [s for s, _ in det.history["loss"]] == list(range(60))
    for seed in (37, 93):  # two more the old detector flagged (4 and 5 steps)
        det = SpikeDetector(SpikePolicy())
        assert all(det.check({"loss": x}, s) is None for s, x in enumerate(decay(30, 0.02, seed)))
    # A jump of 10 noise units late, and of 30 early while the loss still falls fast.
    for at, jump in ((50, 0.2), (23, 0.6)):
        det = SpikeDetector(SpikePolicy())
        assert all(det.check({"loss": x}, s) is None for s, x in enumerate(xs[:at]))
        hit = det.check({"loss": xs[at] + jump}, at)
        assert hit is not None and hit.z(xs[at] + jump) > 7.0
        assert abs(hit.reference - (2.8 + 8 * math.exp(-at / 30))) < 0.1  # the curve there
        assert det.check({"loss": xs[at]}, at) is None  # not recorded: the bar is unchanged
    # A blow-up: the loss climbs by 0.1 (5 noise units) a step from step 40.
    det = SpikeDetector(SpikePolicy())
    hits = [s for s, x in enumerate(xs) if det.check({"loss": x + 0.1 * max(s - 39, 0)}, s)]
    assert hits and hits[0] <= 42, hits
