"""The collective decisions of the Guard on 2 ranks as threads (tests/harness.py): each rank
its own real gloo group and DDP, tests/regression_worker.py's model and data, in one process
(seconds, not a torchrun each). What they assert is the decision every rank takes together:
the rollback, the budgets ending in GaveUp, replica agreement, the same samples quarantined.
End-to-end promises (bit for bit against a separate process, the engine matrix, signals,
crashes, the supervisor) stay with the torchrun tests."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import RankResult, run_ranks, train_regression
from regression_worker import poison_ids

from conftest import assert_bitwise_equal, journal, kinds
from orchestrator.data import GuardBatchSampler
from orchestrator.errors import GaveUp

pytestmark = pytest.mark.timeout(120)

EXACT = {"adjust": {"lr_factor": 1.0}}  # adjustment off: a replay must match a clean run


def poison_id(step: int, samples: int = 4096) -> int:
    """A sample train_regression (8 per rank, seed 3) first meets at ``step``, on rank 1."""
    sampler = GuardBatchSampler(samples, 8, rank=0, world_size=2, seed=3)
    return sampler.global_batch_at(0, step * 16)[16 - 3]


def only(run_dir: Path, kind: str) -> dict[str, Any]:
    (event,) = kinds(run_dir, kind)
    return event["details"]


def ledger(run_dir: Path) -> list[int]:
    lines = (run_dir / "quarantine.jsonl").read_text().splitlines()
    return sorted(json.loads(line)["sample"] for line in lines)


def same_everywhere(results: list[RankResult]) -> None:
    """Every rank took the same branch at every step and holds the same bytes."""
    assert all(r.outcomes == results[0].outcomes for r in results)
    for r in results[1:]:
        assert_bitwise_equal(results[0].state["model"], r.state["model"], "replicas")


def test_the_harness_runs_ranks_on_their_own_groups_and_reraises_a_rank_s_error() -> None:
    def collective(rank: int, world: int) -> tuple[int, float]:
        t = torch.tensor([rank + 1.0])
        torch.distributed.all_reduce(t)
        return torch.distributed.get_rank(), t.item()

    assert run_ranks(collective, 2, timeout_s=30) == [(0, 3.0), (1, 3.0)]

    def fails_on_1(rank: int, world: int) -> None:
        if rank == 1:
            raise ValueError("rank 1's own error")
        torch.distributed.barrier()  # the peer that went away fails it, no hang

    with pytest.raises(AssertionError, match="rank 1 failed") as err:
        run_ranks(fails_on_1, 2, timeout_s=30)
    assert "rank 1's own error" in str(err.value) and "fails_on_1" in str(err.value)

    gone = threading.Event()

    def rank_1_never_comes(rank: int, world: int) -> None:
        if rank == 0:
            torch.distributed.all_reduce(torch.ones(1))  # ends with the group's timeout
        else:
            gone.wait(30)  # a rank stuck elsewhere: the harness times out instead of hanging

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="still running after 2"):
        run_ranks(rank_1_never_comes, 2, timeout_s=2)
    gone.set()
    assert time.monotonic() - t0 < 15


def test_a_nan_on_one_rank_rolls_back_every_rank_identically(tmp_path: Path) -> None:
    clean = train_regression(tmp_path / "clean", EXACT, steps=30)
    fault = {"kind": "nan_grad", "step": 17, "rank": 1}
    policy = {**EXACT, "snapshot": {"every_steps": 5}, "faults": [fault]}
    d = tmp_path / "faulty"
    got = train_regression(d, {**policy}, steps=30)
    (inc,) = kinds(d, "incident")
    assert (inc["step"], inc["details"]["origin_ranks"]) == (17, [1])
    assert inc["details"]["cause"] == "unexplained"
    (rb,) = kinds(d, "rollback")
    assert (rb["details"]["from_step"], rb["details"]["to_step"]) == (17, 15)
    assert [e["rank"] for e in kinds(d, "fault")] == [1]
    same_everywhere(got)
    assert got[0].outcomes.count("incident") == 1 and got[0].step == 30
    for a, b in zip(clean, got, strict=True):  # the replay equals the run without the NaN
        assert_bitwise_equal(a.state, b.state, "final")


def test_a_diverging_model_spends_the_incident_budget(tmp_path: Path) -> None:
    """Clean data, an LR far too high: every sample fails, nothing is quarantined, and the
    run gives up on the unexplained-incident budget (escalation.max_incidents=3), on every
    rank (tests/test_data_budget.py ran it under torchrun)."""
    d = tmp_path / "run"
    got = train_regression(d, {}, optimizer="sgd", lr=50, steps=100)
    assert all(isinstance(r.stop, GaveUp) for r in got), [r.stop for r in got]
    gave_up = only(d, "gave_up")
    assert gave_up["budget"] == "incidents"
    incidents = kinds(d, "incident")
    assert len(incidents) == len(gave_up["incidents"]) == 3 + 1  # the one over the budget
    assert {e["details"]["cause"] for e in incidents} == {"unexplained"}
    assert not kinds(d, "quarantine") and not (d / "quarantine.jsonl").exists()
    assert len({r.step for r in got}) == 1


def test_too_much_bad_data_spends_the_data_budget(tmp_path: Path) -> None:
    """5% of the samples are bad, over quarantine.max_fraction=1%: the run stops on every
    rank, naming the fraction and the ledger, and everything it quarantined is in the ledger
    (tests/test_data_budget.py ran it under torchrun)."""
    d = tmp_path / "run"
    got = train_regression(d, {}, poison=4096 // 20, steps=200)
    assert all(isinstance(r.stop, GaveUp) for r in got), [r.stop for r in got]
    gave_up = only(d, "gave_up")
    assert gave_up["budget"] == "data" and gave_up["ledger"] == str(d / "quarantine.jsonl")
    assert gave_up["fraction"] > 0.01
    quarantined = ledger(d)
    assert quarantined == sorted(gave_up["quarantined"])
    assert set(quarantined) <= set(poison_ids(4096, 4096 // 20))
    assert gave_up["fraction"] == pytest.approx(len(quarantined) / gave_up["samples_seen"])
    assert journal(d)[-1]["kind"] == "run_end"


def test_bad_samples_are_isolated_and_quarantined_alike_on_every_rank(tmp_path: Path) -> None:
    """A few real bad samples (targets of 3e38): each incident is explained by data, the
    ranks agree on the samples (one ledger, every quarantine event names samples of the
    poison set) and on every step's branch, and the LR never leaves 1.0."""
    d = tmp_path / "run"
    got = train_regression(d, {}, samples=1024, poison=4, steps=1024 // 16 + 4)
    assert all(r.stop is None for r in got)
    bad = set(poison_ids(1024, 4))
    assert set(ledger(d)) == bad  # one epoch and a bit: every bad sample met
    events = kinds(d, "quarantine")
    assert events and {s for e in events for s in e["details"]["samples"]} == bad
    for e in kinds(d, "incident"):
        assert e["details"]["cause"] == "data", e
    assert {e["details"]["lr_multiplier"] for e in kinds(d, "adjust")} <= {1.0}
    same_everywhere(got)


def test_an_lr_blowup_is_a_spike_that_cuts_the_lr_and_quarantines_nothing(
    tmp_path: Path,
) -> None:
    """A finite divergence (detect.spike, on by default): the LR made 10x too high for 10
    steps is a spike_loss incident on every rank, explained by nothing, that cuts the LR
    (formerly tests/test_spikes.py, on the example GPT under torchrun)."""
    d = tmp_path / "run"
    # 100x: this model shrugs off 10x (only rank 0 gets it: a replica divergence at step 50).
    fault = {"kind": "lr_blowup", "step": 40, "factor": 100.0, "steps": 10}
    got = train_regression(d, {"faults": [fault]}, samples=1024, steps=80)
    assert all(r.stop is None for r in got)
    incidents = kinds(d, "incident")
    assert incidents and all(e["details"]["reason"] == "spike_loss" for e in incidents)
    assert all(40 < e["step"] <= 50 for e in incidents)  # while the LR was wrong
    assert all(e["details"]["cause"] == "unexplained" for e in incidents)
    assert not kinds(d, "quarantine")
    cuts = [e for e in kinds(d, "adjust") if e["details"]["phase"] == "cut"]
    assert len(cuts) == len(incidents) and cuts[0]["details"]["lr_multiplier"] < 1.0
    assert kinds(d, "run_end")[-1]["details"]["status"] == "finished"
    same_everywhere(got)


def test_a_drifted_replica_is_named_and_rolled_back(tmp_path: Path) -> None:
    """Rank 1's parameters drift outside the Guard at step 25: a ``divergence`` incident at
    the next snapshot step (30), a tie (two replicas), rolled back to the snapshot both
    agreed on; the replay names rank 1 (``divergence_culprit``) and every replica ends with
    the bytes of a run that never drifted."""
    exact = {**EXACT, "persist": {"every_steps": 10}}
    clean = train_regression(tmp_path / "clean", exact, samples=1024, steps=60)
    d = tmp_path / "run"
    fault = {"kind": "perturb_params", "step": 25, "rank": 1}
    got = train_regression(d, {**exact, "faults": [fault]}, samples=1024, steps=60)
    (inc,) = kinds(d, "incident")
    assert inc["step"] == 30
    assert inc["details"]["reason"] == "divergence" and inc["details"]["cause"] == "divergence"
    assert inc["details"]["tied"] is True
    (rb,) = kinds(d, "rollback")
    assert (rb["details"]["from_step"], rb["details"]["to_step"]) == (30, 20)
    assert not kinds(d, "quarantine")
    (adj,) = kinds(d, "adjust")
    assert adj["details"]["phase"] == "kept"
    (named,) = kinds(d, "divergence_culprit")
    assert named["step"] == 30 and named["details"]["ranks"] == [1]
    same_everywhere(got)
    for a, b in zip(clean, got, strict=True):
        assert_bitwise_equal(a.state, b.state, "final")


def test_default_adjustment_cuts_and_ramps_back(tmp_path: Path) -> None:
    """An unexplained incident (a NaN gradient that does not reproduce) cuts the LR, holds it
    and ramps it back; a poisoned sample (explained by data) keeps it (tests/test_ddp_e2e.py
    ran it on the example GPT under torchrun)."""
    policy = {
        "adjust": {"hold_steps": 5, "rewarm_steps": 10},
        "faults": [
            {"kind": "nan_grad", "step": 25, "rank": 1},
            {"kind": "poison_sample", "sample": poison_id(55)},
        ],
    }
    d = tmp_path / "run"
    got = train_regression(d, policy, steps=60)
    assert all(r.stop is None for r in got)
    causes = [
        (e["step"], e["details"]["cause"], e["details"]["budget"]) for e in kinds(d, "incident")
    ]
    assert causes == [(25, "unexplained", "incidents"), (55, "data", "data")]
    adjust = [
        (e["step"], e["details"]["phase"], e["details"]["lr_multiplier"])
        for e in kinds(d, "adjust")
    ]
    rb, rb_data = kinds(d, "rollback")
    to, to_data = rb["details"]["to_step"], rb_data["details"]["to_step"]
    assert adjust == [
        (to, "cut", 0.5),
        (to + 5, "rewarm_start", 0.5),
        (to + 15, "restored", 1.0),
        (to_data, "kept", 1.0),
    ]
    same_everywhere(got)


def test_recurring_poison_gives_up_on_every_rank(tmp_path: Path) -> None:
    """Quarantine off, a poison sample met again after each rollback: the third incident in
    the window is over escalation.max_incidents=2, and every rank stops with GaveUp (the
    2-rank half of tests/test_ddp_e2e.py's test, whose exit code stays there)."""
    policy = {
        "quarantine": {"enabled": False},
        "escalation": {"max_incidents": 2, "window_steps": 100},
        "faults": [{"kind": "poison_sample", "sample": poison_id(12)}],
    }
    d = tmp_path / "run"
    got = train_regression(d, policy, steps=60)
    assert all(isinstance(r.stop, GaveUp) for r in got), [r.stop for r in got]
    (gave_up,) = kinds(d, "gave_up")
    assert len(gave_up["details"]["incidents"]) == 3
    assert len(kinds(d, "incident")) == 3 and len(kinds(d, "rollback")) == 2
    assert kinds(d, "run_end")


def test_a_nan_module_is_located_on_every_rank(tmp_path: Path) -> None:
    """A deterministic NaN from one module (the middle Linear): the re-run reproduces it and
    forensics locate it to that module, forward, on each rank (tests/test_diagnose.py ran it
    on the example GPT's blocks.2.attn under torchrun)."""
    d = tmp_path / "run"
    policy = {
        "diagnose": {"rerun": True},
        "quarantine": {"enabled": False},
        "faults": [{"kind": "nan_module", "module": "2", "step": 25}],
    }
    got = train_regression(d, policy, samples=1024, steps=40)
    assert all(r.stop is None for r in got)
    (diag,) = kinds(d, "diagnosis")
    assert diag["details"]["incident_step"] == 25
    assert diag["details"]["classification"] == "deterministic"
    assert diag["details"]["located"] == [
        {"module": "2", "direction": "forward", "rank": 0},
        {"module": "2", "direction": "forward", "rank": 1},
    ]
    assert len(diag["details"]["batch_ids"]) == 2  # each rank's samples of the bad step
    (rec,) = kinds(d, "recovered")
    assert rec["details"]["incident"]["origin_module"] == "2"
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 40
    same_everywhere(got)


def test_a_one_shot_nan_grad_is_transient(tmp_path: Path) -> None:
    """A NaN gradient on rank 1 that the re-run does not reproduce: transient, nothing
    quarantined, the LR kept, one health check (tests/test_diagnose.py ran it on the example
    GPT under torchrun)."""
    d = tmp_path / "run"
    policy = {
        "diagnose": {"rerun": True},
        "faults": [{"kind": "nan_grad", "step": 25, "rank": 1}],
    }
    got = train_regression(d, policy, samples=1024, steps=40)
    assert all(r.stop is None for r in got)
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
    same_everywhere(got)


def test_outlier_samples_are_quarantined_and_nothing_else(tmp_path: Path) -> None:
    """Finite divergence caught by default (detect.spike): 8 finite outliers in 2048
    samples, each met on rank 1 at steps 25, 35, ... (after the detector's min_history), a
    loss far above the others' (1000 per sample over a batch of 8: this regression's loss
    is of order 1). A spike is re-run like a NaN: an outlier that reproduces it alone is
    quarantined, nothing innocent is (formerly tests/test_spikes.py, on the example GPT under
    torchrun, with 10 against a cross-entropy of about 4)."""
    bad = [poison_id(step, 2048) for step in range(25, 105, 10)]
    d = tmp_path / "run"
    faults = [{"kind": "outlier_sample", "sample": i, "extra": 1000.0} for i in bad]
    got = train_regression(d, {"faults": faults}, samples=2048, steps=128)
    assert all(r.stop is None for r in got)
    quarantined = ledger(d)
    assert quarantined and set(quarantined) <= set(bad), quarantined
    assert len(quarantined) >= 6, quarantined  # nearly every outlier is caught, none innocent
    for e in kinds(d, "incident"):
        assert e["details"]["reason"] == "spike_loss" and e["details"]["cause"] == "data", e
    assert not kinds(d, "gave_up")
    assert kinds(d, "run_end")[-1]["details"]["status"] == "finished"
    same_everywhere(got)
