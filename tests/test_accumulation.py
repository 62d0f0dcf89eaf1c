"""Gradient accumulation with plain PyTorch engines (``Guard(grad_accum_steps=4)``), 2 ranks,
gloo: the check, snapshots, quarantine and isolation work per optimizer step, rollbacks are
bit for bit, and under DDP only the last micro-batch of a step communicates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, assert_bitwise_equal, final_states, kinds, train
from orchestrator.data import GuardBatchSampler

pytestmark = pytest.mark.timeout(400)

WORKER = REPO / "tests" / "regression_worker.py"
ACCUM, STEPS, SAMPLES, BATCH, SEED = 4, 12, 1024, 8, 3  # the worker's data seed is 3
# LR kept after an incident, so a rolled-back run can end where a clean one does.
EXACT: dict[str, Any] = {"adjust": {"lr_factor": 1.0}, "snapshot": {"every_steps": 5}}


def run(run_dir: Path, engine: str, policy: dict[str, Any]) -> None:
    args = ["--engine", engine, "--accum", str(ACCUM), "--steps", str(STEPS)]
    r = train(run_dir, 2, *args, "--samples", str(SAMPLES), policy=policy, script=WORKER)
    assert r.returncode == 0, r.stdout[-4000:]


def sample_at(step: int, micro: int, rank: int) -> int:
    """A sample rank ``rank`` runs in micro-batch ``micro`` of ``step`` (first epoch, nothing
    quarantined): every micro-batch takes the next global batch of the order."""
    sampler = GuardBatchSampler(SAMPLES, BATCH, rank=rank, world_size=2, seed=SEED)
    offset = (step * ACCUM + micro) * BATCH * 2
    return sampler.batch_at(0, offset)[0][3]


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_transient_nan_in_micro_batch_3_rolls_back_bit_for_bit(
    tmp_path: Path, engine: str
) -> None:
    clean = tmp_path / "clean"
    run(clean, engine, EXACT)
    faulty = tmp_path / "faulty"
    fault = {"kind": "inf_loss", "step": 7, "rank": 1, "micro": 2}
    run(faulty, engine, {**EXACT, "faults": [fault]})
    (inc,) = kinds(faulty, "incident")
    assert inc["step"] == 7 and inc["details"]["origin_ranks"] == [1]
    assert inc["details"]["why"] == "not_reproduced"
    # The bad step's samples are all four micro-batches of each rank.
    assert [len(ids) for ids in inc["details"]["batch_ids"]] == [ACCUM * BATCH] * 2
    (rollback,) = kinds(faulty, "rollback")
    assert rollback["details"]["to_step"] == 5
    for a, b in zip(final_states(clean), final_states(faulty), strict=True):
        assert_bitwise_equal(a, b, f"{engine} final")
    assert all(s["step"] == STEPS for s in final_states(faulty))
    if engine == "ddp":
        # One all-reduce (the model is one bucket) per optimizer step, not per micro-batch.
        counts = [int(p.read_text()) for p in sorted((clean / "final").glob("allreduces*"))]
        assert counts == [STEPS, STEPS]


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_a_poison_sample_in_micro_batch_2_is_isolated_and_quarantined(
    tmp_path: Path, engine: str
) -> None:
    bad = sample_at(step=6, micro=1, rank=0)
    policy = {**EXACT, "faults": [{"kind": "poison_sample", "sample": bad}]}
    faulty = tmp_path / "faulty"
    run(faulty, engine, policy)
    (inc,) = kinds(faulty, "incident")
    assert inc["step"] == 6 and inc["details"]["cause"] == "data"
    (q,) = kinds(faulty, "quarantine")
    assert q["details"]["samples"] == [bad]

    pre = tmp_path / "prequarantined"
    pre.mkdir()
    (pre / "quarantine.jsonl").write_text(json.dumps({"sample": bad}) + "\n")
    run(pre, engine, policy)
    assert not kinds(pre, "incident")
    for a, b in zip(final_states(pre), final_states(faulty), strict=True):
        assert_bitwise_equal(a, b, f"{engine} final")
