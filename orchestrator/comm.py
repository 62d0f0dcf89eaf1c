"""The few collectives the Guard needs, on an explicit process group.

Every call names its group, so tests can run ranks as threads with one gloo group each and
the Guard never touches a group it was not given. Without an initialized process group the
Guard runs single-process and these become local no-ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class Comm:
    """Consensus primitives over one process group (``None``: the default group, if any)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.enabled else dist.group.WORLD
        self.rank = dist.get_rank(self.group) if self.enabled else 0
        self.world_size = dist.get_world_size(self.group) if self.enabled else 1
        self.global_rank = dist.get_rank() if self.enabled else 0

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place SUM over the group: the one collective of a healthy step."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_reduce_max(self, value: int) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank (cold path only)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src_rank: int = 0) -> Any:
        """Rank ``src_rank`` of the group decides; every rank gets its value."""
        if self.world_size == 1:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, src_rank) if self.group is not None else src_rank
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def _device(self) -> torch.device:
        # NCCL only moves CUDA tensors; gloo only CPU ones.
        if self.enabled and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
