"""Per-rank heartbeats in RUN_DIR/heartbeats/, read by the supervisor to detect hangs.

A beat is written only when the rank made progress (a committed step, a recovery) and at
most every ``supervisor.heartbeat_interval_s``: the hot path pays one clock read. The file
is replaced atomically, so a reader never sees half a beat.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

HEARTBEAT_DIR = "heartbeats"


class Heartbeat:
    def __init__(self, run_dir: str, rank: int, attempt: int, interval_s: float) -> None:
        self.dir = os.path.join(run_dir, HEARTBEAT_DIR)
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, f"rank{rank}.json")
        self.base = {
            "rank": rank,
            "attempt": attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }
        self.interval_s = interval_s
        self._last = 0.0

    def beat(self, step: int, phase: str = "train", force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**self.base, "step": step, "phase": phase, "time": time.time()}, f)
        os.replace(tmp, self.path)


def read_heartbeats(run_dir: str) -> list[dict[str, Any]]:
    """Every rank's latest beat (any attempt), sorted by rank."""
    d = os.path.join(run_dir, HEARTBEAT_DIR)
    beats = []
    if os.path.isdir(d):
        for name in os.listdir(d):
            if name.startswith("rank") and name.endswith(".json"):
                try:
                    with open(os.path.join(d, name), encoding="utf-8") as f:
                        beats.append(json.load(f))
                except (OSError, ValueError):
                    continue  # replaced while we read it: the next poll gets it
    return sorted(beats, key=lambda b: int(b.get("rank", 0)))
