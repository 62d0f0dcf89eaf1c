"""Engine adapters: what differs between plain PyTorch/DDP, FSDP and DeepSpeed."""

from orchestrator.engines.base import Engine
from orchestrator.engines.fsdp import FSDP2Engine
from orchestrator.engines.torch_native import TorchEngine

__all__ = ["Engine", "FSDP2Engine", "TorchEngine"]
