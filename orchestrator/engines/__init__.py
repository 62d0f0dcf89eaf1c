"""Engine adapters: what differs between plain PyTorch/DDP, FSDP and DeepSpeed.

Adding an engine means a subclass of :class:`Engine` (see :mod:`orchestrator.engines.base`)
registered by name with :func:`register_engine` (:mod:`orchestrator.engines.registry`): the
built-in ones below register themselves that way, and :func:`engine_for` asks the registry.
"""

from __future__ import annotations

from typing import Any

import torch

from orchestrator.engines.base import Engine, StepOrder
from orchestrator.engines.framework import FrameworkEngine
from orchestrator.engines.fsdp import FSDP1Engine, FSDP2Engine, is_fsdp2
from orchestrator.engines.registry import (
    EngineArgs,
    build_engine,
    register_engine,
    registered_engines,
    unregister_engine,
)
from orchestrator.engines.torch_native import TorchEngine
from orchestrator.errors import UsageError

__all__ = [
    "Engine",
    "EngineArgs",
    "FSDP1Engine",
    "FrameworkEngine",
    "FSDP2Engine",
    "StepOrder",
    "TorchEngine",
    "engine_for",
    "register_engine",
    "registered_engines",
    "unregister_engine",
]


def engine_for(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    engine: Any,
    grad_accum_steps: int | None = None,
) -> Engine:
    """Pick the adapter for what the user passed to the Guard: the registered engine named
    ``engine`` (a string), else the first registered engine whose predicate takes the
    arguments (a user's first; then DeepSpeed, FSDP1, FSDP2 (DTensor parameters), plain
    PyTorch or DDP); ``grad_accum_steps`` micro-batches per optimizer step (DeepSpeed: its
    own ``gradient_accumulation_steps``)."""
    if grad_accum_steps is not None and grad_accum_steps < 1:
        raise UsageError(
            f"Guard(grad_accum_steps={grad_accum_steps}): micro-batches per optimizer step "
            "must be 1 or more (1, or None: no accumulation)"
        )
    if isinstance(engine, Engine):  # built by the caller (an integration, a user's own)
        if any(x is not None for x in (model, optimizer, scheduler, scaler, grad_accum_steps)):
            raise UsageError(
                f"Guard(engine={type(engine).__name__}(...)) takes the engine alone: it holds "
                "the model, optimizer, scheduler, scaler and accumulation steps already"
            )
        return engine
    name = engine if isinstance(engine, str) else None
    framework = None if name is not None else engine
    args = EngineArgs(model, optimizer, scheduler, scaler, framework, grad_accum_steps)
    return build_engine(args, name)


def build_deepspeed(args: EngineArgs, cls: Any) -> Engine:
    """A DeepSpeed adapter of class ``cls`` around the engine ``deepspeed.initialize``
    returned (``engine=``, or ``model=``), which must come alone: DeepSpeed owns the
    optimizer, scheduler and loss scaler."""
    from orchestrator.engines.deepspeed import is_deepspeed_engine

    ds, model = args.engine, args.model
    if ds is None and is_deepspeed_engine(model):
        ds, model = model, None
    if not is_deepspeed_engine(ds):
        raise UsageError(
            f"{cls.__name__} takes the engine deepspeed.initialize returned "
            f"(Guard(engine=ds_engine)), not {type(ds).__name__}"
        )
    if any(x is not None for x in (model, args.optimizer, args.scheduler, args.scaler)):
        raise UsageError(
            "with a DeepSpeed engine pass only engine=...: DeepSpeed owns the model, "
            "optimizer, scheduler and loss scaler (give them to deepspeed.initialize)"
        )
    adapter: Engine = cls(ds)
    if args.grad_accum_steps not in (None, adapter.micro_steps_per_step):
        raise UsageError(
            f"grad_accum_steps={args.grad_accum_steps} but the DeepSpeed config says "
            f"gradient_accumulation_steps={adapter.micro_steps_per_step}: DeepSpeed "
            "accumulates by its config; drop grad_accum_steps"
        )
    return adapter


def _is_deepspeed(args: EngineArgs) -> bool:
    from orchestrator.engines.deepspeed import is_deepspeed_engine

    return is_deepspeed_engine(args.engine if args.engine is not None else args.model)


def _is_fsdp1(args: EngineArgs) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return args.engine is None and isinstance(args.model, FullyShardedDataParallel)


def _is_fsdp2(args: EngineArgs) -> bool:
    return args.engine is None and args.model is not None and is_fsdp2(args.model)


def _deepspeed(args: EngineArgs) -> Engine:
    from orchestrator.engines.deepspeed import DeepSpeedEngine  # DeepSpeed loads lazily

    return DeepSpeedEngine.from_args(args)


# Asked last registered first: DeepSpeed, FSDP1, FSDP2, then plain PyTorch or DDP, which
# takes whatever else comes without a framework engine (and says what is missing).
register_engine("torch", TorchEngine, matches=lambda args: args.engine is None)
register_engine("fsdp2", FSDP2Engine, matches=_is_fsdp2)
register_engine("fsdp1", FSDP1Engine, matches=_is_fsdp1)
register_engine("deepspeed", _deepspeed, matches=_is_deepspeed)
