"""Hang forensics: before a hung attempt is killed, every rank's Python stack goes into
``RUN_DIR/hangs/attempt-<n>/rank<r>.txt`` and the culprits are named (orchestrator/stacks.py
says how). NCCL's flight recorder dumps found in that folder's ``nccl/`` stay with them."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from orchestrator.protocol import HEARTBEAT_DIR
from orchestrator.stacks import culprits, frames

HANGS_DIR = "hangs"


def collect(
    run_dir: str,
    attempt: int,
    beats: list[dict[str, Any]],
    ask: Callable[[list[dict[str, Any]]], list[int]],
    wait_s: float = 3.0,
) -> tuple[str, list[dict[str, Any]]]:
    """Ask the ranks of ``beats`` for their stacks (``ask`` signals them and returns the
    ranks it reached), wait up to ``wait_s`` for the dumps, keep them under
    ``hangs/attempt-<n>/``. Returns that folder and the culprits (rank, host, innermost
    frame of the training thread)."""
    out = os.path.join(run_dir, HANGS_DIR, f"attempt-{attempt}")
    os.makedirs(out, exist_ok=True)
    asked = set(ask(beats))
    src = {r: os.path.join(run_dir, HEARTBEAT_DIR, f"rank{r}.stack") for r in asked}
    deadline = time.monotonic() + wait_s
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:  # bounded: a rank may be past answering
        now = {r: _size(p) for r, p in src.items()}
        if all(now.values()) and now == sizes:
            break  # every dump written and no longer growing
        sizes = now
        time.sleep(0.2)
    stacks: dict[int, list[str]] = {}
    for b in beats:
        rank = int(b["rank"])
        if rank not in src or not _size(src[rank]):
            continue
        dest = os.path.join(out, f"rank{rank}.txt")
        shutil.copyfile(src[rank], dest)
        with open(dest, encoding="utf-8", errors="replace") as f:
            stacks[rank] = frames(f.read(), str(b.get("thread", "")))
    host = {int(b["rank"]): b.get("host") for b in beats}
    named = [
        {"rank": r, "host": host.get(r), "frame": stacks[r][0] if stacks[r] else None}
        for r in culprits(stacks)
    ]
    return out, named


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
