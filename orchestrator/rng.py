"""Capture and restore every RNG a training step may draw from (python, numpy, torch, CUDA).

CUDA: only the generator of the device this rank trains on is saved, and it is restored into
the device this rank trains on at restore time, whatever its index then. A rank's stream is
its own (snapshots keep ``rng`` per rank), not a device index's: a resume under another
``CUDA_VISIBLE_DEVICES`` order, or with one visible device per process instead of all,
restores the stream the rank was drawing from, where restoring every visible device by
index gave a rank another rank's stream (and raised IndexError with fewer devices).

Snapshots taken before this format hold a list, one state per device visible then (see
:func:`_old_entry` for which entry is restored).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional
    np = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

#: A CUDA (Philox) generator state: its seed and its offset, two int64 (torch >= 1.13).
_PHILOX_BYTES = 16


def _cuda_index(device: torch.device | int | None) -> int:
    if isinstance(device, torch.device):
        return device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_device() if device is None else int(device)


def rng_state(device: torch.device | int | None = None) -> dict[str, Any]:
    """The state of every generator a step may draw from. ``device``: the CUDA device this
    rank trains on (default: the current device); only its generator is saved."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = _cuda_index(device)
        state["cuda"] = torch.cuda.get_rng_state(index)
        state["cuda_device"] = index  # where it was taken: informational, never used to restore
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | int | None = None) -> None:
    """Restore :func:`rng_state`'s ``state``; its CUDA generator goes to ``device`` (the one
    this rank trains on now, default the current device), whatever index it was saved from."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return  # saved without CUDA, or restored on a machine without it: nothing to put back
    index = _cuda_index(device)
    if isinstance(cuda, (list, tuple)):
        cuda = _old_entry(list(cuda), index)
        if cuda is None:
            return
    torch.cuda.set_rng_state(cuda.cpu(), index)


def _old_entry(states: list[torch.Tensor], index: int) -> torch.Tensor | None:
    """The entry of an old-format state (one per device visible when it was saved) that is
    this rank's stream. The device a rank trained on is the only one whose generator moved:
    the others sit at their seed with offset 0. So: the one entry whose Philox offset is not
    0; failing that (none or several moved, or another state layout), the entry at the
    index of the device this rank trains on now, which is what the old format restored into
    it (right whenever the device layout did not change); none if that index is past the
    list (fewer devices saved than this rank's index: the generator keeps its seed)."""
    moved = [
        s
        for s in states
        if s.numel() == _PHILOX_BYTES
        and s.dtype == torch.uint8
        and int(s.cpu().view(torch.int64)[1]) != 0
    ]
    if len(moved) == 1:
        return moved[0]
    if index < len(states):
        return states[index]
    logger.warning(
        "the snapshot's CUDA RNG holds %d device states (an old format) and none is this "
        "rank's for certain; device %d keeps its current state",
        len(states),
        index,
    )
    return None


def torch_rng_state(device: torch.device | int | None = None) -> tuple[torch.Tensor, Any]:
    """torch's CPU generator and this rank's CUDA one: what a step's dropout draws from.
    Cheap enough for every step (host copies of the generators' state, no device sync)."""
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state(_cuda_index(device))
    return torch.get_rng_state(), cuda


def set_torch_rng_state(
    state: tuple[torch.Tensor, Any], device: torch.device | int | None = None
) -> None:
    """Put back :func:`torch_rng_state`'s ``state``."""
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, _cuda_index(device))
