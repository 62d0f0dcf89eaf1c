"""Loops like nanoGPT's: token windows whose id is their offset (orchestrator/samplers.py),
``Value`` in snapshots, the LR set by hand from ``guard.global_step``, clipping by hand at
``guard.last_micro``; and examples/train_nanogpt.py rolled back and resumed, bit for bit."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestrator import Value
from orchestrator.samplers import RandomOffsetSampler, TokenStreamSampler, WindowDataset

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
