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
after a rollback: :class:`IndexSource` is the data source of ``guard.dataloader`` over a
map-style dataset (orchestrator/stream.py is the one over the user's own pipeline).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from orchestrator.errors import OrchestratorError
from orchestrator.idset import IdSet


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
        self._quarantined = IdSet()
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

    @property
    def id_set(self) -> IdSet:
        """The quarantined ids as kept (read only: :meth:`quarantine` adds)."""
        return self._quarantined

    def quarantine(self, ids: Iterable[int]) -> None:
        """Skip ``ids`` (an IdSet's ranges stay ranges: never expanded)."""
        before = self._quarantined.ranges()
        self._quarantined.update(ids)
        if self._quarantined.ranges() != before:
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
            keep = ~self._quarantined.mask(perm)
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


Position = tuple[int, int]  # (epoch, offset in the unfiltered order)


class IndexSource:
    """The data source of ``guard.dataloader`` over a map-style dataset: a DataLoader on
    the Guard's sampler. Its position is shared (the same on every rank)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        quarantined: IdSet,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Any = None,
        num_workers: int = 0,
        **loader_kwargs: Any,
    ) -> None:
        self.sampler = GuardBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
            shuffle=shuffle,
        )
        self.sampler.quarantine(quarantined)
        self.dataset = dataset
        # DataLoader draws its workers' base seed from this generator each time an iterator
        # is made. Without its own generator that draw comes from the global torch RNG, and
        # the extra iterator made after a rollback would shift every later dropout mask.
        loader_kwargs.setdefault("generator", torch.Generator())
        self.loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_sampler=self.sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            **loader_kwargs,
        )
        self.pos: Position = (0, 0)  # of the next batch
        self._next_offset = 0  # where the batch being run ends
        self._it: Iterator[Any] | None = None

    @property
    def quarantined(self) -> frozenset[int]:
        return self.sampler.quarantined

    @property
    def id_set(self) -> IdSet:
        return self.sampler.id_set

    def quarantine(self, ids: Iterable[int]) -> None:
        self.sampler.quarantine(ids)

    def position(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        return {"epoch": self.pos[0], "offset": self.pos[1]}, None

    def restore(self, shared: dict[str, Any], local: dict[str, Any] | None) -> None:
        self.pos = (int(shared["epoch"]), int(shared["offset"]))
        self._it = None  # workers prefetched past it

    def open(self, ledger_url: str) -> None:
        """Make the iterator at the current position if there is none, moving on to the
        next epoch when this one has no full batch left."""
        sampler = self.sampler
        while self._it is None:
            if sampler.remaining_batches(*self.pos) == 0:
                if self.pos[1] == 0:
                    raise OrchestratorError(
                        f"epoch {self.pos[0]} has no full batch: {len(sampler.id_set)} "
                        f"samples are quarantined in {ledger_url}; review the ledger or lower "
                        "the batch size"
                    )
                self.pos = (self.pos[0] + 1, 0)
                continue
            sampler.set_position(*self.pos)
            if self.loader.generator is not None:
                # Worker base seeds become a function of the data position. Replays are
                # bit for bit with num_workers=0, or with per-sample seeded randomness.
                self.loader.generator.manual_seed(hash((sampler.seed, *self.pos)))
            self._it = iter(self.loader)

    def fetch(self) -> tuple[list[int], Any, Position] | None:
        """The next batch, its ids and position; None at an epoch's end."""
        assert self._it is not None
        try:
            batch = next(self._it)
        except StopIteration:
            self.pos, self._it = (self.pos[0] + 1, 0), None
            return None
        ids, self._next_offset = self.sampler.batch_at(*self.pos)
        return ids, batch, self.pos

    def advance(self) -> None:
        """Move past the batch fetched last."""
        self.pos = (self.pos[0], self._next_offset)

    def rerun_batch(self, ids: list[int]) -> Any:
        return self.loader.collate_fn([self.loader.dataset[i] for i in ids])

    def samples_at(self, positions: list[Position], ranks: list[int] | None) -> list[int]:
        """The samples of the batches at ``positions`` of the given ranks (all: None)."""
        if ranks is None:
            return [i for p in positions for i in self.sampler.global_batch_at(*p)]
        return [i for p in positions for r in ranks for i in self.sampler.batch_at(*p, r)[0]]

    def samples_seen(self) -> int:
        """Distinct samples reached so far, the running step's included (the quarantine
        budget's denominator): the position in the unfiltered order, all after an epoch."""
        n = self.sampler.num_samples
        reached = max(self.pos[1], self._next_offset)  # _next_offset: 0 until a batch runs
        return n if self.pos[0] >= 1 else max(1, min(n, reached))
