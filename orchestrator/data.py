"""Deterministic, rank-sharded, resumable, quarantine-aware batching.

The order of an epoch is a seeded permutation of the dataset indices (a pure function of
seed and epoch). Quarantined ids are skipped; the remaining ones are cut, from the current
position, into global batches of ``batch_size * world_size``, rank ``r`` taking the ``r``-th
slice of each.

The data position is ``(epoch, offset)`` with ``offset`` counted in the *unfiltered*
permutation: the samples before it were consumed. Quarantining an id therefore never moves
the position (whether the id lies before it or after it), and the position means the same
at any world size. A run that quarantines sample X at step t and rolls back to a snapshot
before t continues exactly as a run whose ledger held X from the start: only the samples
after X's place in the order shift.

The Guard owns the consumed position (DataLoader workers prefetch ahead) and rewinds it
after a rollback.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import Sampler


class GuardBatchSampler(Sampler[list[int]]):
    """Batch sampler handed to ``torch.utils.data.DataLoader`` by ``Guard.dataloader``."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.span = batch_size * world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._quarantined: set[int] = set()
        # (epoch, kept ids in order, their offsets in the unfiltered permutation)
        self._cache: tuple[int, torch.Tensor, torch.Tensor] | None = None
        if num_samples < self.span:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch "
                f"(batch_size={batch_size} x world_size={world_size}); lower batch_size"
            )

    # --- quarantine ---------------------------------------------------------------------
    @property
    def quarantined(self) -> frozenset[int]:
        return frozenset(self._quarantined)

    def quarantine(self, ids: Iterable[int]) -> None:
        new = {int(i) for i in ids} - self._quarantined
        if new:
            self._quarantined |= new
            self._cache = None

    # --- order --------------------------------------------------------------------------
    def _order(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Kept ids of ``epoch`` in order, and their offsets in the unfiltered order."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1], self._cache[2]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.num_samples, generator=g)
        else:
            perm = torch.arange(self.num_samples)
        offsets = torch.arange(self.num_samples)
        if self._quarantined:
            bad = torch.tensor(sorted(self._quarantined), dtype=torch.int64)
            keep = ~torch.isin(perm, bad)
            perm, offsets = perm[keep], offsets[keep]
        self._cache = (epoch, perm, offsets)
        return perm, offsets

    def _start(self, epoch: int, offset: int) -> int:
        """Index into the kept ids of the first sample not consumed at ``offset``."""
        _, offsets = self._order(epoch)
        return int(torch.searchsorted(offsets, offset))

    def remaining_batches(self, epoch: int, offset: int) -> int:
        kept, _ = self._order(epoch)
        return (len(kept) - self._start(epoch, offset)) // self.span

    def batch_at(self, epoch: int, offset: int, rank: int | None = None) -> tuple[list[int], int]:
        """This rank's (or ``rank``'s) ids of the next batch, and the offset after it."""
        kept, offsets = self._order(epoch)
        start = self._start(epoch, offset)
        r = self.rank if rank is None else rank
        ids = kept[start + r * self.batch_size : start + (r + 1) * self.batch_size].tolist()
        return ids, int(offsets[start + self.span - 1]) + 1

    def global_batch_at(self, epoch: int, offset: int) -> list[int]:
        kept, _ = self._order(epoch)
        start = self._start(epoch, offset)
        return kept[start : start + self.span].tolist()

    # --- Sampler protocol -----------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        epoch, offset = self.epoch, self.offset
        for _ in range(self.remaining_batches(epoch, offset)):
            ids, offset = self.batch_at(epoch, offset)
            yield ids

    def __len__(self) -> int:
        return self.remaining_batches(self.epoch, self.offset)

    def set_position(self, epoch: int, offset: int) -> None:
        self.epoch, self.offset = epoch, offset
