"""Real model code on every engine: tiny Hugging Face Llama and GPT-2 (examples/train_hf.py)
under DDP, FSDP2 (bf16), FSDP1 (use_orig_params False and True) and DeepSpeed ZeRO 1/2/3
(bf16), 2 ranks, gloo. The shapes are the awkward ones: a vocabulary of 1001, a value head of
one row (an empty FSDP2 shard on rank 1), tied (GPT-2) and untied (Llama) embeddings, a
non-persistent rotary buffer, a frozen embedding, two parameter groups and global-norm
clipping (the policy's, or DeepSpeed's own).

Every cell compares final states bit for bit, whole tensors of every rank: the local shards
of model and optimizer, or for DeepSpeed the full fp32 master weights, the ZeRO partitions
and the bit16 module. The default run takes a reduced matrix (every sharded engine once,
both architectures, every property); ``pytest --full-matrix tests/test_models.py`` runs all
fourteen cells.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, assert_bitwise_equal, assert_resharded, final_states, kinds, train

pytest.importorskip("transformers", reason="pip install -e '.[dev]' installs it")

pytestmark = pytest.mark.timeout(600)

HF_EXAMPLE = REPO / "examples" / "train_hf.py"
ENGINES = ["ddp", "fsdp2", "fsdp1", "fsdp1-orig", "zero1", "zero2", "zero3"]
ARCHS = ["llama", "gpt2"]
# Every sharded engine once, each family on both architectures; together they hold every
# property. DDP (replicated, no engine-specific state) in the full matrix: its rollback and
# resume are covered bit for bit by the drill's nan and crash cells, tests/test_durable.py and
# tests/test_accumulation.py, and the policy's clip on these models by
# test_clipping_by_hand_equals_the_policy_clip[ddp].
REDUCED = {
    ("fsdp2", "llama"),
    ("fsdp1", "gpt2"),
    ("fsdp1-orig", "llama"),
    ("zero1", "llama"),
    ("zero2", "gpt2"),
    ("zero3", "llama"),
}
CLIP = 0.5  # below the gradient norms of these models: clipping is active at every step
STEPS = 30
NAN_STEP, CRASH_STEP = 7, 24  # between snapshots 5 and 10; after durable snapshot 20
BASE = {
    "adjust": {"lr_factor": 1.0},
    "quarantine": {"enabled": False},
    "snapshot": {"every_steps": 5},
    "persist": {"every_steps": 10},
}


def cells() -> list[Any]:
    return [
        pytest.param(e, a, id=f"{e}-{a}", marks=() if (e, a) in REDUCED else pytest.mark.matrix)
        for e in ENGINES
        for a in ARCHS
    ]


def hf_train(run_dir: Path, nproc: int, *args: str, policy: dict[str, Any], **kw: Any) -> None:
    r = train(run_dir, nproc, *args, policy=policy, script=HF_EXAMPLE, **kw)
    if r.returncode != 0:
        (run_dir / "output.log").write_text(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:]


def clip_for(engine: str) -> tuple[dict[str, Any], list[str]]:
    """The policy's clip on torch engines; DeepSpeed's gradient_clipping on DeepSpeed."""
    if engine.startswith("zero"):
        return BASE, ["--ds-clip", str(CLIP)]
    return {**BASE, "clip": {"max_norm": CLIP}}, []


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.parametrize(("engine", "arch"), cells())
def test_rollback_and_resume_bit_for_bit(tmp_path: Path, engine: str, arch: str) -> None:
    """A NaN gradient between two snapshots rolls back, then a crash after a durable
    snapshot restarts from it. One faulty run carries both faults: an inexact rollback or an
    inexact resume would each break equality with the clean run."""
    policy, args = clip_for(engine)
    args = ["--engine", engine, "--arch", arch, "--steps", str(STEPS), *args]
    clean = tmp_path / "clean"
    hf_train(clean, 2, *args, policy=policy)
    faults = [
        {"kind": "nan_grad", "step": NAN_STEP, "rank": 1},
        {"kind": "crash", "step": CRASH_STEP, "rank": 1},
    ]
    d = tmp_path / "faulty"
    r = train(d, 2, *args, policy={**policy, "faults": faults}, script=HF_EXAMPLE)
    assert r.returncode != 0 and kinds(d, "resume") == []  # the crash ended the attempt
    hf_train(d, 2, *args, policy={**policy, "faults": faults})

    (inc,) = kinds(d, "incident")
    assert inc["step"] == NAN_STEP and inc["details"]["origin_ranks"][-1] == 1
    (rb,) = kinds(d, "rollback")
    assert (rb["details"]["from_step"], rb["details"]["to_step"]) == (NAN_STEP, 5)
    (resume,) = kinds(d, "resume")
    assert resume["details"]["snapshot_step"] in (10, 20)
    for rank, (a, b) in enumerate(zip(final_states(clean), final_states(d), strict=True)):
        assert a["step"] == b["step"] == STEPS
        assert_bitwise_equal(a, b, f"{engine}/{arch} rank {rank}")
    if not engine.startswith("zero"):  # the journal keeps the norm before clipping
        assert min(m["grad_norm"] for m in metrics(clean)) > CLIP


def test_fsdp2_uneven_and_empty_shards_reshard_two_ranks_to_one(tmp_path: Path) -> None:
    """A durable snapshot of 2 FSDP2 ranks (vocabulary 1001: shards of 501 and 500 rows; the
    value head's one row: an empty shard on rank 1) loads at 1 rank: every tensor is the
    2-rank shards put together, bit for bit, and the next step's loss equals the one the
    2-rank run computes from the same snapshot."""
    policy = {**BASE, "clip": {"max_norm": CLIP}}
    args = ["--engine", "fsdp2", "--arch", "llama"]
    two = tmp_path / "two"
    hf_train(two, 2, *args, "--steps", "10", policy=policy)
    shards = final_states(two)
    lm_head = "lm.lm_head.weight"
    assert [s["model"][lm_head].shape[0] for s in shards] == [501, 500]
    assert [s["model"]["v_head.weight"].numel() for s in shards] == [32, 0]
    one = tmp_path / "one"
    shutil.copytree(two, one)
    shutil.rmtree(one / "final")

    hf_train(one, 1, *args, "--steps", "10", "--batch-size", "8", policy=policy)
    resume = kinds(one, "resume")[-1]["details"]
    assert (resume["snapshot_step"], resume["saved_world_size"], resume["world_size"]) == (10, 2, 1)
    (full,) = final_states(one)
    assert_resharded(full, shards)

    # The step after the snapshot, at 2 ranks (4 samples each) and at 1 rank (all 8).
    hf_train(two, 2, *args, "--steps", "11", policy=policy, save=False)
    hf_train(one, 1, *args, "--steps", "11", "--batch-size", "8", policy=policy, save=False)
    (loss2,) = [m["loss"] for m in metrics(two) if m["step"] == 10]
    (loss1,) = [m["loss"] for m in metrics(one) if m["step"] == 10]
    assert loss1 == pytest.approx(loss2, rel=1e-6)


@pytest.mark.parametrize(
    "engine", ["ddp", "fsdp2", pytest.param("fsdp1", marks=pytest.mark.matrix)]
)
def test_clipping_by_hand_equals_the_policy_clip(tmp_path: Path, engine: str) -> None:
    """Clipping in the loop (``clip_grad_norm_`` on DDP and FSDP2 DTensors, FSDP1's own
    ``clip_grad_norm_`` on its flat shards) trains the same model as the
    policy's ``clip.max_norm``; a Guard that did not clip would differ, as every step's norm
    is above the limit. In fp32: the two compute the same norm in a different order, and
    under bf16 compute a last-bit difference in a weight can flip its bf16 rounding and
    grow from there, which would say nothing about clipping."""
    args = ["--engine", engine, "--arch", "llama", "--steps", "15", "--fp32"]
    by_policy, by_hand = tmp_path / "policy", tmp_path / "hand"
    hf_train(by_policy, 2, *args, policy={**BASE, "clip": {"max_norm": CLIP}})
    hf_train(by_hand, 2, *args, "--clip-by-hand", str(CLIP), policy=BASE)
    assert min(m["grad_norm"] for m in metrics(by_policy)) > CLIP
    # By hand, the Guard sees the gradients after clipping.
    assert max(m["grad_norm"] for m in metrics(by_hand)) == pytest.approx(CLIP, rel=1e-4)
    for a, b in zip(final_states(by_policy), final_states(by_hand), strict=True):
        for name, value in a["model"].items():
            torch.testing.assert_close(value, b["model"][name], rtol=1e-4, atol=1e-6)


def test_compiled_blocks_roll_back_bit_for_bit(tmp_path: Path) -> None:
    """torch.compile (inductor) of every block, per-block FSDP2 on top, as torchtitan
    builds it: the rollback replays through the compiled blocks exactly."""
    args = ["--engine", "fsdp2", "--arch", "gpt2", "--steps", "15", "--compile", "inductor"]
    policy = {**BASE, "clip": {"max_norm": CLIP}}
    clean, d = tmp_path / "clean", tmp_path / "faulty"
    hf_train(clean, 2, *args, policy=policy)
    hf_train(d, 2, *args, policy={**policy, "faults": [{"kind": "nan_grad", "step": 7, "rank": 0}]})
    assert [e["details"]["from_step"] for e in kinds(d, "rollback")] == [7]
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "compiled final")


def test_policy_clip_with_deepspeed_is_refused_at_start(tmp_path: Path) -> None:
    """DeepSpeed clips inside its own step: a policy clip would silently do nothing, so the
    Guard refuses it before training, naming the key and what to use instead."""
    d = tmp_path / "run"
    args = ["--engine", "zero1", "--steps", "2"]
    r = train(d, 2, *args, policy={**BASE, "clip": {"max_norm": CLIP}}, script=HF_EXAMPLE)
    assert r.returncode != 0 and not (d / "journal").exists()
    assert "clip.max_norm" in r.stdout and "gradient_clipping" in r.stdout
