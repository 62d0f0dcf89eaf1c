"""In-place recoveries (issue 33) as the goodput ledger counts them: a dead rank replaced
alone costs the attempt the span from the fault to the first step committed after it
(``inplace``, not ``restart``: no process of the survivors restarts), and the steps the
ranks did again after rolling back to the agreed step (``lost``: from that step's
snapshot to the fault). Torch-free, read from rank 0's ``inplace_recovery`` events."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from orchestrator.events import Event, InplaceRecovery, SnapshotTaken


@dataclass(frozen=True)
class Recovery:
    """One in-place recovery: ``seconds`` from the fault to the first step after it,
    ``redone_s`` of work done again (None: no snapshot of ``step`` before the fault)."""

    attempt: int
    step: int  # the step every rank resumed from
    generation: int
    replaced: tuple[int, ...]
    cause: str | None
    fault: float
    first_step: float
    redone_s: float | None

    @property
    def seconds(self) -> float:
        return max(0.0, self.first_step - self.fault)


def recoveries(events: Iterable[Event[Any]]) -> list[Recovery]:
    """The run's in-place recoveries, in time order (rank 0 journals each once)."""
    captured: dict[tuple[int, int], list[float]] = {}  # (attempt, step) -> capture times
    out = []
    for e in sorted(events, key=lambda e: e.time):
        r = e.record
        if isinstance(r, SnapshotTaken):
            captured.setdefault((e.attempt, e.step), []).append(e.time)
        elif isinstance(r, InplaceRecovery) and e.rank == 0:
            t = r.times
            # The agent's word of the fault; else the survivors' detection of it.
            fault = _time(t.get("fault")) or _time(t.get("detect")) or e.time
            first = _time(t.get("first_step")) or e.time
            anchors = [x for x in captured.get((e.attempt, e.step), []) if x <= fault]
            out.append(
                Recovery(
                    attempt=e.attempt,
                    step=e.step,
                    generation=r.generation,
                    replaced=tuple(r.replaced),
                    cause=r.cause,
                    fault=fault,
                    first_step=max(first, fault),
                    redone_s=fault - max(anchors) if anchors else None,
                )
            )
    return out


def summary(events: Iterable[Event[Any]]) -> dict[str, Any]:
    """What status, report and the exporter show: how many, their time (fault to the
    next step, summed and the longest) and the work they made the ranks do again."""
    recs = recoveries(events)
    return {
        "count": len(recs),
        "seconds": sum(r.seconds for r in recs),
        "longest_s": max((r.seconds for r in recs), default=0.0),
        "redone_s": sum(r.redone_s or 0.0 for r in recs),
        "replaced": sorted({rank for r in recs for rank in r.replaced}),
    }


def _time(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and x > 0 else None


__all__ = ["Recovery", "recoveries", "summary"]
