"""The data cursor: where the run is in its data, and which samples each step ran.

It owns the Guard's sampler (:class:`GuardBatchSampler`), the consumed position
``(epoch, offset)`` (saved with every snapshot), the DataLoader iterator (remade after a
rewind, since workers prefetch ahead of the consumed position), the sample ids and
positions of the step being run, and those of the last committed steps (window
quarantine). Every method is a local computation: identical on every rank because the
sampler's order is a pure function of (seed, epoch, quarantined ids).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from orchestrator.data import GuardBatchSampler
from orchestrator.errors import OrchestratorError, UsageError

Position = tuple[int, int]  # (epoch, offset in the unfiltered order)


class DataCursor:
    def __init__(self, rank: int, world_size: int, quarantined: set[int], window_steps: int):
        self.rank, self.world_size = rank, world_size
        self._from_ledger = quarantined
        self.sampler: GuardBatchSampler | None = None
        self.pos: Position = (0, 0)  # of the next batch
        self._next_offset = 0  # where the batch being run ends
        self._it: Iterator[Any] | None = None
        self._reset = True
        # (step, positions of its batches) of the last committed steps
        self._recent: deque[tuple[int, list[Position]]] = deque(maxlen=max(window_steps, 0) + 1)
        # The step being run: its micro-batches' positions and sample ids.
        self.step_positions: list[Position] = []
        self.step_ids: list[int] = []

    def dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Any = None,
        num_workers: int = 0,
        **loader_kwargs: Any,
    ) -> DataLoader[Any]:
        self.sampler = GuardBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            batch_size,
            rank=self.rank,
            world_size=self.world_size,
            seed=seed,
            shuffle=shuffle,
        )
        self.sampler.quarantine(self._from_ledger)
        # DataLoader draws its workers' base seed from this generator each time an iterator
        # is made. Without its own generator that draw comes from the global torch RNG, and
        # the extra iterator made after a rollback would shift every later dropout mask.
        loader_kwargs.setdefault("generator", torch.Generator())
        return DataLoader(
            dataset,
            batch_sampler=self.sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            **loader_kwargs,
        )

    def check_loader(self, loader: DataLoader[Any]) -> GuardBatchSampler:
        sampler = self.sampler
        if sampler is None:
            raise UsageError("guard.batches needs the DataLoader returned by guard.dataloader")
        ours: GuardBatchSampler = sampler
        if loader.batch_sampler is not ours:
            raise UsageError(
                "guard.batches needs the DataLoader returned by guard.dataloader, not another "
                "one (with its own sampler or batch_sampler): the Guard rewinds and quarantines "
                "the data through that loader's sampler"
            )
        return ours

    # --- iterating ------------------------------------------------------------------------
    def open(self, loader: DataLoader[Any], ledger_url: str) -> None:
        """Make the iterator at the current position if there is none (or a rewind dropped
        it), moving on to the next epoch when this one has no full batch left."""
        sampler = self.check_loader(loader)
        while self._it is None or self._reset:
            if sampler.remaining_batches(*self.pos) == 0:
                if self.pos[1] == 0:
                    raise OrchestratorError(
                        f"epoch {self.pos[0]} has no full batch: {len(sampler.quarantined)} "
                        f"samples are quarantined in {ledger_url}; review the ledger or lower "
                        "the batch size"
                    )
                self.pos = (self.pos[0] + 1, 0)
                continue
            sampler.set_position(*self.pos)
            if loader.generator is not None:
                # Worker base seeds become a function of the data position. Replays are
                # bit for bit with num_workers=0, or with per-sample seeded randomness.
                loader.generator.manual_seed(hash((sampler.seed, *self.pos)))
            self._it, self._reset = iter(loader), False

    def fetch(self) -> tuple[list[int], Any] | None:
        """The next batch of the step being run and its sample ids; None at an epoch's end
        (call :meth:`open` again)."""
        assert self._it is not None and self.sampler is not None
        try:
            batch = next(self._it)
        except StopIteration:
            self.pos, self._it = (self.pos[0] + 1, 0), None
            return None
        ids, self._next_offset = self.sampler.batch_at(*self.pos)
        self.step_positions.append(self.pos)
        self.step_ids.extend(ids)
        return ids, batch

    def micro_done(self) -> None:
        """A micro-batch of the step (not its last) has run: move past it."""
        self.pos = (self.pos[0], self._next_offset)

    def commit(self, step: int) -> None:
        """Step ``step`` is committed: move past its batches and remember them."""
        self._recent.append((step, self.step_positions))
        self.pos = (self.pos[0], self._next_offset)
        self.new_step()

    def new_step(self) -> None:
        self.step_positions, self.step_ids = [], []

    def rewind(self, step: int, pos: Position) -> None:
        """Back to ``pos``, where step ``step`` starts (a rollback or a resume). Steps from
        ``step`` on belong to the abandoned timeline: their positions are forgotten."""
        self.pos = pos
        self.new_step()
        while self._recent and self._recent[-1][0] >= step:
            self._recent.pop()
        self._reset = True

    # --- samples --------------------------------------------------------------------------
    @property
    def quarantined(self) -> frozenset[int]:
        return self.sampler.quarantined if self.sampler is not None else frozenset()

    def quarantine(self, ids: Iterable[int]) -> None:
        assert self.sampler is not None
        self.sampler.quarantine(ids)

    def samples_seen(self) -> int:
        """Distinct samples reached so far, the running step's included (the quarantine
        budget's denominator): the position in the unfiltered order, all after an epoch."""
        assert self.sampler is not None
        n = self.sampler.num_samples
        reached = max(self.pos[1], self._next_offset)  # _next_offset: 0 until a batch runs
        return n if self.pos[0] >= 1 else max(1, min(n, reached))

    def step_samples(self, ranks: list[int]) -> list[int]:
        """The samples the given ranks ran in the step being run."""
        assert self.sampler is not None
        return [
            i for p in self.step_positions for r in ranks for i in self.sampler.batch_at(*p, r)[0]
        ]

    def window_samples(self, since_step: int) -> list[int]:
        """Every rank's samples of the committed steps from ``since_step`` on."""
        assert self.sampler is not None
        return [
            i
            for step, positions in self._recent
            if step >= since_step
            for p in positions
            for i in self.sampler.global_batch_at(*p)
        ]
