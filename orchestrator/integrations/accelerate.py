"""Hugging Face Accelerate: the Guard inside a standard Accelerate loop (docs/accelerate.md).

The loop stays the user's: ``accelerator.accumulate``, ``accelerator.backward``, clipping,
``optimizer.step()``, ``scheduler.step()``, ``zero_grad()``. Three lines change it:
``guard = guard_accelerate(accelerator, policy)``, ``guard.batches(loader, max_steps)``
instead of ``loader`` and ``guard.close()``. What the Guard does at Accelerate's hooks:

- **Backward.** The instance's ``accelerator.backward`` goes through ``guard.backward``,
  whose engine (:class:`~orchestrator.engines.framework.FrameworkEngine`) calls Accelerate's
  own: its division by the accumulation steps and its loss scaling run as they would alone.
- **Step.** The prepared optimizer's ``step`` calls ``guard.step()`` on every micro-batch;
  on a commit the engine steps the inner optimizer (as ``AcceleratedOptimizer.step`` does
  with ``sync_gradients`` set). Any other outcome at a step's end (a refused step, a
  rollback, an isolation re-run) sets the wrapper's ``_is_overflow``, so Accelerate's
  scheduler skips that step as it skips an fp16 overflow.
- **Accumulation counter.** Before every micro-batch ``accelerator.step`` is set from the
  Guard's position (``global_step * GA + micro``), so ``accumulate`` syncs exactly at the
  Guard's step boundaries. A rollback resets the Guard's micro-batch index; left alone,
  Accelerate's counter would stay out of phase and the replicas would apply gradients that
  were never all-reduced, and diverge silently.
- **Data.** The Guard's loader yields this rank's indices in the order the prepared loader
  would (:class:`AcceleratedOrder`, a tap over its batch sampler), batched and collated as
  there, so a healthy run is bit for bit Accelerate's; the Guard adds sample ids, a
  rewindable position and the quarantine.

Accelerate's private attributes used here are checked at start (:func:`check_internals`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import RandomSampler, Sampler

from orchestrator.engines.framework import FrameworkEngine
from orchestrator.errors import UsageError
from orchestrator.guard import ACCUMULATE, COMMIT, Guard
from orchestrator.policy import Policy

__all__ = ["AccelerateGuard", "AcceleratedOrder", "check_internals", "guard_accelerate"]

# What this module reads or sets that Accelerate does not document (1.10 to 1.15).
_ACCELERATOR_ATTRS = ("step", "gradient_state", "_models", "_optimizers", "_schedulers", "scaler")
_OPTIMIZER_ATTRS = ("optimizer", "_is_overflow", "step_was_skipped")
_GRADIENT_STATE_ATTRS = ("sync_gradients", "num_steps", "plugin_kwargs")
# DDP or one process: what FrameworkEngine (a TorchEngine) snapshots and restores.
_SUPPORTED = frozenset({"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_HPU"})


def _missing(obj: Any, names: tuple[str, ...], what: str) -> None:
    import accelerate

    for name in names:
        if not hasattr(obj, name):
            raise UsageError(
                f"Accelerate {accelerate.__version__}: {what} has no {name!r}, which "
                "orchestrator/integrations/accelerate.py needs. This Accelerate changed an "
                "internal the integration relies on: install the range pyproject.toml names "
                "(the accelerate extra), or update the integration"
            )


def check_internals(accelerator: Any) -> None:
    """Fail at start, naming the attribute and Accelerate's version, if this Accelerate lacks
    something the integration needs, or the setup is one it does not support."""
    _missing(accelerator, _ACCELERATOR_ATTRS, "Accelerator")
    _missing(accelerator.gradient_state, _GRADIENT_STATE_ATTRS, "GradientState")
    kind = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if kind not in _SUPPORTED:
        raise UsageError(
            f"guard_accelerate: distributed_type {kind} is not supported: the integration "
            "covers one process and DDP (MULTI_CPU, MULTI_GPU). For DeepSpeed or FSDP use the "
            "Guard's own loop (docs/engines.md)"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and int(accelerator.num_processes) == 1:
        raise UsageError(
            f"guard_accelerate: the launcher started {world} ranks (WORLD_SIZE) but Accelerate "
            "runs one process each, with no process group: every rank would train alone. On "
            "a machine without a GPU pass Accelerator(cpu=True) (what `accelerate launch "
            "--cpu` sets)"
        )
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        raise UsageError(
            "guard_accelerate: GradientAccumulationPlugin(sync_each_batch=True) is not "
            "supported: the Guard reduces gradients once per optimizer step (the micro-batches "
            "before the last run under no_sync); drop sync_each_batch"
        )
    counts = [len(accelerator._models), len(accelerator._optimizers)]
    if counts != [1, 1] or len(accelerator._schedulers) > 1:
        raise UsageError(
            f"guard_accelerate: accelerator.prepare got {counts[0]} model(s), {counts[1]} "
            f"optimizer(s) and {len(accelerator._schedulers)} scheduler(s); the integration "
            "guards one model with one optimizer (and at most one scheduler): call "
            "guard_accelerate after accelerator.prepare(model, optimizer, loader[, scheduler])"
        )
    _missing(accelerator._optimizers[0], _OPTIMIZER_ATTRS, "AcceleratedOptimizer")


def _index_sampler(loader: Any) -> Any:
    """The sampler of indices under the prepared loader's batch sampler (and its shard)."""
    batches = loader.batch_sampler
    if batches is None:
        return None
    inner = getattr(batches, "batch_sampler", batches)  # BatchSamplerShard wraps it
    return getattr(inner, "sampler", None)


class AcceleratedOrder(Sampler[int]):
    """This rank's indices, in the order the prepared loader yields them in each epoch: its
    batch sampler (Accelerate's ``BatchSamplerShard``), told the epoch the way
    ``DataLoaderShard.__iter__`` tells it, flattened. The Guard batches them again in the
    same sizes, so its batches are the prepared loader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        # The prepared loader's own set_epoch: what its __iter__ calls with its epoch count.
        self.loader.set_epoch(self.epoch)
        for batch in self.loader.batch_sampler:
            yield from batch

    def __len__(self) -> int:
        return len(self.loader.batch_sampler) * _rank_batch_size(self.loader)


def _rank_batch_size(loader: Any) -> int:
    from accelerate.state import AcceleratorState

    return int(loader.total_batch_size) // int(AcceleratorState().num_processes)


def _check_loader(loader: Any) -> None:
    from accelerate.data_loader import DataLoaderShard, SeedableRandomSampler

    if not isinstance(loader, DataLoaderShard) or loader.batch_sampler is None:
        raise UsageError(
            f"guard.batches got a {type(loader).__name__}: pass the DataLoader "
            "accelerator.prepare returned for a map-style dataset (an IterableDataset or "
            "dispatch_batches=True is not supported: use the Guard's own loop, docs/loop.md)"
        )
    sampler = _index_sampler(loader)
    if isinstance(sampler, RandomSampler) and not isinstance(sampler, SeedableRandomSampler):
        raise UsageError(
            "guard.batches: the prepared loader shuffles with a RandomSampler whose order "
            "depends on its generator's history, so a rollback or a resume cannot replay it. "
            "Make it a function of the epoch: Accelerator(dataloader_config="
            "DataLoaderConfiguration(use_seedable_sampler=True)) (and seed every rank alike, "
            "e.g. accelerate.utils.set_seed, or data_seed=)"
        )


class AccelerateGuard(Guard):
    """A :class:`~orchestrator.Guard` hooked into an ``Accelerator`` (made by
    :func:`guard_accelerate`). Its ``batches`` takes the prepared loader; everything else is
    the Guard's (``global_step``, ``incidents``, ``micro``, ``register_state``...), and
    ``outcome`` says what the loop's last ``optimizer.step()`` did."""

    def __init__(self, accelerator: Any, policy: Policy | None = None, **options: Any) -> None:
        check_internals(accelerator)
        self.accelerator = accelerator
        self._accelerated = accelerator._optimizers[0]
        # The bound methods before the integration shadows them on the instances.
        self._framework_backward = accelerator.backward
        self._backward_kwargs: dict[str, Any] = {}
        engine = FrameworkEngine(
            accelerator._models[0],
            self._accelerated,
            accelerator._schedulers[0] if accelerator._schedulers else None,
            accelerator.scaler,
            backward=self._accelerate_backward,
            grad_accum_steps=int(accelerator.gradient_accumulation_steps),
        )
        super().__init__(policy, engine=engine, **options)
        #: What the loop's last ``optimizer.step()`` did, as ``guard.step`` returns it:
        #: ``"commit"`` once per optimizer step applied; log, evaluate and save on it.
        self.outcome: str | None = None
        self._loaders: dict[int, tuple[Any, Any]] = {}  # id(prepared) -> (prepared, Guard's)
        accelerator.backward = self._backward_hook
        self._accelerated.step = self._step_hook

    # --- Accelerate's hooks -----------------------------------------------------------------
    def _backward_hook(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``accelerator.backward(loss)``: through the Guard (which keeps the loss for its
        check, and where faults are injected) to Accelerate's own backward."""
        self._backward_kwargs = kwargs
        self.backward(loss)  # looked up on the instance: fault injection shadows it

    def _accelerate_backward(self, loss: torch.Tensor) -> None:
        self._framework_backward(loss, **self._backward_kwargs)

    def _step_hook(self, closure: Any = None) -> None:
        """``optimizer.step()`` on every micro-batch: the Guard judges and, on a commit,
        steps the inner optimizer; a step not applied is skipped by Accelerate's scheduler."""
        if closure is not None:
            raise UsageError("guard_accelerate: optimizer.step(closure) is not supported")
        self.outcome = outcome = self.step()
        if outcome != ACCUMULATE:
            self._accelerated._is_overflow = outcome != COMMIT

    # --- the loop ---------------------------------------------------------------------------
    def _guard_loader(self, loader: Any) -> Any:
        """The Guard's loader over the prepared ``loader``'s data (made once per loader)."""
        known = self._loaders.get(id(loader))
        if known is not None:
            return known[1]
        _check_loader(loader)
        options: dict[str, Any] = {"collate_fn": loader.collate_fn}
        if loader.num_workers:
            options.update(num_workers=loader.num_workers, pin_memory=loader.pin_memory)
        ours = self.dataloader(
            loader.dataset, _rank_batch_size(loader), sampler=AcceleratedOrder(loader), **options
        )
        self._loaders[id(loader)] = (loader, ours)
        return ours

    def batches(self, loader: Any, max_steps: int) -> Iterator[Any]:
        """Yield the prepared ``loader``'s batches (on its device) until ``max_steps`` steps
        are committed, as :meth:`Guard.batches` does, with Accelerate's accumulation counter
        kept at the Guard's position before each one."""
        from accelerate.utils import send_to_device

        ga = self.engine.micro_steps_per_step
        device = getattr(loader, "device", None)
        for batch in super().batches(self._guard_loader(loader), max_steps):
            if self.investigation.active or self._probing:
                # A re-run (isolation, crash probe) is a step of its own: accumulate syncs
                # for it, so the body runs all of it (clipping, optimizer.step()); the Guard
                # keeps its gradients local and applies nothing.
                self.accelerator.step = self.global_step * ga + ga - 1
            else:
                self.accelerator.step = self.global_step * ga + self.micro
            yield batch if device is None else send_to_device(batch, device)
            if self._phase == "backward":  # the body ran backward but no optimizer.step()
                self._no_step()

    def _no_step(self) -> None:
        """A loop that calls ``optimizer.step()`` only when ``accelerator.sync_gradients``:
        the micro-batches before the last accumulate as they would; the last must step."""
        if self.last_micro and not (self.investigation.active or self._probing):
            raise UsageError(
                "the loop body ran accelerator.backward but not optimizer.step() on the last "
                "micro-batch of a step: call optimizer.step() (and scheduler.step(), "
                "optimizer.zero_grad()) in the body, as a plain Accelerate loop does"
            )
        self._step_hook()

    def close(self, persist: bool = True) -> None:
        """Close the Guard (:meth:`Guard.close`) and give Accelerate back its own backward
        and optimizer step."""
        try:
            super().close(persist)
        finally:
            for obj, name in ((self.accelerator, "backward"), (self._accelerated, "step")):
                if name in vars(obj):
                    delattr(obj, name)


def guard_accelerate(
    accelerator: Any, policy: Policy | None = None, **options: Any
) -> AccelerateGuard:
    """A Guard for the loop of ``accelerator``, to call after ``accelerator.prepare``.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared one model, its optimizer,
            the training loader and at most one LR scheduler.
        policy: as for :class:`~orchestrator.Guard` (``None``: ``load_policy()``).
        options: any other :class:`~orchestrator.Guard` argument (``run_dir``, ``state``,
            ``fresh``, ``process_group``); the model, optimizer, scheduler, scaler and
            accumulation steps come from the accelerator.

    Returns:
        An :class:`AccelerateGuard`: iterate ``guard.batches(prepared_loader, max_steps)``
        instead of the loader; the loop body stays as it is. See docs/accelerate.md.

    Raises:
        UsageError: a setup the integration does not support, or an Accelerate whose
            internals differ from the ones it was written for.
    """
    taken = sorted({"model", "optimizer", "scheduler", "scaler", "engine"} & set(options))
    if taken or "grad_accum_steps" in options:
        raise UsageError(
            f"guard_accelerate({', '.join(taken or ['grad_accum_steps'])}=...): these come "
            "from the accelerator (its prepared objects and gradient_accumulation_steps)"
        )
    return AccelerateGuard(accelerator, policy, **options)
