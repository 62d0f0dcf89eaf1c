"""Bring-your-own data: an ``IterableDataset`` whose samples carry an id, or a map-style
dataset with the user's own sampler, through torchdata's ``StatefulDataLoader``.

The loader's ``state_dict()`` is the data position saved with every snapshot (one per
rank: a stream's position is this rank's, so it resumes at the same world size only).
Quarantine filters by id inside the loader: the wrappers below skip quarantined ids, and
count their position in the *unfiltered* stream (``raw``), so quarantining a sample never
moves the position, as with the Guard's own sampler (orchestrator/data.py).

Every batch comes out as ``(ids, samples, collated)``: the ids for the ledger and the
investigation, the collated batch for the user's loop, and, with a ``collate_fn`` of the
user's, the samples, so an isolation re-run can collate any subset of the step (a stream
cannot be indexed). With torch's default collate the samples do not travel: a re-run
takes its rows out of the collated batches (:func:`_rows`), which default_collate of the
subset would have produced exactly.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, default_collate

from orchestrator.errors import OrchestratorError, PersistError, UsageError
from orchestrator.idset import IdSet

_INSTALL = "pip install 'nan-orchestrator[data]' (torchdata)"


class _Key:
    """The id of a sample: ``sample[key]`` (a picklable callable, for loader workers)."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __call__(self, sample: Any) -> Any:
        return sample[self.key]


def _as_id(raw: Any, how: Any) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise UsageError(
            f"sample_id={how!r} gave {raw!r}, not an integer: sample ids must be integers "
            "unique over the whole dataset (the ledger stores them)"
        ) from None


class _Stream(IterableDataset[tuple[int, Any]]):
    """The user's IterableDataset as ``(id, sample)`` pairs, quarantined ids dropped.

    State: the items of the unfiltered stream consumed (``raw``) and the user dataset's own
    state when it has one (then it resumes from that, else by skipping ``raw`` items)."""

    def __init__(self, dataset: IterableDataset[Any], sample_id: Any, quarantined: IdSet):
        self.dataset, self.sample_id, self.quarantined = dataset, sample_id, quarantined
        self.raw = 0
        self._resume: dict[str, Any] | None = None

    def _stateful(self) -> bool:
        return hasattr(self.dataset, "state_dict") and hasattr(self.dataset, "load_state_dict")

    def state_dict(self) -> dict[str, Any]:
        inner = self.dataset.state_dict() if self._stateful() else None  # type: ignore[attr-defined]
        return {"raw": self.raw, "inner": inner}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = state

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        resume, self._resume = self._resume, None
        self.raw, skip = 0, 0
        if resume is not None:
            self.raw = int(resume["raw"])
            if resume["inner"] is not None and self._stateful():
                self.dataset.load_state_dict(resume["inner"])  # type: ignore[attr-defined]
            else:
                skip = self.raw  # no state of its own: replay the stream up to the position
        how = getattr(self.sample_id, "key", self.sample_id)
        for sample in self.dataset:
            if skip:
                skip -= 1
                continue
            self.raw += 1
            ident = _as_id(self.sample_id(sample), how)
            if ident not in self.quarantined:
                yield ident, sample


class _Indexed(Dataset[tuple[int, Any]]):
    """A map-style dataset as ``(index, sample)``: the index is the sample's id."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


class _SkipQuarantined(Sampler[list[int]]):
    """Batches of ``batch_size`` indices from the user's sampler, quarantined ids skipped,
    the last incomplete batch dropped. State: the epoch and the sampler positions consumed;
    the sampler is told the epoch (``set_epoch``) and replayed to the position on resume,
    or started there by its ``iter_from(position)`` when it has one."""

    def __init__(self, sampler: Any, batch_size: int, quarantined: IdSet) -> None:
        self.sampler, self.batch_size, self.quarantined = sampler, batch_size, quarantined
        self.epoch, self.raw = -1, 0
        self._resume: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "raw": self.raw}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = state

    def __iter__(self) -> Iterator[list[int]]:
        # A generator: the code below runs at the first batch, after any load_state_dict.
        resume, self._resume = self._resume, None
        if resume is not None:
            self.epoch, self.raw = int(resume["epoch"]), int(resume["raw"])
        if resume is None or self.epoch < 0:
            # A new pass; or the position before the first one (a rollback to the initial
            # snapshot): epoch 0, not set_epoch(-1), which would be another order.
            self.epoch, self.raw = self.epoch + 1, 0
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        batch: list[int] = []
        # A sampler that can start mid-epoch (orchestrator/samplers.py) skips the replay.
        start = self.raw if hasattr(self.sampler, "iter_from") else 0
        indices = self.sampler.iter_from(start) if start else iter(self.sampler)
        for pos, index in enumerate(indices, start=start):
            if pos < self.raw:
                continue
            if int(index) not in self.quarantined:
                batch.append(int(index))
            if len(batch) == self.batch_size:
                self.raw = pos + 1
                yield batch
                batch = []

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size


class _WithIds:
    """Collate ``(id, sample)`` pairs into ``(ids, samples, collate(samples))``; the
    samples only for a user ``collate_fn`` (None: torch's default, whose rows a re-run
    takes from the collated batch)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.collate_fn = collate_fn

    def __call__(self, pairs: list[tuple[int, Any]]) -> tuple[list[int], list[Any] | None, Any]:
        ids = [i for i, _ in pairs]
        samples = [s for _, s in pairs]
        if self.collate_fn is None:
            return ids, None, default_collate(samples)
        return ids, samples, self.collate_fn(samples)


def _rows(batch: Any, index: list[int]) -> Any:
    """The rows ``index`` of a batch made by ``default_collate``: what default_collate of
    those samples makes (tensors are stacked on dim 0; strings stay lists)."""
    if isinstance(batch, torch.Tensor):
        return batch[index]
    if isinstance(batch, Mapping):
        return {k: _rows(v, index) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if all(isinstance(v, (str, bytes)) for v in batch):
            return [batch[i] for i in index]  # per-sample strings
        fields = [_rows(v, index) for v in batch]  # one entry per field of the samples
        return type(batch)(*fields) if hasattr(batch, "_fields") else type(batch)(fields)
    raise UsageError(
        f"an isolation re-run cannot take rows out of a batch holding {type(batch).__name__}: "
        "pass guard.dataloader(collate_fn=...) explicitly (the Guard then keeps the samples)"
    )


def _joined(parts: list[Any]) -> Any:
    """Batches of rows (from :func:`_rows`) as one, in order."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, Mapping):
        return {k: _joined([p[k] for p in parts]) for k in first}
    if all(isinstance(v, (str, bytes)) for v in first):
        return [v for p in parts for v in p]
    fields = [_joined([p[i] for p in parts]) for i in range(len(first))]
    return type(first)(*fields) if hasattr(first, "_fields") else type(first)(fields)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torchdata 0.11 warns about its own call to the deprecated ``torch.set_vital``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*set_vital", category=UserWarning)
        yield


def _loader_class() -> Any:
    """torchdata's StatefulDataLoader, or a UsageError that says how to install it."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise UsageError(
            "an IterableDataset or your own sampler needs torchdata's StatefulDataLoader "
            f"(its state is the data position in snapshots): {_INSTALL}"
        ) from None
    return StatefulDataLoader


def _loader(
    loader_class: Any,
    dataset: Dataset[Any],
    batch_size: int,
    quarantined: IdSet,
    sampler: Any,
    sample_id: Any,
    wrap: _WithIds,
    loader_kwargs: dict[str, Any],
) -> Any:
    """The loader of ``dataset``: an IterableDataset's samples by ``sample_id``, a map-style
    one's indices by ``sampler``; either way skipping the ``quarantined`` ids."""
    if isinstance(dataset, IterableDataset):
        if sampler is not None:
            raise UsageError("guard.dataloader: an IterableDataset takes no sampler")
        if sample_id is None:
            raise UsageError(
                "guard.dataloader(IterableDataset) needs sample_id: the key of each "
                "sample's integer id (sample_id='id') or a function sample -> id; the "
                "Guard quarantines and re-runs samples by id"
            )
        get = _Key(sample_id) if isinstance(sample_id, (str, int)) else sample_id
        stream = _Stream(dataset, get, quarantined)
        with _quiet():
            return loader_class(
                stream, batch_size=batch_size, drop_last=True, collate_fn=wrap, **loader_kwargs
            )
    if sample_id is not None:
        raise UsageError(
            "guard.dataloader: a map-style dataset's sample ids are its indices; "
            "sample_id is for an IterableDataset"
        )
    batches = _SkipQuarantined(sampler, batch_size, quarantined)
    with _quiet():
        return loader_class(
            _Indexed(dataset), batch_sampler=batches, collate_fn=wrap, **loader_kwargs
        )


class StreamSource:
    """The data source of a user pipeline: a StatefulDataLoader the Guard builds."""

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        quarantined: AbstractSet[int],
        sampler: Any = None,
        sample_id: Any = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        loader_class = _loader_class()
        if loader_kwargs.get("persistent_workers"):
            raise UsageError(
                "guard.dataloader(persistent_workers=True) with your own pipeline: the "
                "workers must be remade after a rollback to see the quarantine; drop it"
            )
        # The wrappers below hold this IdSet (a set of ids given is taken as one).
        quarantined = quarantined if isinstance(quarantined, IdSet) else IdSet(quarantined)
        self.rank, self.world_size, self._q = rank, world_size, quarantined
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.dataset, self.sampler = dataset, sampler
        self.loader: Any = _loader(
            loader_class,
            dataset,
            batch_size,
            quarantined,
            sampler,
            sample_id,
            _WithIds(collate_fn),
            loader_kwargs,
        )
        self._it: Iterator[Any] | None = None
        self._fresh = False  # the iterator has yielded nothing yet
        # The next iterator starts from a restored position, which may be its epoch's very
        # end (a snapshot taken there): an empty first iterator then ends that epoch.
        self._restored = False
        # The step's samples by id, for re-runs: the sample itself (a user collate_fn), or
        # (the collated batch, its row) with the default collate.
        self._samples: dict[int, Any] = {}
        self._seen = 0  # samples this rank fetched, the running step's included

    @property
    def quarantined(self) -> frozenset[int]:
        return frozenset(self._q)

    @property
    def id_set(self) -> IdSet:
        return self._q

    def quarantine(self, ids: Iterable[int]) -> None:
        # The wrappers hold this set: read live in this process; loader workers get a
        # copy when the next iterator is made, which a rollback does after every quarantine.
        self._q.update(ids)  # an IdSet's ranges stay ranges

    def position(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        local = {
            "loader": self.loader.state_dict(),
            "seen": self._seen,
            "world_size": self.world_size,
        }
        return {}, local

    def restore(self, shared: dict[str, Any], local: dict[str, Any] | None) -> None:
        if local is None:
            raise PersistError(
                "this snapshot holds no data-stream position (it was written by a run that "
                "used guard.dataloader over a map-style dataset without a sampler): resume "
                "with that pipeline, or start a new run (launch --fresh)"
            )
        if int(local["world_size"]) != self.world_size:
            raise PersistError(
                f"the data stream's position was saved by {local['world_size']} ranks and "
                f"cannot be re-sharded over {self.world_size}: resume at that world size"
            )
        self.loader.load_state_dict(local["loader"])
        self._seen = int(local["seen"])
        self._it, self._restored = None, True

    def open(self, ledger_url: str) -> None:
        if self._it is None:
            if self._restored:
                # Making an iterator draws its workers' base seed from torch's global
                # generator; the run this replays drew none here (it went on with its
                # iterator), so this one draws none either: later dropout masks stay its.
                rng = torch.get_rng_state()
                self._it = iter(self.loader)
                torch.set_rng_state(rng)
            else:
                self._it = iter(self.loader)
            self._fresh, self._restored = not self._restored, False

    def fetch(self) -> tuple[list[int], Any, None] | None:
        assert self._it is not None
        try:
            ids, samples, batch = next(self._it)
        except StopIteration:
            if self._fresh:  # else the next pass would end at once too: a busy loop
                raise OrchestratorError(
                    f"rank {self.rank}: the data yields no full batch of {self.batch_size} "
                    f"samples{' (quarantined ones skipped)' if self._q else ''}; check the "
                    "dataset's sharding for this rank, or lower the batch size"
                ) from None
            self._it = None
            return None
        self._fresh = False
        if samples is not None:
            self._samples.update(zip(ids, samples, strict=True))
        else:
            self._samples.update((i, (batch, row)) for row, i in enumerate(ids))
        self._seen += len(ids)
        return ids, batch, None

    def advance(self) -> None:
        pass  # the loader's own state moves with every batch it yields

    def new_step(self) -> None:
        self._samples = {}  # only the running step can be re-run

    def rerun_batch(self, ids: list[int]) -> Any:
        if self.collate_fn is not None:
            return self.collate_fn([self._samples[i] for i in ids])
        return _joined([_rows(batch, [row]) for batch, row in (self._samples[i] for i in ids)])

    def samples_seen(self) -> int:
        # drop_last and one batch size: every rank fetches as many samples as this one.
        return max(1, self._seen * self.world_size)
