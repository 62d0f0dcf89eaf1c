"""The goodput ledger: a run's wall time split into productive training and each kind of
loss, from its journal (every node's) and rank 0's metrics. Torch-free: the supervisor,
``orchestrator status`` and ``report`` compute it.

The wall time is that of the supervisor's sessions (from a job's first attempt to its
supervisor's exit; a requeued job adds its own session, the time it waited in the queue
does not count), or, without a supervisor, from a run's start to its end. Each attempt's
interval is cut at its first completed step and at its last progress:

- ``startup``: a job's start to its first completed step (process start, initialization,
  the pre-flight checks, a resume), and its last step to its exit (the final snapshot).
- ``restart``: a failed attempt's end of progress to the next attempt's first completed
  step (teardown, backoff, process start, resume).
- ``hang``: a hung attempt's last progress to its end (the hang timeout, the stacks, the
  kill).
- ``preemption``: a stop request (its signal) to the end of the attempt it stopped.
- ``lost``: work of a failed attempt that the next one does again: from the completion of
  the step it resumes from to the failed attempt's last progress.
- ``replayed``: work a rollback threw away: from the completion of the step rolled back to
  until the incident.
- ``incident``: handling incidents (the check that found it, isolation re-runs, forensics,
  health checks, the rollback).
- ``snapshot``: the training loop's stall for in-memory snapshots.
- ``check``: the finite check (its all-reduce and host sync) of every step.
- ``persist``: steps slower while a durable write is in flight than the attempt's median
  step without one (the background writer's interference).
- ``productive``: the rest, training steps kept in the final state.

The parts add up to the wall time; goodput is productive / wall. Work inside ``lost`` and
``replayed`` spans is counted once: the stalls and checks in them are counted as what they
are, the rest of the span as lost.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

KINDS = (
    "productive",
    "startup",
    "restart",
    "hang",
    "preemption",
    "lost",
    "replayed",
    "incident",
    "snapshot",
    "check",
    "persist",
)
_FAILED = ("crash", "hang", "unhealthy", "preempted", "gave_up")


@dataclass
class Ledger:
    wall_s: float = 0.0
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))

    @property
    def goodput(self) -> float | None:
        return self.parts["productive"] / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "goodput": None if self.goodput is None else round(self.goodput, 4),
            "parts": {k: round(v, 3) for k, v in self.parts.items()},
        }


@dataclass
class _Attempt:
    number: int
    start: float
    end: float
    outcome: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # the ranks' (rank >= 0)
    stop_at: float | None = None  # a stop request's signal


def ledger(events: Iterable[dict[str, Any]], rows: Iterable[dict[str, Any]]) -> Ledger:
    """The goodput ledger of a run directory's journal ``events`` (merged by time) and its
    metrics ``rows`` (``orchestrator.metrics.read_metrics``)."""
    events = sorted(events, key=lambda e: float(e["time"]))
    out = Ledger()
    for session in _sessions(events, list(rows)):
        _account(session, out)
    return out


def _sessions(events: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[list[_Attempt]]:
    """The run's sessions, each a list of attempts in order: a supervisor's (from its
    attempt_start and attempt_end events, the earliest start and latest end over nodes),
    or a run's without one (run_start to its last event)."""
    by_attempt: dict[int, _Attempt] = {}
    sessions: list[list[_Attempt]] = []
    current: list[_Attempt] = []
    supervised = any(e["kind"] == "attempt_start" for e in events)
    for e in events:
        a, t, kind = int(e.get("attempt", 0)), float(e["time"]), e["kind"]
        if supervised:
            if kind == "attempt_start":
                att = by_attempt.get(a)
                if att is None or att not in current:
                    if current and current[-1].end < t and _ended(events, current[-1]):
                        sessions.append(current)
                        current = []
                    att = by_attempt[a] = _Attempt(a, t, t)
                    current.append(att)
                att.start = min(att.start, t)
            elif kind == "attempt_end" and a in by_attempt:
                att = by_attempt[a]
                att.end = max(att.end, t)
                att.outcome = att.outcome or e["details"].get("outcome")
            elif kind == "stop_requested" and a in by_attempt:
                at = float(e["details"].get("signal_time", t))
                cur = by_attempt[a].stop_at
                by_attempt[a].stop_at = at if cur is None else min(cur, at)
            elif int(e.get("rank", -1)) >= 0 and a in by_attempt:
                by_attempt[a].events.append(e)
        else:
            if kind == "run_start" and int(e.get("rank", 0)) == 0:
                if current:
                    sessions.append(current)
                current = [_Attempt(a, t, t)]
                by_attempt[a] = current[0]
            elif current and int(e.get("rank", -1)) >= 0:
                current[-1].events.append(e)
                current[-1].end = max(current[-1].end, t)
                if kind == "preempting":
                    current[-1].outcome = "preempted"
    if current:
        sessions.append(current)
    for r in rows:
        att = by_attempt.get(int(r.get("attempt", 0)))
        if att is not None and att.start <= float(r["time"]) <= att.end + 1.0:
            att.rows.append(r)
            att.end = max(att.end, float(r["time"])) if not supervised else att.end
    for s in sessions:
        for att in s:
            att.rows.sort(key=lambda r: float(r["time"]))
    return sessions


def _ended(events: list[dict[str, Any]], att: _Attempt) -> bool:
    """Whether a supervisor exited after ``att`` (so the next attempt_start is a new job)."""
    return any(
        e["kind"] == "supervisor_exit" and int(e.get("attempt", -1)) == att.number for e in events
    )


def _anchor(att: _Attempt, step: int) -> float | None:
    """When ``att`` had completed ``step`` steps: the capture of a snapshot of that step (or
    the row of the step before it)."""
    caps = [float(e["time"]) for e in att.events if e["kind"] == "snapshot" and e["step"] == step]
    if caps:
        return min(caps)
    done = [float(r["time"]) for r in att.rows if int(r["step"]) == step - 1]
    return min(done) if done else None


def _account(session: list[_Attempt], out: Ledger) -> None:
    p = out.parts
    out.wall_s += session[-1].end - session[0].start
    prev_end: float | None = None
    for i, att in enumerate(session):
        nxt = session[i + 1] if i + 1 < len(session) else None
        first = float(att.rows[0]["time"]) if att.rows else None
        progress = max(
            [float(r["time"]) for r in att.rows]
            + [float(e["time"]) for e in att.events if e["kind"] not in ("run_end",)],
            default=att.start,
        )
        if att.stop_at is not None:
            progress = min(progress, max(att.stop_at, first or att.start))
        progress = min(max(progress, first or att.start), att.end)
        head = (first if first is not None else progress) - att.start
        if i == 0:
            p["startup"] += head
        else:
            p["restart"] += head + (att.start - prev_end if prev_end is not None else 0.0)
        prev_end = att.end
        tail = att.end - progress
        if att.stop_at is not None:
            p["preemption"] += tail
        elif att.outcome == "hang":
            p["hang"] += tail
        elif att.outcome in _FAILED or (nxt is not None and att.outcome != "ok"):
            p["restart"] += tail
        else:
            p["startup"] += tail  # the final snapshot and the exit
        if first is None:
            continue
        train = progress - first
        overhead = _overheads(att, first, progress)
        for kind, seconds in overhead.items():
            p[kind] += seconds
        wasted = _wasted(att, nxt, first, progress)
        for kind, (span, inner) in wasted.items():
            p[kind] += max(0.0, span - inner)
        used = sum(overhead.values()) + sum(max(0.0, s - i) for s, i in wasted.values())
        p["productive"] += max(0.0, train - used)


def _overheads(att: _Attempt, start: float, end: float) -> dict[str, float]:
    """Incident handling, snapshot stalls, checks and write interference within
    [start, end] of the attempt."""
    out: dict[str, float] = defaultdict(float)
    for e in att.events:
        t = float(e["time"])
        if not start <= t <= end:
            continue
        if e["kind"] == "snapshot":
            out["snapshot"] += float(e["details"].get("stall_ms", 0.0)) / 1000
        elif e["kind"] == "recovered":
            inc = e["details"].get("incident", {})
            began = float(inc.get("started_at", t))
            out["incident"] += t - max(began, start)
    rows = [r for r in att.rows if start <= float(r["time"]) <= end]
    out["check"] += sum(float(r.get("check_s") or 0.0) for r in rows)
    idle = [float(r["step_s"]) for r in rows if r.get("step_s") and not r.get("writing")]
    if idle:
        base = statistics.median(idle)
        out["persist"] += sum(
            max(0.0, float(r["step_s"]) - base)
            for r in rows
            if r.get("step_s") and r.get("writing")
        )
    return dict(out)


def _wasted(
    att: _Attempt, nxt: _Attempt | None, start: float, end: float
) -> dict[str, tuple[float, float]]:
    """(span, overheads inside it) of the work thrown away: by rollbacks (``replayed``) and
    by the attempt's end when the next attempt resumes from an earlier step (``lost``)."""
    out: dict[str, tuple[float, float]] = {}
    replayed = inner = 0.0
    for e in att.events:
        if e["kind"] != "recovered":
            continue
        inc = e["details"].get("incident", {})
        began = float(inc.get("started_at", e["time"]))
        back = [
            r for r in att.events
            if r["kind"] == "rollback" and abs(float(r["time"]) - float(e["time"])) < 3600
            and float(r["time"]) <= float(e["time"]) and float(r["time"]) >= began
        ]  # fmt: skip
        if not back:
            continue
        to = int(back[-1]["details"]["to_step"])
        anchors = [
            float(x["time"]) for x in att.events
            if x["kind"] == "snapshot" and x["step"] == to and float(x["time"]) <= began
        ]  # fmt: skip
        t0 = max(anchors) if anchors else None
        if t0 is None or t0 < start:
            continue
        replayed += began - t0
        inner += sum(_overheads(att, t0, began).values())
    if replayed:
        out["replayed"] = (replayed, inner)
    if nxt is not None and att.outcome != "ok":
        resumes = [e for e in nxt.events if e["kind"] == "resume"]
        step = int(resumes[0]["details"]["snapshot_step"]) if resumes else 0
        t0 = _anchor(att, step) if resumes else start
        t0 = start if t0 is None else min(max(t0, start), end)
        out["lost"] = (end - t0, sum(_overheads(att, t0, end).values()))
    return out
