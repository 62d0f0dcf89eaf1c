"""Deterministic, rank-sharded, resumable, quarantine-aware batching.

The order of an epoch is a pure function of (seed, epoch, quarantined ids): a seeded
permutation of the dataset indices with quarantined ids removed, cut into global batches of
``batch_size * world_size``, rank ``r`` taking the ``r``-th slice of each. Removing an id only
shifts the samples after it, so a run that quarantines sample X at step t and rolls back to a
snapshot before t continues exactly as a run whose ledger held X from the start.

The sampler's position is (epoch, index of the next batch); the Guard owns the consumed
position (DataLoader workers prefetch ahead) and rewinds it after a rollback.
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
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        self._quarantined: set[int] = set()
        self._cache: tuple[int, torch.Tensor] | None = None  # (epoch, filtered order)
        if self.batches_in_epoch(0) == 0:
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
    def order(self, epoch: int) -> torch.Tensor:
        """Global sample order of ``epoch`` with quarantined ids removed (int64, CPU)."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.num_samples, generator=g)
        else:
            perm = torch.arange(self.num_samples)
        if self._quarantined:
            bad = torch.tensor(sorted(self._quarantined), dtype=torch.int64)
            perm = perm[~torch.isin(perm, bad)]
        self._cache = (epoch, perm)
        return perm

    def batches_in_epoch(self, epoch: int) -> int:
        return len(self.order(epoch)) // (self.batch_size * self.world_size)

    def global_batch_ids(self, epoch: int, index: int) -> list[int]:
        span = self.batch_size * self.world_size
        return self.order(epoch)[index * span : (index + 1) * span].tolist()

    def batch_ids(self, epoch: int, index: int, rank: int | None = None) -> list[int]:
        r = self.rank if rank is None else rank
        start = index * self.batch_size * self.world_size + r * self.batch_size
        return self.order(epoch)[start : start + self.batch_size].tolist()

    # --- Sampler protocol -----------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        for i in range(self.index, self.batches_in_epoch(epoch)):
            yield self.batch_ids(epoch, i)

    def __len__(self) -> int:
        return self.batches_in_epoch(self.epoch) - self.index

    def set_position(self, epoch: int, index: int) -> None:
        self.epoch, self.index = epoch, index
