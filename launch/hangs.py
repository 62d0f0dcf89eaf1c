"""Hang forensics: before a hung attempt is killed, every rank's Python stack goes into
``RUN_DIR/hangs/attempt-<n>/rank<r>.txt`` and the culprits are named (orchestrator/stacks.py
says how). NCCL's flight recorder dumps found in that folder's ``nccl/`` stay with them."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from orchestrator.protocol import HEARTBEAT_DIR, node_path
from orchestrator.stacks import culprits, frames

HANGS_DIR = "hangs"


def collect(
    run_dir: str,
    attempt: int,
    node: str,
    beats: list[dict[str, Any]],
    ask: Callable[[list[dict[str, Any]]], list[int]],
    every_rank: list[dict[str, Any]] | None = None,
    wait_s: float = 3.0,
) -> tuple[str, list[dict[str, Any]]]:
    """Ask this ``node``'s ranks (``beats``) for their stacks (``ask`` signals them and returns
    the ranks it reached), keep the dumps under ``hangs/attempt-<n>/``, and name the
    culprits among every rank whose stack is there within ``wait_s``: the other nodes'
    supervisors, seeing the same hang, put theirs beside (``every_rank``: all nodes' beats
    of the attempt). Returns that folder and the culprits (rank, host, innermost frame of the
    training thread)."""
    out = os.path.join(run_dir, HANGS_DIR, f"attempt-{attempt}")
    os.makedirs(out, exist_ok=True)
    asked = set(ask(beats))
    src = {
        r: os.path.join(node_path(run_dir, HEARTBEAT_DIR, node), f"rank{r}.stack") for r in asked
    }
    deadline = time.monotonic() + wait_s
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:  # bounded: a rank may be past answering
        now = {r: _size(p) for r, p in src.items()}
        if all(now.values()) and now == sizes:
            break  # every dump written and no longer growing
        sizes = now
        time.sleep(0.2)
    for rank, path in src.items():
        if _size(path):
            shutil.copyfile(path, os.path.join(out, f"rank{rank}.txt"))
    everyone = {int(b["rank"]): b for b in (every_rank or beats)}
    while time.monotonic() < deadline and not all(  # the other nodes' dumps
        _size(os.path.join(out, f"rank{r}.txt")) for r in everyone
    ):
        time.sleep(0.2)
    stacks: dict[int, list[str]] = {}
    for rank, b in everyone.items():
        path = os.path.join(out, f"rank{rank}.txt")
        if _size(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                stacks[rank] = frames(f.read(), str(b.get("thread", "")))
    named = [
        {"rank": r, "host": everyone[r].get("host"), "node": everyone[r].get("node"),
         "phase": everyone[r].get("phase"), "frame": stacks[r][0] if stacks[r] else None}
        for r in culprits(stacks)
    ]  # fmt: skip
    return out, named


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
