"""Engine adapters: what differs between plain PyTorch/DDP, FSDP and DeepSpeed.

Adding an engine means adding one module here (a subclass of :class:`Engine`, see
:mod:`orchestrator.engines.base`) and one line in :func:`engine_for`.
"""

from __future__ import annotations

from typing import Any

import torch

from orchestrator.engines.base import Engine, StepOrder
from orchestrator.engines.fsdp import FSDP1Engine, FSDP2Engine, is_fsdp2
from orchestrator.engines.torch_native import TorchEngine
from orchestrator.errors import UsageError

__all__ = ["Engine", "FSDP1Engine", "FSDP2Engine", "StepOrder", "TorchEngine", "engine_for"]


def engine_for(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    engine: Any,
    grad_accum_steps: int | None = None,
) -> Engine:
    """Pick the adapter for what the user passed to the Guard: DeepSpeed, FSDP1, FSDP2
    (DTensor parameters), else plain PyTorch or DDP; ``grad_accum_steps`` micro-batches
    per optimizer step (DeepSpeed: its own ``gradient_accumulation_steps``)."""
    if grad_accum_steps is not None and grad_accum_steps < 1:
        raise UsageError(
            f"Guard(grad_accum_steps={grad_accum_steps}): micro-batches per optimizer step "
            "must be 1 or more (1, or None: no accumulation)"
        )
    from torch.distributed.fsdp import FullyShardedDataParallel

    from orchestrator.engines.deepspeed import DeepSpeedEngine, is_deepspeed_engine

    if engine is None and is_deepspeed_engine(model):
        engine, model = model, None
    if engine is not None:
        if not is_deepspeed_engine(engine):
            raise UsageError(
                f"Guard(engine=...) takes the engine deepspeed.initialize returned, not a "
                f"{type(engine).__name__}; pass torch objects as model=/optimizer="
            )
        if any(x is not None for x in (model, optimizer, scheduler, scaler)):
            raise UsageError(
                "with a DeepSpeed engine pass only engine=...: DeepSpeed owns the model, "
                "optimizer, scheduler and loss scaler (give them to deepspeed.initialize)"
            )
        ds = DeepSpeedEngine(engine)
        if grad_accum_steps not in (None, ds.micro_steps_per_step):
            raise UsageError(
                f"grad_accum_steps={grad_accum_steps} but the DeepSpeed config says "
                f"gradient_accumulation_steps={ds.micro_steps_per_step}: DeepSpeed "
                "accumulates by its config; drop grad_accum_steps"
            )
        return ds
    if model is None or optimizer is None:
        raise UsageError("Guard needs model= and optimizer= (or engine= for DeepSpeed)")
    cls = TorchEngine
    if isinstance(model, FullyShardedDataParallel):
        cls = FSDP1Engine
    elif is_fsdp2(model):
        cls = FSDP2Engine
    adapter = cls(model, optimizer, scheduler, scaler)
    adapter.micro_steps_per_step = grad_accum_steps or 1
    return adapter
