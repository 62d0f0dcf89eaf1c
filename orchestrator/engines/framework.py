"""Loops a framework drives (Accelerate, ``transformers.Trainer``, Lightning).

There the framework calls backward, ``optimizer.step()``, ``scheduler.step()`` and
``zero_grad()`` itself, and an integration (``orchestrator/integrations/``) routes them
through the Guard: the framework's backward reaches ``guard.backward`` and its optimizer step
``guard.step``. This engine is the Guard's side of that: backward goes through the
framework's own function (which divides by its accumulation steps and scales as it would
alone, so a healthy run is bit for bit the framework's), a committed step applies the inner
optimizer only (the framework steps its scheduler and zeroes the gradients after it, as it
does alone), and no step of the framework's is refused.

Under FSDP the snapshot and restore are the FSDP engine's (each rank its own shards):
:func:`framework_engine` picks :class:`FrameworkFSDP2Engine` or :class:`FrameworkFSDP1Engine`,
which combine this engine's backward and step with that engine's state handling.

The framework's wrappers are unwrapped here (:func:`unwrap_optimizer`): the snapshot holds
the inner optimizer and scheduler, restored in place, so the wrappers see the restored state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from orchestrator.engines.base import Engine
from orchestrator.engines.fsdp import FSDP1Engine, FSDP2Engine, is_fsdp2
from orchestrator.engines.torch_native import TorchEngine
from orchestrator.errors import UsageError

# The attribute holding the wrapped object, by the wrapper's class name: the frameworks are
# optional, so they are recognised without importing them.
_OPTIMIZER_WRAPPERS = {
    "AcceleratedOptimizer": "optimizer",  # accelerate/optimizer.py
    "LightningOptimizer": "_optimizer",  # lightning/pytorch/core/optimizer.py
}
_SCHEDULER_WRAPPERS = {"AcceleratedScheduler": "scheduler"}  # accelerate/scheduler.py


def _unwrap(obj: Any, wrappers: dict[str, str]) -> Any:
    while obj is not None and type(obj).__name__ in wrappers:
        obj = getattr(obj, wrappers[type(obj).__name__])
    return obj


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a framework's wrapper (itself if not wrapped)."""
    return _unwrap(optimizer, _OPTIMIZER_WRAPPERS)


def unwrap_scheduler(scheduler: Any) -> Any:
    """The LR scheduler inside a framework's wrapper (itself if not wrapped)."""
    return _unwrap(scheduler, _SCHEDULER_WRAPPERS)


class FrameworkEngine(TorchEngine):
    """Plain PyTorch or DDP under a framework's loop (module docstring).

    Args:
        model: the model the framework trains (DDP-wrapped or not).
        optimizer, scheduler: the framework's (wrapped or not); the inner objects are kept.
        scaler: the framework's ``GradScaler``, if any (fp16).
        backward: the framework's backward of one micro-batch's loss (its division by the
            accumulation steps and its loss scaling included).
        grad_accum_steps: micro-batches per optimizer step, as the framework counts them.
        loss_divided: the loss the framework gives backward is already divided by
            ``grad_accum_steps`` (Trainer's and Lightning's are, Accelerate's is not): the
            step's mean loss is then the sum of its micro-batches' losses.
    """

    def rebind_unsupported(self) -> str | None:
        return Engine.rebind_unsupported(self)  # not rebound yet: a full restart

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        backward: Callable[[torch.Tensor], None],
        grad_accum_steps: int = 1,
        loss_divided: bool = False,
    ) -> None:
        inner = unwrap_optimizer(optimizer)
        if not isinstance(inner, torch.optim.Optimizer):
            raise UsageError(
                f"FrameworkEngine: the optimizer is a {type(optimizer).__name__}, which holds "
                "no torch.optim.Optimizer the Guard knows how to reach; pass the torch optimizer"
            )
        if grad_accum_steps < 1:
            raise UsageError(f"FrameworkEngine(grad_accum_steps={grad_accum_steps}): must be >= 1")
        super().__init__(model, inner, unwrap_scheduler(scheduler), scaler, refuse_foreign=False)
        self._framework_backward = backward
        self.micro_steps_per_step = grad_accum_steps
        self._loss_divided = loss_divided

    @property
    def loss_divisor(self) -> int:
        return 1 if self._loss_divided else self.micro_steps_per_step

    def _backward(self, loss: torch.Tensor) -> None:
        self._framework_backward(loss)

    def _apply(self, lr_multiplier: float, overflow: bool | None = None) -> None:
        # The framework steps its scheduler and zeroes the gradients after this, as it does
        # without the Guard; on a refused step the integration tells it the step was skipped.
        self._optimizer_step(lr_multiplier, overflow)


# The framework's side (backward, step) first in the MRO, the FSDP engine's state handling
# (snapshot, restore, gradients and gradient sync of its shards) after it: FrameworkEngine's
# __init__ reaches the FSDP engine's through super().
class FrameworkFSDP2Engine(FrameworkEngine, FSDP2Engine):
    """FSDP2 (``fully_shard``) under a framework's loop: :class:`FrameworkEngine`'s backward
    and step, :class:`FSDP2Engine`'s snapshots of this rank's own shards."""


class FrameworkFSDP1Engine(FrameworkEngine, FSDP1Engine):
    """FSDP1 (``FullyShardedDataParallel``) under a framework's loop: :class:`FrameworkEngine`'s
    backward and step, :class:`FSDP1Engine`'s snapshots of this rank's own shards."""


def framework_engine(model: torch.nn.Module, *args: Any, **kwargs: Any) -> FrameworkEngine:
    """The :class:`FrameworkEngine` for ``model`` as the framework wrapped it (FSDP1, FSDP2
    parameters, else plain PyTorch or DDP), built with the same arguments."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    cls: type[FrameworkEngine] = FrameworkEngine
    if isinstance(model, FullyShardedDataParallel):
        cls = FrameworkFSDP1Engine
    elif is_fsdp2(model):
        cls = FrameworkFSDP2Engine
    return cls(model, *args, **kwargs)
