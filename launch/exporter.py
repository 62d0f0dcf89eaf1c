"""The supervisor's Prometheus endpoint (``export.prometheus_port``): what a cluster's
dashboards and alert rules read, under the ``orchestrator_`` prefix.

Everything is computed at scrape time from the run directory, which the supervisor follows
as it grows (each journal file and the metrics from where the last scrape stopped), so no
thread of ours runs between scrapes and nothing is kept twice:

- counters (``_total``): incidents, rollbacks, restarts (job-wide, each attempt once),
  in-place recoveries (a dead rank replaced alone) and their seconds (fault to next
  step), hangs, quarantined samples, alerts;
- gauges: the step (where the ranks are), the attempt, the goodput and its parts
  (``orchestrator_time_seconds{kind=...}``, recomputed as the run moves on, at most every
  ``GOODPUT_MIN_S``),
  the age of the newest snapshot of each tier (memory, shm, durable), the last step's time;
  the ledger counts the attempt still running until the scrape.

Every series has a ``node`` label (each node's supervisor serves the job-wide figures).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from orchestrator.events import (
    AttemptStart,
    Event,
    Flush,
    Hang,
    Persist,
    Restart,
    SnapshotTaken,
    first_each_attempt,
    parse_line,
    quarantine_share,
)
from orchestrator.goodput import KINDS, Ledger, Rows, ledger_of
from orchestrator.goodput_inplace import summary
from orchestrator.heartbeat import read_heartbeats
from orchestrator.journal import journal_files
from orchestrator.protocol import METRICS_NAME

GOODPUT_EVERY_S = 30.0  # the ledger of a run that moves on is recomputed at most this late
GOODPUT_MIN_S = 2.0  # ...and at most this often


class _Tail:
    """The complete lines appended to a file since the last call."""

    def __init__(self, path: str) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *whole, self.partial = data.split(b"\n")
        return [ln.decode("utf-8", errors="replace") for ln in whole if ln.strip()]


class RunFollower:
    """A run directory read as it grows: its events (every node's journal) and rank 0's
    metrics rows, per attempt."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.events: list[Event[Any]] = []
        self.skipped = 0  # journal lines damaged, or of kinds this version does not know
        self.rows: dict[int, Rows] = {}
        self.last_row: dict[str, Any] | None = None
        self._tails: dict[str, _Tail] = {}
        self._metrics = _Tail(os.path.join(run_dir, METRICS_NAME))

    def update(self) -> None:
        for path in journal_files(self.run_dir):
            tail = self._tails.setdefault(path, _Tail(path))
            for line in tail.lines():
                e = parse_line(line)
                if isinstance(e, Event):
                    self.events.append(e)
                else:  # torn by a crash mid-write, not ours, or a newer version's kind
                    self.skipped += 1
        for line in self._metrics.lines():
            row = _record(line, ("time", float), ("step", int), ("attempt", int))
            if row is None:
                continue
            try:  # a row that is kept must not half-fill the arrays
                self.rows.setdefault(row["attempt"], Rows()).add(row)
            except (TypeError, ValueError):
                continue
            self.last_row = row


def _record(line: str, *fields: tuple[str, type]) -> dict[str, Any] | None:
    """``line`` as a JSON object whose ``fields`` have their types (None if not): a record
    the follower keeps is one every later computation can read."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    if "attempt" not in doc:
        doc["attempt"] = 0
    for name, kind in fields:
        value = doc.get(name)
        ok = isinstance(value, (int, float)) if kind is float else isinstance(value, kind)
        if not ok or isinstance(value, bool):
            return None
    return doc


class Exporter:
    """Serves ``orchestrator_*`` metrics of ``run_dir`` on ``port`` (0: a free one)."""

    def __init__(self, run_dir: str, node: str, port: int, addr: str) -> None:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError as err:
            raise RuntimeError(
                "export.prometheus_port is set but prometheus-client is not installed: "
                "pip install prometheus-client (or the [metrics] extra), or set "
                "export.prometheus_port: null"
            ) from err
        self.run, self.node = RunFollower(run_dir), node
        self._lock = threading.Lock()
        self._ledger: tuple[float, tuple[int, int], Ledger] | None = None
        registry = CollectorRegistry()
        registry.register(self)  # a collector: it has collect()
        self.server, self._thread = start_http_server(port, addr, registry=registry)
        self.port = int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _goodput(self) -> Ledger:
        """The ledger, recomputed when the run moved on (at most every few seconds), and at
        least every GOODPUT_EVERY_S while it runs."""
        now = time.monotonic()
        size = (len(self.run.events), sum(len(r) for r in self.run.rows.values()))
        if self._ledger is not None:
            at, seen, led = self._ledger
            fresh = now - at < GOODPUT_MIN_S or (size == seen and now - at < GOODPUT_EVERY_S)
            if fresh:
                return led
        led = ledger_of(self.run.events, self.run.rows, now=time.time())
        self._ledger = (now, size, led)
        return led

    def _step(self) -> int:
        """The newest step of this node's ranks (their heartbeats) and of rank 0's metrics:
        every node's heartbeats, read at every scrape of every node's endpoint, were
        N x N x ranks opens a scrape interval (docs/scale.md)."""
        beats = read_heartbeats(self.run.run_dir, self.node)
        row = self.run.last_row
        steps = [int(b["step"]) for b in beats] + ([int(row["step"])] if row else [])
        return max(steps, default=0)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self._lock:
            self.run.update()
            events = self.run.events
            node = [self.node]

            def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
                c = CounterMetricFamily(f"orchestrator_{name}", doc, labels=["node"])
                c.add_metric(node, value)
                return c

            def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
                g = GaugeMetricFamily(f"orchestrator_{name}", doc, labels=["node"])
                g.add_metric(node, value)
                return g

            count: dict[str, int] = {}
            for e in events:
                count[e.kind] = count.get(e.kind, 0) + 1
            share = quarantine_share(events)  # as status and report count them
            quarantined = share[0] if share else 0
            yield counter("incidents", "Incidents (bad steps) so far.", count.get("incident", 0))
            yield counter("rollbacks", "Rollbacks so far.", count.get("rollback", 0))
            restarts = len(first_each_attempt(events, Restart))
            hangs = len(first_each_attempt(events, Hang))
            yield counter("restarts", "Restarts of the job so far.", restarts)
            yield from _inplace(events, node)
            yield counter("hangs", "Hangs detected so far.", hangs)
            yield counter("quarantined_samples", "Samples quarantined so far.", quarantined)
            yield counter("alerts", "Alerts sent so far.", count.get("alert", 0))
            attempts = [e.attempt for e in events if isinstance(e.record, AttemptStart)]
            yield gauge("attempt", "The current attempt.", max(attempts, default=0))
            yield gauge("step", "The newest step a rank reached.", self._step())
            row = self.run.last_row
            if row is not None and row.get("step_s") is not None:
                yield gauge("step_seconds", "The last step's time.", float(row["step_s"]))
            ages = GaugeMetricFamily(
                "orchestrator_snapshot_age_seconds",
                "Seconds since the newest snapshot of each tier.",
                labels=["node", "tier"],
            )
            now = time.time()
            for tier, newest in _newest_snapshots(events).items():
                ages.add_metric([self.node, tier], now - newest)
            yield ages
            led = self._goodput()
            if led.goodput is not None:
                yield gauge("goodput", "Productive training time / wall time.", led.goodput)
            parts = GaugeMetricFamily(
                "orchestrator_time_seconds",
                "The run's wall time by kind (the goodput ledger).",
                labels=["node", "kind"],
            )
            for kind in KINDS:
                parts.add_metric([self.node, kind], led.parts[kind])
            yield parts


def _inplace(events: list[Event[Any]], node: list[str]) -> Iterator[Any]:
    """In-place recoveries: not restarts (the survivors kept their processes), counted
    apart with their time (fault to next step)."""
    from prometheus_client.core import CounterMetricFamily  # optional, as in collect

    s = summary(events)
    for name, doc, value in (
        ("inplace_recoveries", "Dead ranks replaced alone.", s["count"]),
        ("inplace_seconds", "In-place recoveries: fault to next step.", s["seconds"]),
    ):
        c = CounterMetricFamily(f"orchestrator_{name}", doc, labels=["node"])
        c.add_metric(node, value)
        yield c


def _newest_snapshots(events: list[Event[Any]]) -> dict[str, float]:
    """When each tier's newest snapshot was taken."""
    out: dict[str, float] = {}
    for e in events:
        tier, r = None, e.record
        if isinstance(r, SnapshotTaken):
            tier = "shm" if r.tier == "shm" else "memory"
        elif isinstance(r, Persist) or (isinstance(r, Flush) and e.details.get("flushed", True)):
            tier = "durable"
        if tier is not None:
            out[tier] = max(out.get(tier, 0.0), e.time)
    return out
