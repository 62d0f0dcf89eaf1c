"""The pure parts of in-place recovery (orchestrator/rejoin.py): the agreement's choice of
the step and of each rank's source, and the checksum a peer's copy is checked by."""

from __future__ import annotations

import zlib
from typing import Any

import torch


class RejoinFailed(RuntimeError):
    """The in-place path cannot go on here (why): the collective's error is raised instead."""


def pick(said: list[dict[str, Any]]) -> tuple[int, dict[int, str]]:
    """The step every rank resumes from and each rank's source (by global rank), the same
    on every rank: the newest step every survivor holds sealed in its ring that every
    replacement loads from its durable part (exact: its own RNG and data position), else
    the newest the survivors hold, the replacements taking a survivor's copy.

    Raises:
        RejoinFailed: no such step, or a replacement that no source fits.
    """
    rings = [set(s["ring"]) for s in said if not s["replacement"]]
    common = set.intersection(*rings) if rings else set()
    news = [s for s in said if s["replacement"]]
    durable = set(common)
    for s in news:
        durable &= set(s["durable"])
    if durable:
        step, new_source = max(durable), "durable"
    elif common and all(s["peer"] for s in news):
        step, new_source = max(common), "peer"
    else:
        raise RejoinFailed(
            f"no step that every survivor's ring holds and every replacement can load "
            f"({said}): in-place recovery falls back"
        )
    return step, {s["rank"]: new_source if s["replacement"] else "ring" for s in said}


def crc_of(tree: Any) -> int:
    """CRC32 of every tensor of ``tree`` (and the repr of everything else), in order."""
    crc = 0
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x[k] for k in sorted(x, key=str, reverse=True))
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            crc = zlib.crc32(t.view(torch.uint8).numpy().tobytes(), crc)
        else:
            crc = zlib.crc32(repr(x).encode(), crc)
    return crc
