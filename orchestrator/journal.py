"""RUN_DIR/journal.jsonl: one JSON object per event, the run's structured record.

Collective decisions are journaled once, by rank 0 of the Guard's group, with the evidence
of every rank in ``details``; rank-local facts (a fault firing on rank 1) by the rank that
saw them. Lines are appended with one ``write`` on an ``O_APPEND`` descriptor, which keeps
lines from different local processes whole on a local file system.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from orchestrator.protocol import JOURNAL_NAME


class Journal:
    def __init__(self, run_dir: str, rank: int, attempt: int) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, JOURNAL_NAME)
        self.rank = rank
        self.attempt = attempt
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()  # the persist thread writes too

    def write(self, kind: str, step: int, details: dict[str, Any]) -> dict[str, Any]:
        event = {
            "time": time.time(),
            "kind": kind,
            "step": step,
            "rank": self.rank,
            "attempt": self.attempt,
            "details": details,
        }
        line = (json.dumps(event, default=str) + "\n").encode()
        with self._lock:
            if self._fd >= 0:  # after close (a writer thread that outlived it): dropped
                os.write(self._fd, line)
        return event

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_journal(run_dir: str) -> Iterator[dict[str, Any]]:
    """Yield the events of RUN_DIR/journal.jsonl; a torn last line (crash) is skipped."""
    path = os.path.join(run_dir, JOURNAL_NAME)
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def quarantine_share(events: Iterable[dict[str, Any]]) -> tuple[int, int] | None:
    """(quarantined samples, distinct samples seen) as the newest ``quarantine`` or
    ``run_end`` event states them, or None when no event does (nothing quarantined yet, or
    a journal older than the data budget)."""
    share = None
    for e in events:
        d = e.get("details", {})
        if "samples_seen" not in d:
            continue
        if e["kind"] == "quarantine":
            share = (int(d["total"]), int(d["samples_seen"]))
        elif e["kind"] == "run_end":
            share = (len(d.get("quarantined", [])), int(d["samples_seen"]))
    return share


class Decisions:
    """Journals a collective decision once: by rank 0 of the Guard's group (``writer``),
    with the evidence of every rank in its details."""

    def __init__(self, journal: Journal, writer: bool) -> None:
        self.journal, self.writer = journal, writer

    def __call__(self, kind: str, step: int, **details: Any) -> None:
        if self.writer:
            self.journal.write(kind, step, details)
