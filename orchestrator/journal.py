"""RUN_DIR/journal/<node>.jsonl: one JSON object per event, the run's structured record.

Collective decisions are journaled once, by rank 0 of the Guard's group, with the evidence
of every rank in ``details``; rank-local facts (a fault firing on rank 1) by the rank that
saw them. Each node appends to a file of its own (its ranks and its supervisor): one
``write`` on an ``O_APPEND`` descriptor keeps lines from the processes of one host whole,
which shared file systems do not promise for appends from several hosts. Readers merge the
nodes' files by time (``read_journal``).
"""

from __future__ import annotations

import glob
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from orchestrator.protocol import JOURNAL_DIR, JOURNAL_NAME, METRICS_NAME, node_name, node_path


class Journal:
    def __init__(self, run_dir: str, rank: int, attempt: int) -> None:
        self.path = node_path(run_dir, JOURNAL_DIR, node_name(), ".jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
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


def journal_files(run_dir: str) -> list[str]:
    """Every node's journal file (and the single file of older run directories)."""
    legacy = os.path.join(run_dir, JOURNAL_NAME)
    nodes = sorted(glob.glob(os.path.join(glob.escape(run_dir), JOURNAL_DIR, "*.jsonl")))
    return ([legacy] if os.path.exists(legacy) else []) + nodes


def load_journal(run_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(every node's events merged by time, the ``file:line`` of lines that did not parse).
    A crash mid-write leaves a torn last line; it is skipped, never fatal."""
    events: list[dict[str, Any]] = []
    torn: list[str] = []
    for path in journal_files(run_dir):
        try:
            f = open(path, encoding="utf-8", errors="replace")
        except FileNotFoundError:  # archived while we listed it
            continue
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    torn.append(f"{os.path.relpath(path, run_dir)}:{n}")
    # Stable: events of one node with equal times keep their order in its file.
    events.sort(key=lambda e: float(e.get("time", 0.0)))
    return events, torn


def read_journal(run_dir: str) -> Iterator[dict[str, Any]]:
    """Yield every node's events, merged by time; torn lines (crash) are skipped."""
    yield from load_journal(run_dir)[0]


def per_attempt(events: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The first ``kind`` event of each attempt: each node's supervisor journals its own
    restart (and hang), one job-wide restart is one."""
    first: dict[Any, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == kind:
            first.setdefault(e.get("attempt"), e)
    return list(first.values())


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


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """Every row of RUN_DIR/metrics.jsonl (a torn last line is skipped)."""
    path = os.path.join(run_dir, METRICS_NAME)
    rows = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return rows
