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
) -> Engine:
    """Pick the adapter for what the user passed to the Guard: DeepSpeed, FSDP1, FSDP2
    (DTensor parameters), else plain PyTorch or DDP."""
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
        return DeepSpeedEngine(engine)
    if model is None or optimizer is None:
        raise UsageError("Guard needs model= and optimizer= (or engine= for DeepSpeed)")
    if isinstance(model, FullyShardedDataParallel):
        return FSDP1Engine(model, optimizer, scheduler, scaler)
    if is_fsdp2(model):
        return FSDP2Engine(model, optimizer, scheduler, scaler)
    return TorchEngine(model, optimizer, scheduler, scaler)
