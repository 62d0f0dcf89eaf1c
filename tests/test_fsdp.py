"""FSDP2 (fully_shard, bf16 compute, fp32 reduce) on 2 CPU ranks: each rank snapshots and
restores only its own shards. Final states are compared shard by shard, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_bitwise_equal, assert_resharded, final_states, kinds, train
from orchestrator.data import GuardBatchSampler

pytestmark = pytest.mark.timeout(300)

STEPS = ["--fsdp", "--steps", "60"]
EXACT = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}}


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("clean") / "run"
    r = train(d, 2, *STEPS, policy={**EXACT, "quarantine": {"enabled": False}})
    assert r.returncode == 0, r.stdout[-3000:]
    return d


@pytest.mark.parametrize(
    "extra",
    [
        # plain: a cell of tests/test_models.py (real models, uneven shards); full matrix only
        pytest.param([], marks=pytest.mark.matrix, id="plain"),
        pytest.param(["--act-ckpt"], id="activation-ckpt"),
    ],
)
def test_fsdp2_transient_nan_rolls_back_bit_for_bit(
    tmp_path: Path, clean: Path, extra: list[str]
) -> None:
    policy = {
        **EXACT,
        "quarantine": {"enabled": False},
        "faults": [{"kind": "nan_grad", "step": 37, "rank": 1}],
    }
    d = tmp_path / "run"
    r = train(d, 2, *STEPS, *extra, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]
    (inc,) = kinds(d, "incident")
    assert inc["step"] == 37 and inc["details"]["origin_ranks"] == [1]
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final shards")


def test_fsdp2_rollback_refuses_a_shard_that_no_longer_matches_its_digest(
    tmp_path: Path, clean: Path
) -> None:
    """Sharded state has no replicas to compare, but every snapshot carries the digest of
    the shard it was taken from: memory gone bad under the newest snapshot (rank 1's
    shared-memory slot, flipped after it was sealed) is caught when the rollback restores
    it, and the rollback goes on to the older snapshot, bit for bit."""
    policy = {
        **EXACT,
        "snapshot": {"shared_memory": True},
        "quarantine": {"enabled": False},
        "faults": [
            {"kind": "corrupt_shm", "step": 22, "rank": 1},
            {"kind": "nan_grad", "step": 25, "rank": 0},
        ],
    }
    d = tmp_path / "run"
    r = train(d, 2, *STEPS, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]
    (bad,) = kinds(d, "restore_mismatch")
    assert bad["details"]["snapshot_step"] == 20
    (rb,) = kinds(d, "rollback")
    assert (rb["details"]["from_step"], rb["details"]["to_step"]) == (25, 10)
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final shards")


# Real bad samples under FSDP2: tests/test_data_budget.py. Full matrix only.
@pytest.mark.matrix
def test_fsdp2_poison_sample_quarantined_bit_for_bit(tmp_path: Path) -> None:
    sampler = GuardBatchSampler(1024, 8, rank=0, world_size=2, seed=7)
    bad = sampler.global_batch_at(0, 45 * 16)[13]
    faulty = tmp_path / "faulty"
    r = train(
        faulty, 2, *STEPS, policy={**EXACT, "faults": [{"kind": "poison_sample", "sample": bad}]}
    )
    assert r.returncode == 0, r.stdout[-3000:]
    (q,) = kinds(faulty, "quarantine")
    assert q["details"]["samples"] == [bad]
    pre = tmp_path / "pre"
    pre.mkdir()
    (pre / "quarantine.jsonl").write_text(json.dumps({"sample": bad}) + "\n")
    r = train(pre, 2, *STEPS, policy=EXACT)
    assert r.returncode == 0, r.stdout[-3000:]
    for a, b in zip(final_states(pre), final_states(faulty), strict=True):
        assert_bitwise_equal(a, b, "final shards")


def test_fsdp2_snapshot_holds_only_local_shards(tmp_path: Path, clean: Path) -> None:
    full = tmp_path / "full"  # the same model and optimizer, unsharded, one process
    r = train(full, 1, "--steps", "10", policy=EXACT, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    full_bytes = max(e["details"]["bytes"] for e in kinds(full, "snapshot"))
    shard_bytes = max(e["details"]["bytes"] for e in kinds(clean, "snapshot"))
    assert shard_bytes <= 0.6 * full_bytes, (shard_bytes, full_bytes)


# Also a cell of tests/test_models.py (real models, uneven shards): full matrix only.
@pytest.mark.matrix
def test_fsdp2_crash_resumes_at_the_same_world_size(tmp_path: Path, clean: Path) -> None:
    d = tmp_path / "run"
    policy = {
        **EXACT,
        "quarantine": {"enabled": False},
        "faults": [{"kind": "crash", "step": 45, "rank": 1}],
    }
    assert train(d, 2, *STEPS, policy=policy).returncode != 0
    r = train(d, 2, *STEPS, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "resume")[0]["details"]["snapshot_step"] in (30, 40)
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final shards")


# With uneven and empty shards: tests/test_models.py. Full matrix only.
@pytest.mark.matrix
def test_fsdp2_snapshot_of_two_ranks_resumes_at_one(tmp_path: Path, clean: Path) -> None:
    """The final durable snapshot of the 2-rank run, loaded by 1 rank: every shard lands
    where it belongs (the 1-rank state is the 2 shards concatenated), and training goes on."""
    d = tmp_path / "run"
    shutil.copytree(clean, d)
    (d / "final").rename(d / "final-2ranks")
    two = [torch.load(f, weights_only=True) for f in sorted((d / "final-2ranks").glob("rank*.pt"))]
    r = train(d, 1, *STEPS, policy={**EXACT, "quarantine": {"enabled": False}})
    assert r.returncode == 0, r.stdout[-3000:]
    resume = kinds(d, "resume")[-1]["details"]
    assert (resume["snapshot_step"], resume["saved_world_size"], resume["world_size"]) == (60, 2, 1)
    (one,) = final_states(d)
    assert_resharded(one, two)
    r = train(d, 1, "--fsdp", "--steps", "70", policy=EXACT, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 70


# Also a cell of tests/test_models.py (real models, uneven shards): full matrix only.
@pytest.mark.matrix
def test_fsdp1_transient_nan_rolls_back_bit_for_bit(tmp_path: Path) -> None:
    base = {**EXACT, "quarantine": {"enabled": False}}
    clean1 = tmp_path / "clean"
    r = train(clean1, 2, "--fsdp1", "--steps", "60", policy=base)
    assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    policy = {**base, "faults": [{"kind": "nan_grad", "step": 37, "rank": 1}]}
    r = train(d, 2, "--fsdp1", "--steps", "60", policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]
    assert [e["step"] for e in kinds(d, "incident")] == [37]
    states = final_states(d)
    assert states[0]["model"]["_fsdp_wrapped_module._flat_param"].dim() == 1  # local shards
    for a, b in zip(final_states(clean1), states, strict=True):
        assert_bitwise_equal(a, b, "final shards")


def test_fsdp1_isolation_reruns_then_a_rollback_and_a_resume_bit_for_bit(tmp_path: Path) -> None:
    """FSDP1 with bf16 mixed precision and the default quarantine (isolation re-runs, judged
    by their loss alone: forwards with no backward), then a crash: the rollback must leave
    no post-backward hook of those forwards behind (the next gradient would land unsharded,
    in bf16, and the optimizer step fail), and the durable snapshot, which holds the model's
    causal mask (-inf, a legitimate non-finite buffer), must be resumed from. Bit for bit
    with a clean run. (The drill found both.)"""
    steps = ["--fsdp1", "--steps", "40"]
    exact = {"adjust": {"lr_factor": 1.0}, "snapshot": {"every_steps": 5},
             "persist": {"every_steps": 10}}  # fmt: skip
    clean1 = tmp_path / "clean"
    r = train(clean1, 2, *steps, policy=exact)
    assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    faults = [{"kind": "inf_loss", "step": 23, "rank": 1},
              {"kind": "crash", "step": 33, "rank": 0, "after_persist": True}]  # fmt: skip
    policy = {**exact, "faults": faults}
    assert train(d, 2, *steps, policy=policy).returncode != 0
    (inc,) = kinds(d, "incident")
    assert inc["step"] == 23 and kinds(d, "rollback")[0]["details"]["to_step"] == 20
    # The isolation re-runs this test is about did run (forwards with no backward).
    assert kinds(d, "recovered")[0]["details"]["incident"]["probe_steps"] > 0
    r = train(d, 2, *steps, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not kinds(d, "snapshot_invalid")
    assert kinds(d, "resume")[0]["details"]["snapshot_step"] == 30
    for a, b in zip(final_states(clean1), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final shards")
