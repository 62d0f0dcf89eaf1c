"""The parts of :mod:`orchestrator.integrations.lightning` that hold Lightning's data and
counters for the Guard: the ticket stream Lightning iterates, the tap on its prepared train
loader, and its fit counters kept in every snapshot."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from lightning.pytorch.trainer import call
from torch.utils.data import Sampler


class _Ticket:
    """A placeholder Lightning fetches instead of a batch: the batch is taken from the Guard
    only when Lightning runs it (its fetcher reads one ahead)."""


class _Tickets:
    """Endless tickets (no length: Lightning's loop ends at ``max_steps``)."""

    def __iter__(self) -> Iterator[_Ticket]:
        while True:
            yield _Ticket()


class _Tap(Sampler[int]):
    """This rank's sample indices, epoch by epoch, in the order Lightning's prepared train
    loader yields them (its batch sampler, over the ``DistributedSampler`` Lightning put in,
    told the epoch as Lightning tells it), flattened. Indices only."""

    def __init__(self, loader: Any) -> None:
        self.loader, self.epoch = loader, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        batch_sampler = self.loader.batch_sampler
        samplers: tuple[Any, ...] = (self.loader.sampler, getattr(batch_sampler, "sampler", None))
        for sampler in samplers:
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self.epoch)
        for batch in batch_sampler:
            yield from (int(i) for i in batch)

    def __len__(self) -> int:
        return len(self.loader.batch_sampler) * int(self.loader.batch_size)


class _Counters:
    """Lightning's fit counters, kept in every snapshot and restored in place (never
    through Lightning's own resume path, which marks its loops as restarting)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def _parts(self) -> dict[str, Any]:
        fit = self.trainer.fit_loop
        loop = fit.epoch_loop
        return {
            "epoch_progress": fit.epoch_progress,
            "batch_progress": loop.batch_progress,
            "scheduler_progress": loop.scheduler_progress,
            "optim_progress": loop.automatic_optimization.optim_progress,
            "optim_step_progress": loop.manual_optimization.optim_step_progress,
        }

    def state_dict(self) -> dict[str, Any]:
        state = {name: part.state_dict() for name, part in self._parts().items()}
        state["batches_that_stepped"] = int(self.trainer.fit_loop.epoch_loop._batches_that_stepped)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state
        self.apply(state)

    def apply(self, state: dict[str, Any], counted: int = 0) -> None:
        """Put the counters at ``state``, less ``counted`` batch completions (and stepped
        batches) that Lightning is about to count after the hook running this."""
        for name, part in self._parts().items():
            part.load_state_dict(state[name])
        loop = self.trainer.fit_loop.epoch_loop
        for tracker in (loop.batch_progress.total, loop.batch_progress.current):
            tracker.completed -= counted
        loop.batch_progress.is_last_batch = False
        loop._batches_that_stepped = int(state["batches_that_stepped"]) - counted


def _follow_epoch(progress: Any, epoch: int) -> None:
    """Lightning's epoch counter (``current_epoch``, logged as ``epoch``) at the data epoch
    the step's samples come from, as Lightning counts an epoch under way (started, not yet
    processed): its one endless epoch of tickets spans the Guard's data epochs."""
    if progress.current.completed == epoch:
        return
    for tracker in (progress.total, progress.current):
        tracker.ready = tracker.started = epoch + 1
        tracker.processed = tracker.completed = epoch


class _Manual:
    """Manual optimization: ``training_step`` calls ``manual_backward``, ``opt.step()`` and
    its scheduler's ``step()`` itself. A re-run (isolation, crash probe) runs it with its
    loss taken instead of backpropagated (the Guard does that, without gradient sync) and
    its ``opt.step()`` doing nothing, then puts back what it moved (Lightning's counters,
    the scheduler, the LRs); after a refused step, the scheduler step ``training_step``
    took after the rollback is undone."""

    def __init__(self, trainer: Any, counters: _Counters, optimizer: Any, scheduler: Any):
        self.trainer, self.counters = trainer, counters
        self.optimizer, self.scheduler = optimizer, scheduler
        self.rerunning = False
        self.loss: torch.Tensor | None = None
        self.kept: tuple[Any, Any] | None = None

    def _keep(self) -> tuple[Any, Any]:
        sched = self.scheduler
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        return (copy.deepcopy(sched.state_dict()) if sched is not None else None), lrs

    def _put_back(self, kept: tuple[Any, Any]) -> None:
        sched, lrs = kept
        if sched is not None:
            self.scheduler.load_state_dict(sched)
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr

    def took(self, loss: torch.Tensor) -> torch.Tensor:
        """``manual_backward(loss)`` during a re-run: the loss, summed over its calls."""
        self.loss = loss if self.loss is None else self.loss + loss
        return loss

    def rerun(self, args: Iterable[Any]) -> torch.Tensor:
        """The user's ``training_step`` on a re-run's batch (the inner module's, not DDP's
        forward: its backward must not all-reduce); the loss its ``manual_backward`` got."""
        counters, kept = self.counters.state_dict(), self._keep()
        self.rerunning, self.loss = True, None
        try:
            with self.trainer.precision_plugin.train_step_context():  # as Lightning runs it
                call._call_lightning_module_hook(self.trainer, "training_step", *args)
        finally:
            self.rerunning = False
            self.counters.apply(counters)
            self._put_back(kept)
        if self.loss is None:
            raise RuntimeError(
                "GuardCallback: a re-run of training_step called no manual_backward(loss); "
                "under the Guard, training_step must call it once per batch"
            )
        return self.loss

    def rolled_back(self) -> None:
        self.kept = self._keep()

    def after_refused(self) -> None:
        if self.kept is not None:
            self._put_back(self.kept)
            self.kept = None
