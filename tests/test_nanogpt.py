"""Loops like nanoGPT's: token windows whose id is their offset (orchestrator/samplers.py),
``Value`` in snapshots, the LR set by hand from ``guard.global_step``, clipping by hand at
``guard.last_micro``; and examples/train_nanogpt.py rolled back and resumed, bit for bit."""

from __future__ import annotations

import copy
import json
import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import RankFailed, run_ranks
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import REPO, assert_bitwise_equal, final_states, kinds, train
from launch.report import load, totals
from orchestrator import Guard, Value, parse_policy
from orchestrator.audit import audit
from orchestrator.protocol import LEDGER_NAME
from orchestrator.samplers import RandomOffsetSampler, TokenStreamSampler, WindowDataset

sys.path.insert(0, str(REPO / "examples"))
from train_nanogpt import GPT, get_lr, parse

pytestmark = pytest.mark.timeout(300)


def test_random_offsets_are_a_pure_function_of_seed_epoch_and_draw() -> None:
    """Draw j of an epoch depends on (seed, epoch, j) only: not on torch's RNG, not on
    where iteration started; rank r of w takes draws k * w + r of the one stream."""
    one = RandomOffsetSampler(5000, 16, seed=3, rank=0, world_size=1)
    whole = list(one)
    assert len(whole) == 5000 - 16 and all(0 <= i < 5000 - 16 for i in whole)
    assert len(set(whole)) > 0.5 * len(whole)  # draws, not a constant
    torch.manual_seed(123)  # the global RNG (dropout, evaluation) moves nothing
    torch.rand(1000)
    assert list(RandomOffsetSampler(5000, 16, seed=3, rank=0, world_size=1)) == whole
    assert list(one.iter_from(4000)) == whole[4000:]  # a resume starts at its position
    ranks = [RandomOffsetSampler(5000, 16, seed=3, rank=r, world_size=2) for r in (0, 1)]
    for r, sampler in enumerate(ranks):
        assert len(sampler) == (5000 - 16) // 2
        assert list(sampler)[:100] == whole[r:200:2]
    one.set_epoch(1)  # each epoch draws anew, and again the same way
    assert list(one)[:50] != whole[:50]
    assert list(one)[:50] == list(one.iter_from(0))[:50]
    other = RandomOffsetSampler(5000, 16, seed=4, rank=0, world_size=1)
    assert list(other)[:50] != whole[:50]
    short = RandomOffsetSampler(5000, 16, seed=3, rank=0, world_size=1, samples_per_epoch=7)
    assert list(short) == whole[:7] and list(short.iter_from(7)) == []
    with pytest.raises(ValueError, match="block_size"):
        RandomOffsetSampler(16, 16)


def test_token_stream_windows_are_in_order_and_sharded() -> None:
    """Windows every ``stride`` tokens; rank r takes every w-th from the r-th; every rank
    as many (the tail dropped)."""
    both = [TokenStreamSampler(100, 8, rank=r, world_size=2) for r in (0, 1)]
    assert [list(s) for s in both] == [[0, 16, 32, 48, 64, 80], [8, 24, 40, 56, 72, 88]]
    assert list(both[1].iter_from(4)) == [72, 88]
    overlapping = TokenStreamSampler(20, 8, stride=4, rank=0, world_size=1)
    assert list(overlapping) == [0, 4, 8]  # 11 fits no window of 8 + 1 tokens
    with pytest.raises(ValueError, match="fewer windows than ranks"):
        TokenStreamSampler(10, 8, rank=0, world_size=4)


def test_window_dataset_reads_a_memmap_as_nanogpt_does(tmp_path: Path) -> None:
    """(x, y) at an offset: the window and the same shifted by one token, as int64, from a
    uint16 file (mapped in the process that reads it: a pickle carries no data) or a
    tensor."""
    tokens = (np.arange(300) * 7 % 50_000).astype(np.uint16)
    path = tmp_path / "train.bin"
    tokens.tofile(path)
    ds = WindowDataset(path, 8)
    assert ds.n_tokens == 300 and len(ds) == 292
    x, y = ds[5]
    assert x.dtype == torch.int64
    assert torch.equal(x, torch.from_numpy(tokens[5:13].astype(np.int64)))
    assert torch.equal(y, torch.from_numpy(tokens[6:14].astype(np.int64)))
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._data is None and torch.equal(copy[291][1], ds[291][1])
    same = WindowDataset(torch.from_numpy(tokens.astype(np.int64)), 8)
    assert all(torch.equal(a, b) for a, b in zip(same[100], ds[100], strict=True))
    with pytest.raises(IndexError):
        ds[292]


def test_value_holds_one_value_for_snapshots() -> None:
    best = Value(1e9)
    state = best.state_dict()
    best.value = 2.5
    assert best.state_dict() == {"value": 2.5}
    best.load_state_dict(state)
    assert best.value == 1e9 and repr(best) == "Value(1000000000.0)"


# --- the loop, 2 ranks as threads (tests/harness.py) ------------------------------------
BLOCK, BATCH, ACCUM = 16, 4, 2
TOKENS = torch.randint(0, 64, (3000,), generator=torch.Generator().manual_seed(0))


# Draws per rank per epoch: 4 steps' worth, so a snapshot every 4 steps is taken at an
# epoch's end (a rollback or a resume to it starts with an ended pass).
PER_EPOCH = 4 * ACCUM * BATCH


def draw_at(step: int, micro: int, row: int, rank: int = 0) -> int:
    """The offset rank ``rank`` draws at (step, micro, row), nothing quarantined before."""
    sampler = RandomOffsetSampler(
        len(TOKENS), BLOCK, seed=5, rank=rank, world_size=2, samples_per_epoch=PER_EPOCH
    )
    epoch, draw = divmod((step * ACCUM + micro) * BATCH + row, PER_EPOCH)
    sampler.set_epoch(epoch)
    return int(sampler.offsets(draw, 1)[0])


POISON = 64  # a token outside the model's vocabulary: any window holding it has a NaN loss


class LoggedWindows(WindowDataset):
    """A WindowDataset that records the offsets it reads (num_workers=0: in the rank)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        super().__init__(tokens, block_size)
        self.read: list[int] = []

    def __getitem__(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.read.append(int(offset))
        return super().__getitem__(offset)


def nano_loop(
    run_dir: Path, policy: dict[str, Any], steps: int, tokens: torch.Tensor = TOKENS
) -> list[dict[str, Any]]:
    """examples/train_nanogpt.py's loop on 2 thread ranks: DDP, random windows, gradient
    accumulation 2, the cosine LR set from guard.global_step before every micro-batch,
    clipping by hand at guard.last_micro, best_val_loss a Value. Each rank returns its
    final state and, per committed step, (step, guard.lr before it, the LR the optimizer
    stepped with, the group's LR after it); the offsets its dataset read, and how many it
    had read when the first quarantine was in place. A batch holding the token POISON
    has a NaN loss (a bad token in the data)."""
    a = parse(["--learning-rate", "1e-2", "--warmup-iters", "3", "--lr-decay-iters", "20"])
    torch.manual_seed(0)  # here, once: the threads share torch's global RNG
    base = GPT(64, BLOCK, n_layer=1, n_head=2, n_embd=16)
    models = [copy.deepcopy(base) for _ in range(2)]

    def rank_main(rank: int, _: int) -> dict[str, Any]:
        model = DDP(models[rank])
        opt = torch.optim.AdamW(model.parameters(), lr=a.learning_rate)
        applied: list[float] = []
        opt.register_step_pre_hook(lambda o, *_: applied.append(o.param_groups[0]["lr"]))
        guard = Guard(
            parse_policy(policy), model=model, optimizer=opt, grad_accum_steps=ACCUM,
            run_dir=str(run_dir),
        )  # fmt: skip
        best = Value(1e9)
        guard.register_state("best_val_loss", best)
        sampler = RandomOffsetSampler(len(tokens), BLOCK, seed=5, samples_per_epoch=PER_EPOCH)
        data = LoggedWindows(tokens, BLOCK)
        loader = guard.dataloader(data, BATCH, sampler=sampler)
        steps_seen: list[tuple[int, float, float]] = []
        marked: int | None = None
        for X, Y in guard.batches(loader, max_steps=steps):
            lr = get_lr(guard.global_step, a)
            for group in opt.param_groups:
                group["lr"] = lr
            poisoned = bool((X == POISON).any() or (Y == POISON).any())
            _, loss = model(X.clamp(max=POISON - 1), Y.clamp(max=POISON - 1))
            guard.backward(loss * float("nan") if poisoned else loss)
            if guard.last_micro:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                before = (guard.global_step, guard.lr)
            if guard.step() == "commit":
                steps_seen.append((*before, opt.param_groups[0]["lr"]))
                best.value = min(best.value, float(loss.detach()))
            if marked is None and guard.quarantined:
                marked = len(data.read)  # every read from here on follows the quarantine
        guard.close()
        state = {"model": models[rank].state_dict(), "optim": opt.state_dict()}
        return {
            "state": copy.deepcopy({**state, "best": best.value}),
            "steps": steps_seen,
            "applied": applied,
            "lr": [get_lr(s, a) for s, _, _ in steps_seen],
            "read": data.read,
            "marked": marked,
        }

    return run_ranks(rank_main, 2, timeout_s=120)


EXACT: dict[str, Any] = {"adjust": {"lr_factor": 1.0}, "snapshot": {"every_steps": 4}}


def test_hand_set_lr_follows_global_step_and_the_incident_cut(tmp_path: Path) -> None:
    """The LR set by hand from guard.global_step is what the optimizer steps with, times
    the Guard's multiplier after an incident (cut, hold, ramp), and is back in the param
    groups after each step; a rollback moves global_step back, and the LR with it."""
    adjust = {"lr_factor": 0.5, "hold_steps": 2, "rewarm_steps": 4}
    faults = [{"kind": "nan_grad", "step": 6, "rank": 1, "micro": 1}]
    policy = {"adjust": adjust, "snapshot": {"every_steps": 4}, "faults": faults}
    ranks = nano_loop(tmp_path / "run", policy, steps=14)
    (rollback,) = kinds(tmp_path / "run", "rollback")
    to = rollback["details"]["to_step"]
    assert (rollback["details"]["from_step"], to) == (6, 4)
    for r in ranks:
        steps = [s for s, _, _ in r["steps"]]
        assert steps == [*range(6), *range(to, 14)]  # the replay runs steps 4 and 5 again
        after = [1.0] * 6 + [0.5, 0.5, 0.5, 0.625, 0.75, 0.875] + [1.0] * 4
        assert [g for _, g, _ in r["steps"]] == [
            lr * m for lr, m in zip(r["lr"], after, strict=True)
        ]
        assert r["applied"] == [g for _, g, _ in r["steps"]]  # what guard.lr said
        assert [kept for _, _, kept in r["steps"]] == r["lr"]  # the hand-set LR, put back


def test_a_rollback_replays_the_windows_bit_for_bit(tmp_path: Path) -> None:
    """A transient NaN at micro-batch 1 of step 6 rolls back to step 4: the windows, the
    LR and the clipping are replayed, and every rank ends as a clean run did."""
    clean = nano_loop(tmp_path / "clean", EXACT, steps=10)
    faults = [{"kind": "nan_grad", "step": 6, "rank": 0, "micro": 1}]
    faulty = nano_loop(tmp_path / "faulty", {**EXACT, "faults": faults}, steps=10)
    (rollback,) = kinds(tmp_path / "faulty", "rollback")
    assert rollback["details"]["to_step"] == 4  # 4 steps = PER_EPOCH draws: an epoch's end
    for a, b in zip(clean, faulty, strict=True):
        assert_bitwise_equal(a["state"], b["state"], "final")


def test_a_poison_window_is_quarantined_by_its_offset_bit_for_bit(tmp_path: Path) -> None:
    """A window whose loss is NaN (a fault on its offset) at step 5 is isolated and
    quarantined by its offset, with every window that shares a token with it (the bad data
    may be any of its tokens); the run then equals one whose ledger held that range from
    the start (the sampler's draws in it are skipped in both, the position unchanged)."""
    bad = draw_at(step=5, micro=1, row=2)
    policy = {**EXACT, "faults": [{"kind": "poison_sample", "sample": bad}]}
    faulty = nano_loop(tmp_path / "faulty", policy, steps=10)
    (q,) = kinds(tmp_path / "faulty", "quarantine")
    assert q["details"]["samples"] == [bad]
    assert q["details"]["ranges"] == [[bad - BLOCK, bad + BLOCK + 1]]
    pre_dir = prequarantined_ranges(tmp_path, q["details"]["ranges"])
    pre = nano_loop(pre_dir, policy, steps=10)
    assert not kinds(pre_dir, "incident")
    for a, b in zip(pre, faulty, strict=True):
        assert_bitwise_equal(a["state"], b["state"], "final")


def prequarantined_ranges(tmp_path: Path, ranges: list[list[int]]) -> Path:
    """A run directory whose ledger holds the id ranges ``[lo, hi)`` from the start."""
    d = tmp_path / "prequarantined"
    d.mkdir()
    (d / LEDGER_NAME).write_text("".join(json.dumps({"range": r}) + "\n" for r in ranges))
    return d


def test_a_bad_token_quarantines_every_window_holding_it_bit_for_bit(tmp_path: Path) -> None:
    """A bad token inside the stream (every window holding it has a NaN loss): the window
    drawn at step 5 that holds it is isolated, and every window overlapping that one is
    quarantined as one range, the bad token's other windows included: the one the sampler
    draws at step 7 is skipped (one incident, not two), no window of the range is read
    after the quarantine, and the run equals, bit for bit on every rank, one whose ledger
    held the range from the start. The data budget charges the draws the range takes
    away (its share of the windows), not its width: 33 ids against the 96 draws seen would
    be over max_fraction=2%, their 1.1% share of the windows is not."""
    culprit = draw_at(step=5, micro=1, row=2)
    t = culprit + 10  # the bad token's position
    later = draw_at(step=7, micro=0, row=2)  # a window drawn later that holds it too
    assert later < t <= later + BLOCK and later != culprit
    tokens = TOKENS.clone()
    tokens[t] = POISON
    budget = {"max_fraction": 0.02, "budget_min_samples": 0}
    policy = {**EXACT, "quarantine": budget}
    faulty = nano_loop(tmp_path / "faulty", policy, steps=10, tokens=tokens)
    assert [i["details"]["cause"] for i in kinds(tmp_path / "faulty", "incident")] == ["data"]
    assert not kinds(tmp_path / "faulty", "gave_up")
    (q,) = kinds(tmp_path / "faulty", "quarantine")
    lo, hi = culprit - BLOCK, culprit + BLOCK + 1
    assert q["details"]["samples"] == [culprit] and q["details"]["ranges"] == [[lo, hi]]
    share = (hi - lo) / (len(TOKENS) - BLOCK)  # of the windows the sampler draws from
    d = q["details"]
    assert d["total"] == hi - lo and d["fraction"] == pytest.approx(share)
    assert d["lost"] == pytest.approx(share * d["samples_seen"])
    assert d["total"] / d["samples_seen"] > budget["max_fraction"]  # a width would be over
    (end,) = kinds(tmp_path / "faulty", "run_end")  # and the end, status and report say so
    assert end["details"]["quarantined_fraction"] == pytest.approx(share)
    assert totals(load(str(tmp_path / "faulty")))["quarantined_fraction"] == pytest.approx(share)
    ledger = [json.loads(line) for line in (tmp_path / "faulty" / LEDGER_NAME).open()]
    assert [e["range"] for e in ledger] == [[lo, hi]] and "sample" not in ledger[0]
    assert audit(str(tmp_path / "faulty")) == []  # the journal's range is in the ledger
    elsewhere = tmp_path / "other.jsonl"
    elsewhere.write_text(json.dumps({"range": [lo, hi - 1]}) + "\n")  # one id short
    (missing,) = audit(str(tmp_path / "faulty"), ledger_url=str(elsewhere))
    assert f"[{lo}, {hi})" in missing
    for r in faulty:
        assert r["marked"] is not None
        assert not [i for i in r["read"][r["marked"] :] if lo <= i < hi]
    pre_dir = prequarantined_ranges(tmp_path, [[lo, hi]])
    pre = nano_loop(pre_dir, policy, steps=10, tokens=tokens)
    assert not kinds(pre_dir, "incident")
    assert all(not [i for i in r["read"] if lo <= i < hi] for r in pre)
    for a, b in zip(pre, faulty, strict=True):
        assert_bitwise_equal(a["state"], b["state"], "final")


def test_a_range_over_the_data_budget_stops_the_run(tmp_path: Path) -> None:
    """The same bad token with max_fraction=0.5%: the range's share of the windows (1.1%)
    is over it, so the run gives up on the data budget, naming that share."""
    culprit = draw_at(step=5, micro=1, row=2)
    tokens = TOKENS.clone()
    tokens[culprit + 10] = POISON
    policy = {**EXACT, "quarantine": {"max_fraction": 0.005, "budget_min_samples": 0}}
    with pytest.raises(RankFailed, match="GaveUp"):  # the harness re-raises a rank's
        nano_loop(tmp_path / "run", policy, steps=10, tokens=tokens)
    (gave_up,) = kinds(tmp_path / "run", "gave_up")
    d = gave_up["details"]
    assert d["budget"] == "data" and gave_up["step"] == 5
    assert d["fraction"] == pytest.approx((2 * BLOCK + 1) / (len(TOKENS) - BLOCK))
    assert d["quarantined"] == list(range(culprit - BLOCK, culprit + BLOCK + 1))


# --- examples/train_nanogpt.py under torchrun, 2 ranks ------------------------------------
NANO = REPO / "examples" / "train_nanogpt.py"
RUN_EXACT: dict[str, Any] = {
    "adjust": {"lr_factor": 1.0},
    "snapshot": {"every_steps": 5},
    "persist": {"every_steps": 5},
}


def run_example(run_dir: Path, policy: dict[str, Any], ok: bool = True) -> None:
    # 28 draws per rank per epoch (3.5 steps): epochs end mid-step, and the snapshots (every
    # 5 steps) lie mid-epoch, where the sampler starts by its iter_from.
    args = ["--max-iters", "24", "--samples-per-epoch", "28", "--eval-interval", "10"]
    args += ["--data-dir", str(run_dir.parent / "data")]
    r = train(run_dir, 2, *args, policy=policy, script=NANO)
    assert (r.returncode == 0) == ok, r.stdout[-4000:]


def test_the_example_rolls_back_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    """examples/train_nanogpt.py on 2 ranks: a transient NaN at step 7 rolls back to step 5,
    a crash at step 17 ends the attempt and the same command resumes from the durable tier;
    the model, the optimizer and best_val_loss end bit for bit as a clean run's, on every
    rank."""
    clean = tmp_path / "clean"
    run_example(clean, RUN_EXACT)
    faulty = tmp_path / "faulty"
    faults = [
        {"kind": "nan_grad", "step": 7, "rank": 1, "micro": 1},
        {"kind": "crash", "step": 17, "rank": 0, "after_persist": True},
    ]
    policy = {**RUN_EXACT, "faults": faults}
    run_example(faulty, policy, ok=False)
    run_example(faulty, policy)
    (rollback,) = kinds(faulty, "rollback")
    assert (rollback["details"]["from_step"], rollback["details"]["to_step"]) == (7, 5)
    (resume,) = kinds(faulty, "resume")
    assert resume["details"]["snapshot_step"] in (10, 15)  # as far as the writes got
    finals = final_states(faulty)
    assert finals[0]["best_val_loss"] < 1e9  # rank 0 evaluated (and resumed its best)
    for a, b in zip(final_states(clean), finals, strict=True):
        assert a["step"] == b["step"] == 24
        assert_bitwise_equal(a, b, "final")
