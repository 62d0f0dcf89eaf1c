"""The goodput ledger: a run's wall time split into productive training and each kind of
loss, from its journal (every node's) and rank 0's metrics. Torch-free: the supervisor
(its Prometheus endpoint), ``orchestrator status`` and ``report`` compute it.

The wall time is that of the supervisor's sessions (from a job's first attempt to its
supervisor's exit; a requeued job adds its own session, the time it waited in the queue
does not count), or, without a supervisor, from a run's start to its end. Each attempt's
interval is cut at its first completed step and at its last progress:

- ``startup``: a job's start to its first completed step (process start, initialization,
  the pre-flight checks, a resume), and its last step to its exit (the final snapshot).
- ``restart``: a failed attempt's last progress to the next attempt's first completed step
  (teardown, backoff, process start, resume).
- ``hang``: a hung attempt's last progress to its end (the hang timeout, the stacks, the
  kill).
- ``preemption``: a stop request (its signal) to the end of the attempt it stopped.
- ``inplace``: a dead rank replaced alone (issue 33): its fault to the first step after.
- ``lost``: work done again: a failed attempt's, from the completion of the step the next
  one resumes from to its last progress; an in-place recovery's, from that of the step the
  ranks resumed from to the fault (orchestrator/goodput_inplace.py).
- ``replayed``: work a rollback threw away: from the completion of the step rolled back to
  until the incident.
- ``incident``: handling incidents (the check that found it, isolation re-runs, forensics,
  health checks, the rollback).
- ``snapshot``: the training loop's stall for in-memory snapshots.
- ``check``: the finite check (its all-reduce and host sync) of every step.
- ``persist``: steps slower while a durable write is in flight than the attempt's median
  step without one (the background writer's interference).
- ``productive``: the rest: training steps kept in the final state.

The parts add up to the wall time; goodput is productive / wall. The stalls and checks
inside a ``lost`` or ``replayed`` span count as what they are, the rest of the span as lost.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from orchestrator.events import (
    AttemptEnd,
    Event,
    Recovered,
    Resume,
    Rollback,
    RunEnd,
    SnapshotTaken,
    StopRequested,
    typed,
)
from orchestrator.goodput_inplace import recoveries
from orchestrator.goodput_rows import Rows as Rows  # launch/exporter.py keeps them
from orchestrator.journal import read_events, read_metrics

# The events the ledger reads: the journal's (the protocol's typed events), or their dicts
# (each checked against the protocol; one that does not fit it is left out).
Events = Iterable[Event[Any] | Mapping[str, Any]]

# kind -> what it is, in a few words (report.md's table); the module docstring has more.
KINDS = {
    "productive": "training steps kept in the final state",
    "startup": "job start to its first step, last step to exit",
    "restart": "failed attempt's last progress to the next one's first step",
    "hang": "a hung attempt's last progress to its kill",
    "inplace": "a dead rank replaced alone: its fault to the next step",
    "preemption": "stop request to the end of the attempt",
    "lost": "steps a failed attempt did that the next one redid",
    "replayed": "steps a rollback threw away",
    "incident": "isolation, forensics, health checks, the rollback",
    "snapshot": "in-memory snapshot stalls",
    "check": "the per-step finite check",
    "persist": "steps slowed by a durable write in flight",
}


@dataclass
class Ledger:
    wall_s: float = 0.0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    # (kind, attempt) -> seconds: where each part was spent (a restart, a lost span and a
    # hang belong to the attempt they ended or wasted)
    by_attempt: dict[tuple[str, int], float] = field(default_factory=dict)

    def add(self, kind: str, attempt: int, seconds: float) -> None:
        self.parts[kind] += seconds
        key = (kind, attempt)
        self.by_attempt[key] = self.by_attempt.get(key, 0.0) + seconds

    @property
    def goodput(self) -> float | None:
        return self.parts["productive"] / self.wall_s if self.wall_s > 0 else None


@dataclass
class _Attempt:
    number: int
    start: float
    end: float
    outcome: str | None = None
    rows: Rows = field(default_factory=Rows)
    events: list[Event[Any]] = field(default_factory=list)  # the ranks' (rank >= 0)
    stop_at: float | None = None  # a stop request's signal
    progress: float | None = None  # the ranks' last progress, as the supervisor saw it
    _base: float | None = None  # median step time without a durable write in flight
    _ix: _Index | None = None

    def index(self) -> _Index:
        """The events the ledger looks up, indexed once (a long run has 1e5 of them)."""
        if self._ix is None:
            self._ix = _Index(self.events)
        return self._ix

    def base(self) -> float:
        if self._base is None:
            rows = self.rows
            idle = [s for s, w in zip(rows.step_s, rows.writing, strict=True) if w == 0 and s == s]
            self._base = statistics.median(idle) if idle else math.inf
        return self._base


class _Index:
    """One attempt's events (in time order) as the ledger looks them up: snapshot stalls
    as prefix sums, captures by step, incidents and rollbacks in time order."""

    def __init__(self, events: list[Event[Any]]) -> None:
        self.snap_t: list[float] = []
        self.stall_sum = [0.0]  # stall_sum[i]: the stalls of the first i snapshots
        self.captured: dict[int, list[float]] = {}  # step -> capture times
        self.recovered: list[tuple[float, float]] = []  # (time, incident began)
        self.rollback_t: list[float] = []
        self.rollback_to: list[int] = []
        self.inplace = recoveries(events)
        for e in events:
            t, r = e.time, e.record
            if isinstance(r, SnapshotTaken):
                self.snap_t.append(t)
                self.stall_sum.append(self.stall_sum[-1] + r.stall_ms / 1000)
                self.captured.setdefault(e.step, []).append(t)
            elif isinstance(r, Recovered):
                self.recovered.append((t, r.started_at if r.started_at is not None else t))
            elif isinstance(r, Rollback):
                self.rollback_t.append(t)
                self.rollback_to.append(r.to_step)

    def stalls(self, start: float, end: float) -> float:
        i = bisect.bisect_left(self.snap_t, start)
        j = bisect.bisect_right(self.snap_t, end)
        return self.stall_sum[j] - self.stall_sum[i] if j > i else 0.0

    def last_rollback(self, start: float, end: float) -> int | None:
        """The target step of the last rollback within [start, end]."""
        j = bisect.bisect_right(self.rollback_t, end)
        return self.rollback_to[j - 1] if j and self.rollback_t[j - 1] >= start else None


def ledger(events: Events, rows: Iterable[dict[str, Any]], now: float | None = None) -> Ledger:
    """The goodput ledger of a run directory's journal ``events`` and its metrics ``rows``
    (``orchestrator.journal.read_metrics``); ``now``: see :func:`ledger_of`."""
    by_attempt: dict[int, Rows] = {}
    timed = [r for r in rows if isinstance(r.get("time"), int | float)]  # older rows: no time
    for row in sorted(timed, key=lambda r: float(r["time"])):
        by_attempt.setdefault(int(row.get("attempt", 0)), Rows()).add(row)
    return ledger_of(events, by_attempt, now)


def ledger_of(events: Events, rows: dict[int, Rows], now: float | None = None) -> Ledger:
    """:func:`ledger`, the metrics rows already kept per attempt number (in time order),
    as a process that follows a run keeps them (launch/exporter.py). ``now``: the run is
    live, its attempt still running counts until then."""
    sessions = _sessions(typed(events).events)  # in time order
    flat = [att for session in sessions for att in session]
    for att in flat:
        if att.number in rows:
            last = rows[att.number].times[-1:] if att.outcome is None else []
            att.end = max([att.end, *last, *([now] if now and att.outcome is None else [])])
            att.rows = rows[att.number].window(att.start - 1.0, att.end + 1.0)
        elif now is not None and att.outcome is None:
            att.end = max(att.end, now)
    out = Ledger()
    for session in sessions:
        out.wall_s += session[-1].end - session[0].start
        for i, att in enumerate(session):
            k = flat.index(att)
            _account(
                att,
                first_of_job=i == 0,
                prev_end=session[i - 1].end if i > 0 else None,
                nxt=flat[k + 1] if k + 1 < len(flat) else None,  # a requeued job's too
                out=out,
            )
    return out


def run_ledger(run_dir: str) -> Ledger:
    """The ledger of a run directory, its files read once."""
    return ledger(read_events(run_dir).events, read_metrics(run_dir))


def _sessions(events: list[Event[Any]]) -> list[list[_Attempt]]:
    """The run's sessions, each a list of attempts in order: a supervisor's (from its
    attempt_start and attempt_end events, the earliest start and latest end over nodes),
    or a run's without one (run_start to its last event)."""
    exited = {e.attempt for e in events if e.kind == "supervisor_exit"}
    by_attempt: dict[int, _Attempt] = {}
    sessions: list[list[_Attempt]] = []
    current: list[_Attempt] = []
    supervised = any(e.kind == "attempt_start" for e in events)
    for e in events:
        a, t, kind, r = e.attempt, e.time, e.kind, e.record
        if supervised:
            att = by_attempt.get(a)
            if kind == "attempt_start":
                if att is None or att not in current:
                    if current and current[-1].number in exited and current[-1].end < t:
                        sessions.append(current)  # a new job on the same run directory
                        current = []
                    att = by_attempt[a] = _Attempt(a, t, t)
                    current.append(att)
                att.start = min(att.start, t)
            elif att is None:
                continue
            elif isinstance(r, AttemptEnd):
                # When its processes were gone (the event comes after the supervisor's
                # bookkeeping), on any node.
                att.end = max(att.end, r.ended_at or t)
                att.outcome = att.outcome or r.outcome
                if r.progress_time is not None:
                    att.progress = max(att.progress or 0.0, r.progress_time)
            elif isinstance(r, StopRequested):
                at = r.signal_time if r.signal_time is not None else t
                att.stop_at = at if att.stop_at is None else min(att.stop_at, at)
            elif e.rank >= 0:
                att.events.append(e)
        else:
            if kind == "run_start" and e.rank == 0:
                if current:
                    sessions.append(current)
                current = [_Attempt(a, t, t)]
            elif current and e.rank >= 0:
                att = current[-1]
                att.events.append(e)
                att.end = max(att.end, t)
                if kind == "preempting":
                    att.outcome = "preempted"
                elif isinstance(r, RunEnd) and att.outcome is None:
                    att.outcome = "ok" if r.status == "finished" else "stopped"
    if current:
        sessions.append(current)
    return sessions


def _anchor(att: _Attempt, step: int) -> float | None:
    """When ``att`` had completed ``step`` steps: the capture of a snapshot of that step (or
    the row of the step before it)."""
    caps = att.index().captured.get(step, [])
    if caps:
        return min(caps)
    done = [t for t, s in zip(att.rows.times, att.rows.steps, strict=True) if s == step - 1]
    return min(done) if done else None


def _account(
    att: _Attempt, first_of_job: bool, prev_end: float | None, nxt: _Attempt | None, out: Ledger
) -> None:
    a = att.number
    # The first completed step: its row, or the event the Guard journals right after it (a
    # process killed within metrics.flush_s of it lost its rows).
    firsts = list(att.rows.times[:1])
    firsts += [e.time for e in att.events if e.kind == "first_step"]
    first = min(firsts) if firsts else None
    progress = max(
        list(att.rows.times[-1:])
        + [e.time for e in att.events if _progress(e.kind)]
        + ([att.progress] if att.progress is not None else []),
        default=att.start,
    )
    stop_at = att.stop_at
    if stop_at is None:  # a stop request without the supervisor's word: the Guard's
        stops = [e.time for e in att.events if e.kind == "preempting"]
        stop_at = min(stops) if stops else None
    if stop_at is not None:
        progress = min(progress, max(stop_at, first or att.start))
    progress = min(max(progress, first or att.start), att.end)
    head = (first if first is not None else progress) - att.start
    if first_of_job:
        out.add("startup", a, head)
    else:
        out.add("restart", a, head + (att.start - prev_end if prev_end is not None else 0.0))
    tail = att.end - progress
    if stop_at is not None:
        out.add("preemption", a, tail)
    elif att.outcome == "hang":
        out.add("hang", a, tail)
    elif att.outcome in ("ok", "stopped"):
        out.add("startup", a, tail)  # the final snapshot and the exit
    else:
        out.add("restart", a, tail)  # a crash: its teardown
    if first is None:
        return
    overhead = _overheads(att, first, progress)
    wasted = _wasted(att, nxt, first, progress)
    for kind, seconds in overhead.items():
        out.add(kind, a, seconds)
    for kind, (span, inner) in wasted.items():
        out.add(kind, a, max(0.0, span - inner))
    used = sum(overhead.values()) + sum(max(0.0, s - i) for s, i in wasted.values())
    out.add("productive", a, max(0.0, progress - first - used))


def _progress(kind: str) -> bool:
    """Whether an event says the training loop moved: not the background writer's (a write
    may commit after its rank's peer crashed), nor the end's."""
    if kind.startswith(("persist", "ledger_")):
        return kind == "persist_skipped"  # decided in the step
    return kind not in ("run_end", "heartbeat_failed")


def _overheads(att: _Attempt, start: float, end: float) -> dict[str, float]:
    """Incident handling, snapshot stalls, checks and write interference within
    [start, end] of the attempt."""
    ix = att.index()
    incident = sum(t - max(began, start) for t, began in ix.recovered if start <= t <= end)
    out = {"incident": incident, "snapshot": ix.stalls(start, end), "check": 0.0, "persist": 0.0}
    out["inplace"] = sum(max(0.0, min(r.first_step, end) - max(r.fault, start)) for r in ix.inplace)
    rows, base = att.rows, att.base()
    for i in rows.span(start, end):
        out["check"] += rows.check[i]
        if rows.writing[i] and rows.step_s[i] == rows.step_s[i]:
            # step_s is the mean over the steps since the previous row (metrics.every_steps)
            n = rows.steps[i] - rows.steps[i - 1] if i else 1
            out["persist"] += max(0.0, rows.step_s[i] - base) * (n if n > 0 else 1)
    return out


def _wasted(
    att: _Attempt, nxt: _Attempt | None, start: float, end: float
) -> dict[str, tuple[float, float]]:
    """(span, overheads inside it) of the work thrown away: by rollbacks (``replayed``) and
    by the attempt's end when the next attempt resumes from an earlier step (``lost``)."""
    out: dict[str, tuple[float, float]] = {}
    replayed = inner = 0.0
    spans: list[tuple[float, float]] = []  # the replayed spans, counted once
    ix = att.index()
    for t, began in ix.recovered:
        to = ix.last_rollback(began, t)
        if to is None:
            continue
        anchors = [x for x in ix.captured.get(to, []) if x <= began]
        if not anchors or max(anchors) < start:
            continue
        t0 = max(anchors)
        replayed += began - t0
        inner += sum(_overheads(att, t0, began).values())
        spans.append((t0, began))
    if replayed:
        out["replayed"] = (replayed, inner)
    redone = [(r.fault - r.redone_s, r.fault) for r in ix.inplace if r.redone_s is not None]
    redone = [(max(a, start), min(b, end)) for a, b in redone if min(b, end) > max(a, start)]
    spans += redone  # not counted again in a later full restart's lost span
    if redone:  # an in-place recovery's: the steps since the one the ranks resumed from
        out["lost"] = (
            sum(b - a for a, b in redone),
            sum(sum(_overheads(att, a, b).values()) for a, b in redone),
        )
    if nxt is not None and att.outcome not in ("ok", "stopped"):
        resumes = [e.record for e in nxt.events if isinstance(e.record, Resume)]
        at = _anchor(att, resumes[0].snapshot_step) if resumes else start
        t0 = start if at is None else min(max(at, start), end)
        span, overheads = end - t0, sum(_overheads(att, t0, end).values())
        # A resume from before a rollback's target: the replayed span inside is counted
        # (with its overheads) as replayed already (an in-place recovery's as lost).
        for a, b in spans:
            lo, hi = max(a, t0), min(b, end)
            if hi > lo:
                span -= hi - lo
                overheads -= sum(_overheads(att, lo, hi).values())
        was = out.get("lost", (0.0, 0.0))
        out["lost"] = (was[0] + span, was[1] + max(0.0, overheads))
    return out
