"""The data cursor: where the run is in its data, and which samples each step ran.

It holds the data source made by ``guard.dataloader``: :class:`~orchestrator.data.
IndexSource` (a map-style dataset on the Guard's own sampler; the position is shared by
all ranks and every rank's samples are computed locally) or :class:`~orchestrator.stream.
StreamSource` (an IterableDataset with sample ids, or the user's sampler, through
torchdata's StatefulDataLoader; each rank's position is its own, and other ranks' samples
are gathered when an incident needs them). The cursor keeps the sample ids of the step
being run and of the last committed steps (window quarantine), and rewinds the source
after a rollback or a resume.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from torch.utils.data import IterableDataset

from orchestrator.comm import Comm
from orchestrator.data import IndexSource
from orchestrator.errors import UsageError
from orchestrator.idset import IdSet
from orchestrator.samplers import id_share, id_span
from orchestrator.stream import StreamSource

Source = IndexSource | StreamSource


class DataCursor:
    def __init__(self, comm: Comm, quarantined: AbstractSet[int], window_steps: int):
        self.comm = comm
        self._from_ledger = IdSet()
        self._from_ledger.update(quarantined)  # an IdSet's ranges stay ranges
        self.source: Source | None = None
        # (step, marks, this rank's ids) of the last committed steps
        self._recent: deque[tuple[int, list[Any], list[int]]] = deque(
            maxlen=max(window_steps, 0) + 1
        )
        # The step being run: its micro-batches' marks (positions) and this rank's ids.
        self.step_marks: list[Any] = []
        self.step_ids: list[int] = []

    def dataloader(self, dataset: Any, batch_size: int, **options: Any) -> Any:
        if "batch_sampler" in options:
            raise UsageError(
                "guard.dataloader makes the batches: pass your sampler as sampler= (it yields "
                "indices; the Guard batches them, skipping quarantined samples)"
            )
        rank, world_size = self.comm.rank, self.comm.world_size
        quarantined = self._from_ledger.copy()
        custom = options.get("sampler") is not None or "sample_id" in options
        if custom or isinstance(dataset, IterableDataset):
            mine = sorted({"shuffle", "seed"} & set(options))
            if mine:
                raise UsageError(
                    f"guard.dataloader({', '.join(mine)}=...) sets the Guard's own sampler; "
                    "with your sampler or an IterableDataset, shuffle there"
                )
            self.source = StreamSource(
                dataset,
                batch_size,
                rank=rank,
                world_size=world_size,
                quarantined=quarantined,
                **options,
            )
        else:
            options.pop("sampler", None)
            self.source = IndexSource(
                dataset,
                batch_size,
                rank=rank,
                world_size=world_size,
                quarantined=quarantined,
                **options,
            )
        return self.source.loader

    def check_loader(self, loader: Any) -> Source:
        if self.source is None:
            raise UsageError("guard.batches needs the DataLoader returned by guard.dataloader")
        if loader is not self.source.loader:
            raise UsageError(
                "guard.batches needs the DataLoader returned by guard.dataloader, not another "
                "one (with its own sampler or batch_sampler): the Guard rewinds and quarantines "
                "the data through that loader. For your own sampler or an IterableDataset, "
                "pass them to guard.dataloader (sampler=..., sample_id=...)"
            )
        return self.source

    # --- iterating ------------------------------------------------------------------------
    def open(self, loader: Any, ledger_url: str) -> None:
        """Make the iterator at the current position if there is none (or a rewind dropped
        it), moving on to the next epoch when this one has no batch left."""
        self.check_loader(loader).open(ledger_url)

    def fetch(self) -> tuple[list[int], Any] | None:
        """The next batch of the step being run and its sample ids; None at an epoch's end
        (call :meth:`open` again)."""
        assert self.source is not None
        got = self.source.fetch()
        if got is None:
            return None
        ids, batch, mark = got
        self.step_marks.append(mark)
        self.step_ids.extend(ids)
        return ids, batch

    def micro_done(self) -> None:
        """A micro-batch of the step (not its last) has run: move past it."""
        assert self.source is not None
        self.source.advance()

    def commit(self, step: int) -> None:
        """Step ``step`` is committed: move past its batches and remember them."""
        assert self.source is not None
        self._recent.append((step, self.step_marks, self.step_ids))
        self.source.advance()
        self.new_step()

    def new_step(self) -> None:
        self.step_marks, self.step_ids = [], []
        if isinstance(self.source, StreamSource):
            self.source.new_step()

    def position(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The data position: (shared by all ranks, this rank's own or None), saved with
        every snapshot under ``guard`` and ``data``."""
        if self.source is None:  # no dataloader yet: the start of the data
            return {"epoch": 0, "offset": 0}, None
        return self.source.position()

    def rewind(self, step: int, shared: dict[str, Any], local: dict[str, Any] | None) -> None:
        """Back to the position where step ``step`` starts (a rollback or a resume). Steps
        from ``step`` on belong to the abandoned timeline: their samples are forgotten."""
        assert self.source is not None
        self.source.restore(shared, local)
        self.new_step()
        while self._recent and self._recent[-1][0] >= step:
            self._recent.pop()

    def rerun_batch(self, ids: list[int]) -> Any:
        """A batch of the given samples of the step being run (an isolation re-run)."""
        assert self.source is not None
        return self.source.rerun_batch(ids)

    # --- samples --------------------------------------------------------------------------
    @property
    def quarantined(self) -> frozenset[int]:
        return self.source.quarantined if self.source is not None else frozenset()

    @property
    def id_set(self) -> IdSet:
        """The quarantined ids as kept (ranges as ranges); read only."""
        return self.source.id_set if self.source is not None else IdSet()

    def quarantine(self, ids: Iterable[int], ranges: Iterable[tuple[int, int]] = ()) -> None:
        assert self.source is not None
        self.source.quarantine(IdSet(ids, ranges))

    @property
    def id_span(self) -> int | None:
        """How many consecutive tokens a sample id reads, when ids are windows of a token
        stream (orchestrator/samplers.py); None otherwise."""
        s = self.source
        return id_span(s.sampler, s.dataset) if s is not None else None

    def overlapping(self, ids: Iterable[int]) -> list[tuple[int, int]]:
        """The id ranges ``[lo, hi)`` of the samples that share data with ``ids``: for
        windows of a token stream (an ``id_span``: orchestrator/samplers.py), every window
        that shares a token with one of them; empty when ids share nothing."""
        span = self.id_span
        if span is None:
            return []
        merged = IdSet(ranges=[(max(0, i - span + 1), i + span) for i in ids])
        return merged.ranges()

    def quarantine_widened(
        self, culprits: list[int], widen: bool
    ) -> tuple[list[int], list[list[int]]]:
        """Quarantine ``culprits``, with ``widen`` as the ranges of every window that
        overlaps one (:meth:`overlapping`; nothing more for ids that are not windows).
        Returns the ids quarantined alone and the ranges ``[lo, hi]``: what the ledger gets
        (an id inside a range is written as the range)."""
        ranges = self.overlapping(culprits) if widen else []
        singles = [i for i in culprits if not any(lo <= i < hi for lo, hi in ranges)]
        self.quarantine(singles, ranges)
        return singles, [[lo, hi] for lo, hi in ranges]

    def samples_seen(self) -> int:
        assert self.source is not None
        return self.source.samples_seen()

    def samples_lost(self) -> float:
        """What the data budget charges for the quarantine: the quarantined ids, or, for
        windows of a token stream, the draws among those seen that the quarantine takes
        away (the samples seen times the share of the sampler's draws it removes), which a
        range of overlapping windows costs rather than its width."""
        assert self.source is not None
        share = id_share(self.source.id_set, self.source.sampler, self.source.dataset)
        if share is None:
            return float(len(self.source.id_set))
        return share * self.samples_seen()

    def step_samples(self, ranks: list[int]) -> list[int]:
        """The samples the given ranks ran in the step being run (collective for a stream:
        call it on every rank)."""
        if isinstance(self.source, IndexSource):
            return self.source.samples_at(self.step_marks, ranks)
        gathered = self.comm.all_gather_object(self.step_ids)
        return [i for r in ranks for i in gathered[r]]

    def window_samples(self, since_step: int) -> list[int]:
        """Every rank's samples of the committed steps from ``since_step`` on (collective
        for a stream)."""
        recent = [(marks, ids) for step, marks, ids in self._recent if step >= since_step]
        if isinstance(self.source, IndexSource):
            return self.source.samples_at([m for marks, _ in recent for m in marks], None)
        mine = [i for _, ids in recent for i in ids]
        return [i for ids in self.comm.all_gather_object(mine) for i in ids]
