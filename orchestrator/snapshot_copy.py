"""How the snapshot ring (orchestrator/snapshot.py) copies a state to the host: the nested
state flattened into its tensors and a skeleton of placeholders (and back), the host arenas
(page-locked at their exact size), and the copy of a tensor, or of a part of it, into its
buffer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator.pinned import register


@dataclass(frozen=True)
class Leaf:
    index: int
    device: torch.device


def flatten(obj: Any, leaves: list[torch.Tensor]) -> Any:
    """Replace every tensor in ``obj`` with a ``Leaf`` placeholder, collecting the tensors."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return Leaf(len(leaves) - 1, obj.device)
    if isinstance(obj, dict):
        return {k: flatten(v, leaves) for k, v in obj.items()}
    if isinstance(obj, list):
        return [flatten(v, leaves) for v in obj]
    if type(obj) is tuple:  # subclasses (namedtuples, torch.Size) are kept whole
        return tuple(flatten(v, leaves) for v in obj)
    return copy.deepcopy(obj)


def unflatten(skel: Any, get: Callable[[Leaf], torch.Tensor]) -> Any:
    if isinstance(skel, Leaf):
        return get(skel)
    if isinstance(skel, dict):
        return {k: unflatten(v, get) for k, v in skel.items()}
    if isinstance(skel, list):
        return [unflatten(v, get) for v in skel]
    if type(skel) is tuple:
        return tuple(unflatten(v, get) for v in skel)
    return copy.deepcopy(skel)


ALIGN = 64  # every buffer in an arena starts on a cache line (and any dtype's alignment)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def slot_bytes(estimate: int) -> int:
    """The bytes of one private ring slot for a state estimated at ``estimate`` bytes: room
    for each tensor's alignment and the small values the Guard adds (what the host-memory
    check budgets, exactly)."""
    return _aligned(estimate + estimate // 64 + (1 << 20))


def _arena(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory, page-locked at exactly that size with ``pin``: torch's
    pinned allocator would round it up to a power of two (up to twice the budget)."""
    arena = torch.empty(_aligned(max(nbytes, 1)), dtype=torch.uint8)
    if pin:
        register(arena)
    return arena


def _copy(dst: torch.Tensor, src: torch.Tensor, part: tuple[int, int] | None) -> int:
    """Copy ``src`` (or the elements ``part`` of its flattened view) into ``dst``; the bytes
    copied."""
    if part is None:
        dst.copy_(src.detach(), non_blocking=src.is_cuda)
        return dst.numel() * dst.element_size()
    a, b = part
    if b <= a:
        return 0
    dst.view(-1)[a:b].copy_(src.detach().reshape(-1)[a:b], non_blocking=src.is_cuda)
    return (b - a) * dst.element_size()


class _maybe_stream:
    def __init__(self, stream: Any) -> None:
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
