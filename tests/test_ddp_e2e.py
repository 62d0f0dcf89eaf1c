"""Acceptance: 2 ranks under torchrun (gloo, CPU) running the example GPT with injected faults.

Each test asserts on final state (bit for bit) and on journal events.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import assert_bitwise_equal, final_states, journal, kinds, prequarantined, train
from orchestrator.data import GuardBatchSampler
from orchestrator.errors import EXIT_GAVE_UP

pytestmark = pytest.mark.timeout(300)

STEPS = ["--steps", "60"]
EXACT = {"adjust": {"lr_factor": 1.0}}  # adjustment off: replays must match a clean run


def poison_id(step: int, world: int = 2) -> int:
    """A sample the example (1024 samples, 8 per rank, seed 7) first meets at ``step``."""
    sampler = GuardBatchSampler(1024, 8, rank=0, world_size=world, seed=7)
    return sampler.global_batch_at(0, step * 8 * world)[world * 8 - 3]  # on the last rank


@pytest.fixture(scope="module")
def clean_exact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("clean") / "run"
    r = train(d, 2, *STEPS, policy={**EXACT, "quarantine": {"enabled": False}})
    assert r.returncode == 0, r.stdout[-3000:]
    return d


# covered by default: the drill's nan cell (DDP, this example, a NaN gradient on the last
# rank rolled back bit for bit), tests/test_models.py's ddp-gpt2 cell and
# tests/test_accumulation.py's ddp cell (the same rollback, its incident and origin rank)
@pytest.mark.matrix
def test_transient_nan_grad_rolls_back_bit_for_bit(tmp_path: Path, clean_exact: Path) -> None:
    policy = {
        **EXACT,
        "quarantine": {"enabled": False},
        "faults": [{"kind": "nan_grad", "step": 37, "rank": 1}],
    }
    d = tmp_path / "run"
    r = train(d, 2, *STEPS, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]

    incidents = kinds(d, "incident")
    assert [(e["step"], e["details"]["origin_ranks"]) for e in incidents] == [(37, [1])]
    rollback = kinds(d, "rollback")
    assert [(e["details"]["from_step"], e["details"]["to_step"]) for e in rollback] == [(37, 30)]
    assert [e["rank"] for e in kinds(d, "fault")] == [1]
    assert kinds(d, "run_end")[0]["details"]["steps"] == 60
    for clean, faulty in zip(final_states(clean_exact), final_states(d), strict=True):
        assert_bitwise_equal(clean, faulty, "final")


# covered by default: tests/test_data_budget.py's ddp cell (samples quarantined, the ledger,
# bit for bit against a prequarantined run), tests/test_accumulation.py's ddp poison cell and
# test_example_demo_prints_account below (this example's poison sample, reproduced and
# quarantined)
@pytest.mark.matrix
def test_poison_sample_quarantined_bit_for_bit(tmp_path: Path) -> None:
    bad = poison_id(45)
    faulty = tmp_path / "faulty"
    r = train(
        faulty, 2, *STEPS, policy={**EXACT, "faults": [{"kind": "poison_sample", "sample": bad}]}
    )
    assert r.returncode == 0, r.stdout[-3000:]
    ledger = [json.loads(x) for x in (faulty / "quarantine.jsonl").read_text().splitlines()]
    assert [e["sample"] for e in ledger] == [bad]
    (q,) = kinds(faulty, "quarantine")
    assert q["details"]["samples"] == [bad] and q["step"] == 45
    (rec,) = kinds(faulty, "recovered")
    assert rec["details"]["incident"]["reproduced"] is True

    # A clean run whose ledger holds the id from the start.
    pre = prequarantined(tmp_path, [bad])
    r = train(pre, 2, *STEPS, policy=EXACT)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not kinds(pre, "incident")
    for a, b in zip(final_states(pre), final_states(faulty), strict=True):
        assert_bitwise_equal(a, b, "final")


# The default adjustment (cut, hold, ramp back; kept for data) runs as threads in
# tests/test_fast_decisions.py, and so does the 2-rank half of the recurring poison below.


def test_recurring_poison_gives_up_with_exit_code(tmp_path: Path) -> None:
    """The worker's own exit code (torchrun reports its own): one process; the gave_up
    event of 2 ranks is tests/test_fast_decisions.py's."""
    policy = {
        "quarantine": {"enabled": False},
        "escalation": {"max_incidents": 2, "window_steps": 100},
        "faults": [{"kind": "poison_sample", "sample": poison_id(12, 1)}],
    }
    d1 = tmp_path / "single"
    r = train(d1, 1, *STEPS, policy=policy, save=False)
    assert r.returncode == EXIT_GAVE_UP, r.stdout[-3000:]
    (gave_up,) = kinds(d1, "gave_up")
    assert len(gave_up["details"]["incidents"]) == 3
    assert len(kinds(d1, "incident")) == 3 and len(kinds(d1, "rollback")) == 2
    assert kinds(d1, "run_end")


def test_example_demo_prints_account(tmp_path: Path) -> None:
    d = tmp_path / "demo"
    r = train(d, 2, "--demo", "--steps", "80", save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    recovered = [e["details"]["incident"] for e in kinds(d, "recovered")]
    assert [(i["step"], i["reproduced"], i["quarantined"]) for i in recovered] == [
        (37, False, []),
        (recovered[1]["step"], True, [123]),
    ]
    assert r.stdout.count("INCIDENT at step") == 2
    assert {e["kind"] for e in journal(d)} >= {
        "run_start",
        "snapshot",
        "incident",
        "quarantine",
        "rollback",
        "adjust",
        "run_end",
    }
