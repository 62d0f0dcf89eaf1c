"""Files in an engine's own checkpoint layout (DeepSpeed's ``torch.save`` files), so the
engine's own loader (``engine.load_checkpoint``, ``zero_to_fp32``) reads durable snapshots.

The durable store writes and reads them through these two functions only; their checksums
are in the manifest and verified before :func:`load_native` runs.
"""

from __future__ import annotations

from typing import IO, Any

import torch


def save_native(obj: Any, f: IO[bytes]) -> None:
    torch.save(obj, f)


def load_native(f: IO[bytes]) -> Any:
    # DeepSpeed's files pickle its config object and version, so they are not loadable
    # with weights_only=True as is; the checksum was verified before this.
    return torch.load(f, map_location="cpu", weights_only=False)
