"""The journal's event protocol, typed: one record per event kind with the fields its
``details`` carry, the schema both halves write and read. Torch-free: the supervisor, its
Prometheus endpoint, ``orchestrator status`` and ``report`` read the journal through it.

A journal line is ``{"time", "kind", "step", "rank", "attempt", "details"}`` (one JSON
object, ``orchestrator.journal``). :func:`parse` turns one into an :class:`Event` whose
``record`` is the kind's record, checked field by field: a required field must be there,
a field that is there must have its type (JSON numbers: an ``int`` for a ``float`` is
fine, a ``bool`` is never a number), ``None`` only where the field says ``| None``. A line
that is no event, or whose details do not fit its kind's record, is damaged; a kind this
version does not know is unknown; readers skip both and count them (:class:`EventLog`),
never a traceback. Writers may put more in ``details`` than a record names (evidence for
people); the raw details stay on the event. Fields are optional where older run
directories, or some writers, leave them out, so every old journal still reads.

The kinds' names are the constants of :mod:`orchestrator.protocol` where both halves use
them; ``docs/run-dir.md`` lists every record (:func:`table` writes that list).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic

from orchestrator.events.base import RECORDS, R, Record, build, fields_of, is_a, required, type_name
from orchestrator.events.files import *  # noqa: F403 (the records: one name per kind)
from orchestrator.events.ranks import *  # noqa: F403
from orchestrator.events.ranks import Quarantine, RunEnd
from orchestrator.events.supervisor import *  # noqa: F403


@dataclass(frozen=True)
class Event(Generic[R]):
    """One journal line: its envelope, its kind's typed ``record``, and the raw
    ``details`` (everything the writer put there, named by the record or not)."""

    time: float
    kind: str
    step: int
    rank: int
    attempt: int
    record: R
    details: Mapping[str, Any]

    def wire(self) -> dict[str, Any]:
        """The event as its journal line holds it."""
        return {"time": self.time, "kind": self.kind, "step": self.step, "rank": self.rank,
                "attempt": self.attempt, "details": dict(self.details)}  # fmt: skip


DAMAGED, UNKNOWN = "damaged", "unknown"


def parse(obj: Any) -> Event[Record] | str:
    """``obj`` (a parsed journal line) as an :class:`Event`, or why not: :data:`DAMAGED`
    (not an event of the journal's shape, or details that do not fit its kind's record),
    :data:`UNKNOWN` (a well-formed event of a kind this version does not know)."""
    if not (
        isinstance(obj, dict)
        and isinstance(obj.get("kind"), str)
        and isinstance(obj.get("details"), dict)
        and is_a(obj.get("time"), float)
        and math.isfinite(obj["time"])
        and all(is_a(obj.get(k), int) for k in ("step", "rank", "attempt"))
    ):
        return DAMAGED
    cls = RECORDS.get(obj["kind"])
    if cls is None:
        return UNKNOWN
    record = build(cls, obj["details"])
    if record is None:
        return DAMAGED
    return Event(float(obj["time"]), obj["kind"], obj["step"], obj["rank"], obj["attempt"],
                 record, obj["details"])  # fmt: skip


def parse_line(line: str | bytes) -> Event[Record] | str:
    """One journal line (text) as :func:`parse` tells it; a line that is not JSON is
    :data:`DAMAGED`."""
    try:
        return parse(json.loads(line))
    except (ValueError, RecursionError):
        return DAMAGED


@dataclass
class EventLog:
    """The events a reader kept, in time order, and what it skipped: ``damaged`` (where:
    ``file:line``, or ``#n`` for the n-th event given), ``unknown`` (kind -> lines)."""

    events: list[Event[Record]] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    unknown: dict[str, int] = field(default_factory=dict)

    @property
    def skipped(self) -> int:
        return len(self.damaged) + sum(self.unknown.values())

    def add(self, obj: Any, where: str) -> None:
        got = parse(obj)
        if isinstance(got, Event):
            self.events.append(got)
        elif got == UNKNOWN:
            self.unknown[obj["kind"]] = self.unknown.get(obj["kind"], 0) + 1
        else:
            self.damaged.append(where)

    def of(self, cls: type[R]) -> list[Event[R]]:
        return of(self.events, cls)


def typed(events: Iterable[Any]) -> EventLog:
    """Events given as the journal's dicts (or as :class:`Event`) as an :class:`EventLog`
    in time order: what a reader given events by its caller works on."""
    log = EventLog()
    for n, e in enumerate(events):
        if isinstance(e, Event):
            log.events.append(e)
        else:
            log.add(e, f"#{n}")
    log.events.sort(key=lambda e: e.time)  # stable: a node's equal times keep their order
    return log


def of(events: Iterable[Event[Any]], cls: type[R]) -> list[Event[R]]:
    """The events whose record is a ``cls``."""
    return [e for e in events if isinstance(e.record, cls)]


def table() -> str:
    """The protocol as a markdown table (docs/run-dir.md): kind, writer, fields."""
    rows = ["| kind | written by | fields (`?`: may be absent) |", "|---|---|---|"]
    order = [f"orchestrator.events.{m}" for m in ("ranks", "files", "supervisor")]
    for kind, cls in sorted(RECORDS.items(), key=lambda kv: order.index(kv[1].__module__)):
        said = []
        for f, tp in fields_of(cls):
            said.append(f"`{f.name}`" + ("" if required(f) else "?") + f": {type_name(tp)}")
        rows.append(f"| `{kind}` | {cls.WHO} | {', '.join(said) or '-'} |")
    return "\n".join(rows)


def first_each_attempt(events: Iterable[Event[Any]], cls: type[R]) -> list[Event[R]]:
    """The first ``cls`` event of each attempt: each node's supervisor journals its own
    restart (and hang), one job-wide restart is one."""
    first: dict[int, Event[R]] = {}
    for e in of(events, cls):
        first.setdefault(e.attempt, e)
    return list(first.values())


def quarantine_share(events: Iterable[Event[Any]]) -> tuple[int, int] | None:
    """(quarantined samples, distinct samples seen) as the newest ``quarantine`` or
    ``run_end`` event states them, or None when no event does (nothing quarantined yet, or
    a journal older than the data budget)."""
    share = None
    for e in events:
        r = e.record
        if isinstance(r, Quarantine) and r.samples_seen is not None and r.total is not None:
            share = (r.total, r.samples_seen)
        elif isinstance(r, RunEnd) and r.samples_seen is not None:
            share = (len(r.quarantined), r.samples_seen)
    return share


def quarantine_fraction(events: Iterable[Event[Any]]) -> float | None:
    """The data budget's fraction as the newest ``quarantine`` or ``run_end`` event states
    it: the quarantined samples over those seen, or for windows of a token stream the
    share of the draws their ranges take away (``lost``; docs/nanogpt.md), not the ranges'
    width. None as for :func:`quarantine_share`."""
    fraction = None
    for e in events:
        r = e.record
        if isinstance(r, Quarantine) and r.samples_seen is not None and r.total is not None:
            fraction = (r.lost if r.lost is not None else r.total) / max(r.samples_seen, 1)
        elif isinstance(r, RunEnd) and r.samples_seen is not None:
            said = e.details.get("quarantined_fraction")
            fraction = float(said) if isinstance(said, int | float) else (
                len(r.quarantined) / max(r.samples_seen, 1)
            )  # fmt: skip
    return fraction
