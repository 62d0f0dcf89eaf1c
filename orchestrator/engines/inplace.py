"""Restore by copying into the live tensors: a rollback never builds a second copy of the
state on the device.

A snapshot's tensors sit in host buffers (``Snapshot.host``). Restoring copies each one
into the tensor it was taken from, the parameter, buffer or optimizer-state tensor itself
(a DTensor's local shard), so every one of them keeps its Python object and its storage:
the peak device memory of a rollback is the live state, nothing more, and whatever holds a
reference to a state tensor (DeepSpeed's links to its partitions, FSDP's flat parameters,
a fused optimizer's lists) stays valid. Copies to a GPU are asynchronous (from pinned
buffers they overlap each other) and :meth:`Copier.finish` waits for all of them once.

State that does not exist live yet (a lazily created optimizer state, on resume or before
the first step) is created by the engine's own loader instead: nothing exists to copy into,
so that is no second copy either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor


class Copier:
    """Copies host buffers into live tensors; :meth:`finish` waits for them all, once."""

    def __init__(self) -> None:
        self._devices: set[torch.device] = set()

    def copy(self, live: torch.Tensor, buf: torch.Tensor, what: str) -> None:
        """Copy ``buf`` into ``live`` (a DTensor: into its local shard).

        Raises:
            RuntimeError: the shapes differ (``copy_`` would broadcast a mismatch silently).
        """
        with torch.no_grad():
            dst = live.to_local() if isinstance(live, DTensor) else live
            if dst.shape != buf.shape:
                raise RuntimeError(
                    f"{what}: the snapshot holds shape {tuple(buf.shape)}, the live tensor "
                    f"has {tuple(dst.shape)}"
                )
            if dst.is_cuda:
                self._devices.add(dst.device)
                dst.copy_(buf, non_blocking=True)  # the host buffer outlives finish()
            else:
                dst.copy_(buf)

    def finish(self) -> None:
        """Wait for the copies in flight (one synchronize per device written to)."""
        for device in self._devices:
            torch.cuda.current_stream(device).synchronize()
        self._devices.clear()


def copy_module(live: dict[str, Any], saved: dict[str, Any], copier: Copier) -> bool:
    """Copy a module's saved state dict into the live one's tensors (``live``: a fresh
    ``state_dict()``, whose tensors share storage with the parameters and buffers). False,
    and nothing copied, when the two differ in keys, shapes or non-tensor entries: the
    caller's ``load_state_dict`` (also in place) then says what does not fit."""
    if set(live) != set(saved) or not all(
        isinstance(v, torch.Tensor)
        and isinstance(saved[k], torch.Tensor)
        and _local_shape(v) == saved[k].shape
        for k, v in live.items()
    ):
        return False
    for name, t in live.items():
        copier.copy(t, saved[name], f"model state {name!r}")
    return True


def copy_optimizer(
    live: dict[int, dict[str, Any]],
    saved: dict[str, Any],
    groups: list[dict[str, Any]],
    copier: Copier,
) -> list[int] | None:
    """Restore an optimizer from its saved state dict into its existing state tensors.

    Args:
        live: per-parameter index (as in ``state_dict()['state']``), the optimizer's own
            per-parameter dicts, for the parameters that have state now.
        saved: the saved ``state_dict()`` (tensors: host buffers).
        groups: the optimizer's ``param_groups``: their hyperparameters (LR & co.) are set
            from the saved ones.

    Returns:
        The indices whose live state the snapshot does not have (taken before their first
        update: the caller makes them fresh again), or None when the saved state does not
        fit the live one (state the snapshot has that does not exist live, another shape or
        kind): nothing was changed, and the caller loads it the way that creates state.
    """
    state = {int(i): entry for i, entry in saved["state"].items()}
    if len(saved["param_groups"]) != len(groups) or set(state) - set(live):
        return None
    for i, entry in state.items():
        have = live[i]
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) != isinstance(have.get(k), torch.Tensor):
                return None
            if isinstance(v, torch.Tensor) and _local_shape(have[k]) != v.shape:
                return None
    for i, entry in state.items():
        have = live[i]
        for k in set(have) - set(entry):
            del have[k]  # load_state_dict would replace the whole dict
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                copier.copy(have[k], v, f"optimizer state {k!r} of parameter {i}")
            else:
                have[k] = v
    for group, saved_group in zip(groups, saved["param_groups"], strict=True):
        for k, v in saved_group.items():  # LR & co.
            if k == "params":
                continue
            if isinstance(v, torch.Tensor):  # a tensor LR, which schedulers fill_ in place
                now = group.get(k)
                if isinstance(now, torch.Tensor) and now.shape == v.shape:
                    copier.copy(now, v, f"param group value {k!r}")
                    continue
                v = v.clone()  # never the host buffer itself
            group[k] = v
    return sorted(set(live) - set(state))


def _local_shape(t: Any) -> Any:
    return t.to_local().shape if isinstance(t, DTensor) else getattr(t, "shape", None)
