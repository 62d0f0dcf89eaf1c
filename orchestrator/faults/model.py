"""What the faults do to the model: a NaN in a module's output (``nan_module``), or in one
local gradient (``nan_grad``, ``broken_grads``).

For a gradient, where the NaN goes depends on when the engine reduces its gradients.
Engines that reduce after backward (PyTorch, DDP's own reduction included, FSDP) get it
written into this rank's first local gradient right after backward, so only this rank's
flag says non-finite; engines that reduce inside backward (DeepSpeed,
``Engine._reduces_in_backward``) get a one-shot hook on the first trainable parameter,
which puts the NaN in before the reduction sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from orchestrator.engines import Engine
from orchestrator.errors import PolicyError


def _params(engine: Engine) -> Iterable[torch.Tensor]:
    """The parameters in the optimizer's order (the engine's own), else the model's."""
    optimizer = getattr(engine, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        return [p for g in optimizer.param_groups for p in g["params"]]
    return engine.core.parameters()


def poison_local(engine: Engine) -> bool:
    """Write a NaN into this rank's first local gradient; False if there is none yet
    (FSDP2 between micro-batches keeps them in its own buffers)."""
    for p in _params(engine):
        grad = p.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local.numel() > 0:
            with torch.no_grad():
                local.view(-1)[0] = float("nan")
            return True
    return False


def poison_hook(engine: Engine) -> RemovableHandle:
    """A hook on the first trainable parameter that puts a NaN in its gradient before the
    engine's reduction sees it; remove it after the backward."""
    param = next(p for p in engine.core.parameters() if p.requires_grad)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    return param.register_hook(hook)


def install_nan_module(root: nn.Module, module: str, armed: Callable[[], bool]) -> RemovableHandle:
    """The ``nan_module`` fault: ``module``'s output turns NaN whenever ``armed()``."""
    modules = dict(root.named_modules())
    if module not in modules:
        near = [n for n in modules if n.split(".")[-1] == module.split(".")[-1]][:5]
        raise PolicyError(
            f"faults: nan_module names module {module!r}, which the model does not have"
            + (f" (similar: {near})" if near else "")
            + "; use a name from model.named_modules()"
        )

    def hook(mod: nn.Module, inputs: Any, output: Any) -> Any:
        if not armed():
            return None
        if isinstance(output, tuple):  # e.g. MultiheadAttention: (output, weights)
            return (output[0] * float("nan"), *output[1:])
        return output * float("nan")

    return modules[module].register_forward_hook(hook)
