"""Files in an engine's own checkpoint layout (DeepSpeed's ``torch.save`` files), so the
engine's own loader (``engine.load_checkpoint``, ``zero_to_fp32``) reads durable snapshots.

The durable store writes and reads them through these two functions only; their checksums
are in the manifest and verified before :func:`load_native` runs. Reading is never code
execution: ``torch.load(weights_only=True)``, with the few DeepSpeed classes its files hold
(loss scalers, the ZeRO stage enum, fragment addresses) allowed by name. A file that needs
anything else is refused before any of it is built.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
from typing import IO, Any

import torch

from orchestrator.errors import PersistError
from orchestrator.protocol import ENV_ALLOW_GLOBALS

# What DeepSpeed 0.19's checkpoint files pickle besides tensors and plain values (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO 1/2/3, fp16 and bf16 files).
# Plain data holders: building them runs no code of the file's choosing.
ALLOWED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


def _allowed() -> list[Any]:
    """The allowed classes that can be imported here (DeepSpeed is optional), and numpy's
    array reconstruction (RNG states hold numpy arrays): it builds an ndarray of an allowed
    dtype, nothing else (torch's documented allow-list for numpy)."""
    out = []
    more = [n.strip() for n in os.environ.get(ENV_ALLOW_GLOBALS, "").split(",") if n.strip()]
    for name in (*ALLOWED_GLOBALS, *more):
        module, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue  # not installed: a file that needs it is refused below
    import numpy as np

    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed it
    out += [core.multiarray._reconstruct, np.ndarray, np.dtype]
    out += [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.uint8, np.bool_)]
    return out


def save_native(obj: Any, f: IO[bytes]) -> None:
    """``torch.save`` of ``obj``, each tensor on its own: the ring's buffers are views of
    one arena or slot file per snapshot, and ``torch.save`` writes a view's whole storage
    (and refuses views of one storage as different dtypes)."""
    torch.save(_own_storage(obj), f)


def _own_storage(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        whole = obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()
        return obj if whole else obj.clone()
    if isinstance(obj, dict):
        return {k: _own_storage(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_own_storage(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_own_storage(v) for v in obj)
    return obj


def load_native(f: IO[bytes], name: str = "", extra: tuple[Any, ...] = ()) -> Any:
    """Read an engine file with ``weights_only=True`` and the allowed globals only (and
    ``extra`` classes of ours).

    Raises:
        PersistError: the file holds anything else (a pickle that would build arbitrary
            objects or call functions is refused without running it), or is not a
            checkpoint file at all.
    """
    try:
        with torch.serialization.safe_globals([*_allowed(), *extra]):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        what = found.group(1) if found else str(err).splitlines()[0][:300]
        raise PersistError(
            f"{name or 'an engine checkpoint file'} holds {what}, outside the allowed "
            "classes: refused without loading it (it could run code). If your own run wrote "
            "it with an engine release that pickles a new plain data class, check the class "
            f"and allow it by name: {ENV_ALLOW_GLOBALS}=module.Class"
        ) from err
    except (RuntimeError, EOFError, ValueError) as err:
        raise PersistError(f"{name or 'an engine checkpoint file'} is unreadable: {err}") from err
