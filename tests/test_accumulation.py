"""Gradient accumulation with plain PyTorch engines (``Guard(grad_accum_steps=4)``), 2 ranks,
gloo: the check, snapshots, quarantine and isolation work per optimizer step, rollbacks are
bit for bit, and under DDP only the last micro-batch of a step communicates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, assert_bitwise_equal, final_states, kinds, prequarantined, train
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


@pytest.mark.parametrize(
    "engine",
    [
        "ddp",
        # FSDP2 in the full matrix: its accumulation rolls back bit for bit in the poison
        # test below (fsdp2 cell), and this test's incident fields are the ddp and fsdp1 cells'
        pytest.param("fsdp2", marks=pytest.mark.matrix),
        "fsdp1",
    ],
)
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

    pre = prequarantined(tmp_path, [bad])
    run(pre, engine, policy)
    assert not kinds(pre, "incident")
    for a, b in zip(final_states(pre), final_states(faulty), strict=True):
        assert_bitwise_equal(a, b, f"{engine} final")


def test_accumulation_across_an_epoch_end_with_a_grad_scaler(tmp_path: Path) -> None:
    """In process, accumulation of 5 with a GradScaler over a dataset that does not divide:
    100 samples give 12 batches of 8 per epoch (4 dropped), so step 2 runs the last two
    batches of epoch 0 and the first three of epoch 1. A NaN in step 3 rolls back to the
    snapshot of step 2's start, in epoch 0: the replay crosses the epoch end again, and the
    run ends bit for bit where a clean one does."""
    from inproc import Regression, events
    from inproc import train as train_inproc

    exact = {"adjust": {"lr_factor": 1.0, "loss_scale_factor": 1.0}, "snapshot": {"every_steps": 2}}

    def scaler() -> torch.amp.GradScaler:
        return torch.amp.GradScaler("cpu", init_scale=2.0**10)

    kw: dict[str, Any] = {"steps": 6, "dataset": Regression(100), "grad_accum_steps": 5}
    _, clean, outcomes = train_inproc(tmp_path / "clean", exact, scaler=scaler(), **kw)
    assert outcomes.count("commit") == 6 and outcomes.count("accumulate") == 6 * 4
    fault = {"kind": "inf_loss", "step": 3, "micro": 3}
    guard, faulty, _ = train_inproc(
        tmp_path / "faulty", {**exact, "faults": [fault]}, scaler=scaler(), **kw
    )
    (inc,) = events(tmp_path / "faulty", "incident")
    assert inc["step"] == 3 and len(inc["details"]["batch_ids"][0]) == 5 * 8
    (rollback,) = events(tmp_path / "faulty", "rollback")
    assert rollback["details"]["to_step"] == 2 and guard.global_step == 6
    assert_bitwise_equal(clean, faulty, "final")
