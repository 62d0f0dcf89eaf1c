"""Engine adapters: what differs between plain PyTorch/DDP, FSDP and DeepSpeed."""

from orchestrator.engines.base import Engine
from orchestrator.engines.fsdp import FSDP1Engine, FSDP2Engine
from orchestrator.engines.torch_native import TorchEngine

__all__ = ["Engine", "FSDP1Engine", "FSDP2Engine", "TorchEngine"]
