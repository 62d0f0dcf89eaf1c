"""The codec of a snapshot part: a state tree as (JSON structure + plain values, tensors
by path). Plain values are JSON, never pickled; tensors are written and read by DCP."""

from __future__ import annotations

from typing import Any

import torch

from orchestrator.errors import PersistError
from orchestrator.snapshot import Leaf


def encode(obj: Any, path: str, tensors: dict[str, torch.Tensor], bufs: list[torch.Tensor]) -> Any:
    if isinstance(obj, Leaf):
        tensors[path] = bufs[obj.index]
        return {"__tensor__": path}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: encode(v, f"{path}/{k}", tensors, bufs) for k, v in obj.items()}
        return {"__items__": [[k, encode(v, f"{path}/{k}", tensors, bufs)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [encode(v, f"{path}/{i}", tensors, bufs) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, f"{path}/{i}", tensors, bufs) for i, v in enumerate(obj)]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if type(obj).__module__ == "numpy" and hasattr(obj, "tolist"):  # numpy RNG state arrays
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    raise PersistError(
        f"state entry {path} holds a {type(obj).__name__}, which cannot be persisted as JSON; "
        "make its state_dict() return plain values and tensors"
    )


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: decode(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(decode(v, tensors) for v in obj["__tuple__"])
        if "__ndarray__" in obj:
            import numpy as np

            return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
        return {k: decode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    return obj


def tensors_of(obj: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    """Collect the tensors of a loaded tree by path (for the finiteness check)."""
    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensors_of(v, f"{path}/{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensors_of(v, f"{path}/{i}", out)


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise PersistError(f"unknown tensor dtype {name!r} in a snapshot part")
    return dt
