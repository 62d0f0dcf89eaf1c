"""RUN_DIR/journal/<node>.jsonl: one JSON object per event, the run's structured record.

Collective decisions are journaled once, by rank 0 of the Guard's group, with the evidence
of every rank in ``details``; rank-local facts (a fault firing on rank 1) by the rank that
saw them. Each node appends to a file of its own (its ranks and its supervisor): one
``write`` on an ``O_APPEND`` descriptor keeps lines from the processes of one host whole,
which shared file systems do not promise for appends from several hosts. Readers merge the
nodes' files by time (``read_journal``).

What is written is checked against the kind's record (:mod:`orchestrator.events`), the
schema the readers parse with: ``Journal.emit`` writes a record, ``Journal.write`` a
``details`` dict, checked the same way. A kind without a record, or details that do not fit
it, is a writer's bug: with ``ORCHESTRATOR_STRICT_EVENTS=1`` (the tests set it) the write
raises :class:`EventMisfit`; otherwise the error is logged once per kind and the line is
written anyway (an event is never lost, training never stops for bookkeeping).
"""

from __future__ import annotations

import collections
import errno
import glob
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from orchestrator.events import DAMAGED, RECORDS, EventLog, Record, parse, typed
from orchestrator.events import quarantine_share as events_quarantine_share
from orchestrator.events.base import details_of, misfit
from orchestrator.protocol import JOURNAL_DIR, JOURNAL_NAME, METRICS_NAME, node_name, node_path

logger = logging.getLogger(__name__)
# Events kept in memory while the journal cannot be written (a full disk), written when it
# can be again; past this many bytes the oldest are dropped (and counted).
MAX_PENDING_BYTES = 16 << 20
EVENT_JOURNAL_FAILED = "journal_failed"  # written once writes work again: what was late
# Set (to 1) by the tests, inherited by their subprocesses: a write whose details do not fit
# its kind's record raises instead of being logged (see the module's docstring).
ENV_STRICT_EVENTS = "ORCHESTRATOR_STRICT_EVENTS"
_MISFITS_SAID: set[str] = set()  # kinds whose misfit this process logged (once each)


class EventMisfit(TypeError):
    """A journal write whose kind has no record, or whose details do not fit it (a bug in
    the writer, raised only in strict mode: ``ORCHESTRATOR_STRICT_EVENTS=1``)."""


def strict_events() -> bool:
    """Whether misfit writes raise (``ORCHESTRATOR_STRICT_EVENTS`` set, and not 0)."""
    return os.environ.get(ENV_STRICT_EVENTS, "") not in ("", "0")


class Journal:
    """Appends events to this node's journal file. A write that fails (a full disk, an I/O
    error, a read-only file system) never raises: it cannot be journaled, so it is said
    once on stderr, the events wait in memory (up to ``MAX_PENDING_BYTES``) and are written,
    with their own times, as soon as the file takes writes again; then a
    ``journal_failed`` event says how long it failed and how many events were lost."""

    def __init__(self, run_dir: str, rank: int, attempt: int) -> None:
        self.path = node_path(run_dir, JOURNAL_DIR, node_name(), ".jsonl")
        self.rank = rank
        self.attempt = attempt
        self._fd = -1
        self._closed = False
        self._lock = threading.Lock()  # the persist thread writes too
        self._pending: collections.deque[bytes] = collections.deque()
        self._pending_bytes = 0
        self._dropped = 0
        self._failed: tuple[float, int, str] | None = None  # since (time, step), the error
        self._torn = False  # a short write left part of a line: start the next on its own
        self.strict = strict_events()
        with self._lock:
            self._open()

    def write(self, kind: str, step: int, details: dict[str, Any]) -> dict[str, Any]:
        """Append an event of ``kind`` (checked against its record: see the module's
        docstring); returns it as written."""
        event = {
            "time": time.time(),
            "kind": kind,
            "step": _int(step),
            "rank": self.rank,
            "attempt": self.attempt,
            "details": details,
        }
        line = (json.dumps(event, default=str) + "\n").encode()
        self._check(kind, step, details, line)
        with self._lock:
            if not self._closed:  # after close (a writer thread that outlived it): dropped
                self._queue(line)
                self._drain(_int(step))
        return event

    def emit(
        self, step: int, record: Record, *, skip_none: bool = False, **extra: Any
    ) -> dict[str, Any]:
        """Write ``record`` as an event of its kind: its fields are the ``details`` (None
        ones left out with ``skip_none``; a reader takes an absent optional field as None),
        then ``extra``, evidence the record does not name (one that names a field would
        replace the record's value: strict mode raises :class:`EventMisfit`)."""
        details = details_of(record, skip_none)
        if self.strict and not extra.keys().isdisjoint(details):
            raise EventMisfit(
                f"journal event {record.KIND!r} at step {step}: the extra details "
                f"{sorted(extra.keys() & details.keys())} are fields of {type(record).__name__}: "
                "set them in the record"
            )
        return self.write(record.KIND, step, {**details, **extra})

    def _check(self, kind: str, step: int, details: Any, line: bytes) -> None:
        """Check ``details`` against the kind's record, as a reader will parse them: raise
        :class:`EventMisfit` in strict mode, else log once per kind (the line is written)."""
        cls = RECORDS.get(kind)
        if cls is not None and isinstance(details, dict) and misfit(cls, details) is None:
            return  # the common case: a few microseconds
        if cls is None:
            why = "this kind has no record in orchestrator/events (add one: readers skip it)"
        else:  # as the reader sees it: a tuple is a list, a numpy float a float, ...
            decoded = json.loads(line)["details"]
            wrong = misfit(cls, decoded) if isinstance(decoded, dict) else "not an object"
            if wrong is None:
                return
            why = f"its details do not fit the record {cls.__name__}: {wrong}"
            why += f" (given: {details!r:.200})"
        message = f"rank {self.rank}: journal event {kind!r} at step {step}: {why}"
        if self.strict:
            raise EventMisfit(f"{message}; fix the writer or the record")
        if kind not in _MISFITS_SAID:
            _MISFITS_SAID.add(kind)
            logger.error(
                "%s; written anyway (readers skip it as %s); a bug: please report it",
                message,
                "unknown" if cls is None else "damaged",
            )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drain(-1)
            if self._pending or self._dropped:
                logger.error(
                    "rank %d: %d journal event(s) could not be written to %s and are lost",
                    self.rank,
                    len(self._pending) + self._dropped,
                    self.path,
                )
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _open(self) -> bool:
        if self._fd < 0:
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as err:
                self._failing(err, -1)
                return False
        return True

    def _drain(self, step: int) -> None:
        """Write the pending lines, oldest first, one ``write`` each (whole lines from the
        processes of one host); stop at the first failure. Called with the lock held."""
        if not self._open():
            return
        while self._pending:
            data = (b"\n" if self._torn else b"") + self._pending[0]
            try:
                n = os.write(self._fd, data)
            except OSError as err:
                self._failing(err, step)
                return
            if n < len(data):  # the disk filled mid-line: readers skip the part written
                self._torn = True
                self._failing(OSError(errno.ENOSPC, "No space left on device (short write)"), step)
                return
            self._torn = False
            self._pending_bytes -= len(self._pending.popleft())
            if not self._pending and self._failed is not None:  # writes work again
                since, since_step, error = self._failed
                self._failed = None
                logger.warning("rank %d: the journal %s is written again", self.rank, self.path)
                details = {"error": error, "since": since, "since_step": since_step,
                           "seconds": round(time.time() - since, 3), "lost": self._dropped,
                           "path": self.path}  # fmt: skip
                self._dropped = 0
                self._queue(self._line(EVENT_JOURNAL_FAILED, step, details))

    def _queue(self, line: bytes) -> None:
        self._pending.append(line)
        self._pending_bytes += len(line)

    def _failing(self, err: OSError, step: int) -> None:
        while self._pending_bytes > MAX_PENDING_BYTES and len(self._pending) > 1:
            self._pending_bytes -= len(self._pending.popleft())
            self._dropped += 1
        if self._failed is None:
            self._failed = (time.time(), step, repr(err))
            # Cannot be journaled: said once here, on stderr, and the run goes on.
            logger.error(
                "rank %d: the journal %s cannot be written (%s); its events wait in memory "
                "(up to %d MiB) and are written when it can be again; training goes on: "
                "check the run directory's disk",
                self.rank,
                self.path,
                err,
                MAX_PENDING_BYTES >> 20,
            )

    def _line(self, kind: str, step: int, details: dict[str, Any]) -> bytes:
        event = {"time": time.time(), "kind": kind, "step": step, "rank": self.rank,
                 "attempt": self.attempt, "details": details}  # fmt: skip
        return (json.dumps(event, default=str) + "\n").encode()


def _int(step: Any) -> int:
    """A step as an int (numpy and torch integers too); -1 when it is none."""
    try:
        return int(step)
    except (TypeError, ValueError):
        return -1


def journal_files(run_dir: str) -> list[str]:
    """Every node's journal file (and the single file of older run directories)."""
    legacy = os.path.join(run_dir, JOURNAL_NAME)
    nodes = sorted(glob.glob(os.path.join(glob.escape(run_dir), JOURNAL_DIR, "*.jsonl")))
    return ([legacy] if os.path.exists(legacy) else []) + nodes


def _lines(run_dir: str) -> Iterator[tuple[Any, str]]:
    """Every non-blank line of every node's journal, parsed as JSON (None where it is not),
    with where it is (``file:line``)."""
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
                    obj = json.loads(line)
                except (ValueError, RecursionError):
                    obj = None
                yield obj, f"{os.path.relpath(path, run_dir)}:{n}"


def load_journal(run_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(every node's events merged by time, the ``file:line`` of lines skipped as damaged).
    A crash or a full disk mid-write leaves a torn line, and anything else can land in a
    file: a line that is not an event of the journal's shape (JSON, an object with a
    ``kind``, a finite ``time``, integer ``step``/``rank``/``attempt`` and ``details`` an
    object), or whose details do not fit its kind's record (:mod:`orchestrator.events`), is
    skipped, never fatal, so every reader can rely on those fields. Events of kinds the
    protocol does not know are kept here (the typed :func:`read_events` skips them)."""
    events: list[dict[str, Any]] = []
    damaged: list[str] = []
    for obj, where in _lines(run_dir):
        if parse(obj) == DAMAGED:
            damaged.append(where)
        else:
            events.append(obj)
    # Stable: events of one node with equal times keep their order in its file.
    events.sort(key=lambda e: float(e["time"]))
    return events, damaged


def read_events(run_dir: str) -> EventLog:
    """Every node's events as the protocol's typed :class:`~orchestrator.events.Event`,
    merged by time; damaged lines and kinds the protocol does not know are skipped and
    counted in the returned :class:`~orchestrator.events.EventLog`."""
    log = EventLog()
    for obj, where in _lines(run_dir):
        log.add(obj, where)
    log.events.sort(key=lambda e: e.time)
    return log


def read_journal(run_dir: str) -> Iterator[dict[str, Any]]:
    """Yield every node's events, merged by time; damaged lines are skipped (see
    :func:`load_journal`)."""
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
    """:func:`orchestrator.events.quarantine_share` of events given as the journal's dicts
    (those that do not fit the protocol are left out)."""
    return events_quarantine_share(typed(events).events)


class Decisions:
    """Journals a collective decision once: by rank 0 of the Guard's group (``writer``),
    with the evidence of every rank in its details."""

    def __init__(self, journal: Journal, writer: bool) -> None:
        self.journal, self.writer = journal, writer

    def __call__(self, kind: str, step: int, **details: Any) -> None:
        if self.writer:
            self.journal.write(kind, step, details)

    def emit(self, step: int, record: Record, *, skip_none: bool = False, **extra: Any) -> None:
        """:meth:`Journal.emit`, by the writer only."""
        if self.writer:
            self.journal.emit(step, record, skip_none=skip_none, **extra)


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """Every row of RUN_DIR/metrics.jsonl: an object with an integer ``step`` (a torn or
    damaged line is skipped)."""
    path = os.path.join(run_dir, METRICS_NAME)
    rows = []
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append(row)
    return rows
