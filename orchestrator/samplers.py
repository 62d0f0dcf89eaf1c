"""Token windows with ids, for loops like nanoGPT's: the id of a window is its offset.

nanoGPT's ``get_batch`` draws offsets from torch's global RNG (shared with dropout) and its
windows have no identity, so a rollback cannot replay them and a bad window cannot be
quarantined. Here a window of ``block_size`` tokens starting at offset ``i`` is sample
``i`` of a :class:`WindowDataset` (``(x, y) = (tokens[i:i+b], tokens[i+1:i+1+b])``), and
the samplers yield offsets, so ``guard.dataloader(dataset, batch_size, sampler=...)``
batches, rewinds and quarantines windows as it does any sample id (docs/nanogpt.md).

:class:`RandomOffsetSampler` is counter-based: draw ``j`` of an epoch is a pure function of
``(seed, epoch, j)`` (splitmix64), rank ``r`` taking draws ``k * world_size + r``. Its
position is a count of draws, which the loader's state holds; a rewind or a resume
restores that count and no RNG, and dropout or an evaluation's draws never shift it.
Both samplers start at any position in O(1) (``iter_from``), so a resume late in a long
epoch does not replay its draws.

Windows overlap: a bad token at position ``t`` is in every window from ``t - block_size``
to ``t`` (in its ``x`` or its ``y``). The dataset and the samplers say so with ``id_span``
(``block_size + 1``: the tokens window ``i`` reads, ``i .. i + block_size``), and the Guard,
when an isolation names window ``o``, quarantines every window that shares a token with it:
ids ``o - block_size .. o + block_size``, as one ledger range. ``share(ranges)`` is the
share of a sampler's draws that quarantined ranges take away: what the data budget
(``quarantine.max_fraction``) charges, rather than the ranges' width (docs/nanogpt.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from orchestrator.idset import IdSet

__all__ = ["RandomOffsetSampler", "TokenStreamSampler", "WindowDataset", "id_span", "id_share"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHUNK = 4096  # draws computed at once


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's output function (a bijection of uint64, wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This rank and the world size: given, or torch.distributed's default group's."""
    on = dist.is_available() and dist.is_initialized()
    world = world_size if world_size is not None else (dist.get_world_size() if on else 1)
    me = rank if rank is not None else (dist.get_rank() if on else 0)
    if not 0 <= me < world:
        raise ValueError(f"rank {me} is outside a world of {world} ranks")
    return me, world


def _windows(n_tokens: int, block_size: int) -> int:
    """The number of windows: offsets ``0 .. n_tokens - block_size - 1`` (y needs one more
    token than x), as nanoGPT's ``randint(len(data) - block_size)``."""
    if block_size < 1 or n_tokens - block_size < 1:
        raise ValueError(
            f"{n_tokens} tokens hold no window of block_size={block_size} (a window needs "
            "block_size + 1 tokens): use more data or a smaller block_size"
        )
    return n_tokens - block_size


class RandomOffsetSampler(Sampler[int]):
    """Random window offsets, counter-based: nanoGPT's ``get_batch`` draws with ids.

    Args:
        n_tokens: tokens in the data (``len(WindowDataset)`` is ``n_tokens - block_size``).
        block_size: tokens per window.
        seed: the draws' seed (every rank passes the same).
        rank, world_size: this rank and the number of ranks (default: torch.distributed's
            default group, or 0 and 1); each rank takes every ``world_size``-th draw.
        samples_per_epoch: draws per rank per epoch (default: the windows divided by the
            ranks, about one pass over the tokens). The Guard calls ``set_epoch`` at each
            pass; each epoch draws anew.
    """

    def __init__(
        self,
        n_tokens: int,
        block_size: int,
        seed: int = 0,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        samples_per_epoch: int | None = None,
    ) -> None:
        self.n_windows = _windows(n_tokens, block_size)
        self.id_span = block_size + 1  # tokens a window reads: ids closer than this overlap
        self.rank, self.world_size = _ranks(rank, world_size)
        self.seed, self.epoch = seed, 0
        self.samples_per_epoch = (
            samples_per_epoch
            if samples_per_epoch is not None
            else self.n_windows // self.world_size
        )
        if self.samples_per_epoch < 1:
            raise ValueError(
                f"samples_per_epoch={self.samples_per_epoch}: each rank needs at least one "
                f"draw per epoch ({self.n_windows} windows over {self.world_size} ranks)"
            )

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)

    def share(self, ranges: Iterable[tuple[int, int]]) -> float:
        """The share of the draws that fall in ``ranges`` (disjoint ``[lo, hi)``): each
        draw is uniform over the windows, so the ranges' windows over all windows."""
        inside = sum(max(0, min(hi, self.n_windows) - max(lo, 0)) for lo, hi in ranges)
        return inside / self.n_windows

    def offsets(self, start: int, count: int) -> np.ndarray:
        """This rank's draws ``start .. start + count - 1`` of the current epoch."""
        mask = (1 << 64) - 1
        key = _mix(np.array([self.seed & mask], dtype=np.uint64))
        with np.errstate(over="ignore"):
            key = _mix(key + np.uint64(self.epoch & mask) * _GOLDEN)
            k = np.arange(start, start + count, dtype=np.uint64)
            j = k * np.uint64(self.world_size) + np.uint64(self.rank)
            # splitmix64's stream seeded by the key: state j + 1 steps of the golden gamma
            drawn = _mix(key + (j + np.uint64(1)) * _GOLDEN)
        # The modulo's bias is n_windows / 2**64: nil for any real token count.
        return (drawn % np.uint64(self.n_windows)).astype(np.int64)

    def iter_from(self, position: int) -> Iterator[int]:
        """The offsets from draw ``position`` of the epoch on (a resume starts there)."""
        for start in range(position, self.samples_per_epoch, _CHUNK):
            count = min(_CHUNK, self.samples_per_epoch - start)
            yield from (int(i) for i in self.offsets(start, count))


class TokenStreamSampler(Sampler[int]):
    """Windows in order, every ``stride`` tokens (default ``block_size``: disjoint windows),
    rank ``r`` taking every ``world_size``-th window from the ``r``-th; the same order
    every epoch, the tail that does not give every rank a window dropped.

    Args: as :class:`RandomOffsetSampler`, with ``stride`` instead of the seed.
    """

    def __init__(
        self,
        n_tokens: int,
        block_size: int,
        stride: int | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        n_windows = _windows(n_tokens, block_size)
        self.id_span = block_size + 1  # as RandomOffsetSampler's
        self.stride = stride if stride is not None else block_size
        if self.stride < 1:
            raise ValueError(f"stride must be >= 1, got {self.stride}")
        self.rank, self.world_size = _ranks(rank, world_size)
        self.per_rank = ((n_windows - 1) // self.stride + 1) // self.world_size
        if self.per_rank < 1:
            raise ValueError(
                f"{n_tokens} tokens hold fewer windows than ranks ({self.world_size}) at "
                f"stride {self.stride}: use more data or a smaller stride"
            )
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # the order is the same every epoch

    def __len__(self) -> int:
        return self.per_rank

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(0)

    def share(self, ranges: Iterable[tuple[int, int]]) -> float:
        """The share of an epoch's windows (every rank's) whose offsets fall in ``ranges``
        (disjoint ``[lo, hi)``): the multiples of the stride there."""
        drawn = self.per_rank * self.world_size
        end = drawn * self.stride  # past the last offset drawn
        s = self.stride
        inside = sum(
            max(0, -(-min(hi, end) // s) - -(-max(lo, 0) // s)) for lo, hi in ranges
        )  # ceil(hi / s) - ceil(lo / s): the multiples of s in [lo, hi)
        return inside / drawn

    def iter_from(self, position: int) -> Iterator[int]:
        """The offsets from this rank's ``position``-th window on."""
        for k in range(position, self.per_rank):
            yield (k * self.world_size + self.rank) * self.stride


class WindowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of a 1-D token array: item ``i`` is ``(x, y)``, the ``block_size`` tokens
    from offset ``i`` and the same shifted by one, as int64 (nanoGPT's ``get_batch``).

    Args:
        tokens: a path to a raw token file (nanoGPT's ``train.bin``, read through
            ``np.memmap`` of ``dtype``, opened in each process that reads it, so loader
            workers never receive a copy of the data), or a 1-D numpy array or tensor.
        block_size: tokens per window.
        dtype: the file's token type (nanoGPT's is uint16).
    """

    def __init__(
        self,
        tokens: str | os.PathLike[str] | np.ndarray | torch.Tensor,
        block_size: int,
        dtype: Any = np.uint16,
    ) -> None:
        self.block_size, self.dtype = block_size, dtype
        self.path: str | None = None
        self._data: np.ndarray | torch.Tensor | None = None
        if isinstance(tokens, (str, os.PathLike)):
            self.path = os.fspath(tokens)
            n = os.path.getsize(self.path) // np.dtype(dtype).itemsize
        else:
            if tokens.ndim != 1:
                raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
            self._data, n = tokens, int(tokens.shape[0])
        self.n_tokens = n
        self._len = _windows(n, block_size)
        self.id_span = block_size + 1  # as the samplers'

    def _tokens(self) -> np.ndarray | torch.Tensor:
        if self._data is None:
            assert self.path is not None
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._data

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.path is not None:
            state["_data"] = None  # a worker maps the file itself
        return state

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = int(offset)
        if not 0 <= i < self._len:
            raise IndexError(f"window offset {i} outside 0..{self._len - 1}")
        window = self._tokens()[i : i + self.block_size + 1]
        if isinstance(window, torch.Tensor):
            chunk = window.to(torch.int64, copy=True)  # never a view of the user's tokens
        else:
            chunk = torch.from_numpy(np.asarray(window).astype(np.int64))
        return chunk[:-1], chunk[1:]


def id_span(sampler: Any, dataset: Any) -> int | None:
    """How many consecutive tokens a sample id reads (``id_span`` of the sampler, else of
    the dataset), or None when ids are not windows of a stream: then they share nothing."""
    span = getattr(sampler, "id_span", None) or getattr(dataset, "id_span", None)
    return int(span) if span else None


def id_share(ids: IdSet, sampler: Any, dataset: Any) -> float | None:
    """The share of the draws that the quarantined ``ids`` take away, for ids that are
    windows (:func:`id_span`; else None): the sampler's ``share`` of their ranges, or,
    without one, the ids' share of the dataset's (a sampler that draws every index alike)."""
    if id_span(sampler, dataset) is None:
        return None
    if hasattr(sampler, "share"):
        return float(sampler.share(ids.ranges()))
    try:
        n = len(dataset)
    except TypeError:  # a stream of windows without a length: count the ids themselves
        return None
    return ids.count_in(0, n) / max(n, 1)
