"""``every_steps: auto`` in training: the step times and write costs the :class:`Tuner`
chooses the snapshot intervals from, measured on every commit, and the retuning every
``tune.every_steps`` steps (rank 0 chooses, every rank applies the same intervals)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.context import Context
from orchestrator.durable import DurableTier
from orchestrator.journal import per_attempt, read_journal
from orchestrator.keeper import StateKeeper
from orchestrator.recovery import Recovery
from orchestrator.tuning import Intervals, Measured, Tuner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class History:
    """What a job saw before this process (``every_steps: auto``'s inputs)."""

    incidents: int = 0
    restarts: int = 0
    seconds: float = 0.0  # since the job's first start
    write_cost: float | None = None  # the last journaled cost of a durable write


class AutoTune:
    """The Guard's side of ``every_steps: auto``: inactive (every call cheap) when no
    interval is automatic.

    Args:
        ctx: the shared context (its clock times the steps).
        tuner: the policy's tuner (:class:`Tuner`, built from the tune section).
        intervals: the intervals in force, changed in place on a retune.
        durable, keeper, recovery: where writes, snapshot stalls and incidents are counted.
        event: journals a collective decision at the current step (rank 0).
    """

    def __init__(
        self,
        ctx: Context,
        tuner: Tuner,
        intervals: Intervals,
        *,
        durable: DurableTier,
        keeper: StateKeeper,
        recovery: Recovery,
        event: Callable[..., None],
    ) -> None:
        self.ctx, self.tuner, self.intervals = ctx, tuner, intervals
        self.durable, self.keeper, self.recovery, self._event = durable, keeper, recovery, event
        self._started = ctx.clock.monotonic()
        self._writes_from = 0  # durable writes submitted by the last tuning
        self._step_times: list[tuple[float, bool]] = []  # (seconds, a write in flight)
        self._last_commit: float | None = None
        self._history = self._job_history() if tuner.active else History()
        self._write_cost = self._history.write_cost  # training lost per durable write

    @property
    def active(self) -> bool:
        return self.tuner.active

    def committed(self, step: int, writing: bool) -> None:
        """A step was committed (``step``: the number of steps committed now; ``writing``:
        a durable write was in flight): time it, and retune when due."""
        if not self.tuner.active:
            return
        now = self.ctx.clock.monotonic()
        if self._last_commit is not None:
            self._step_times.append((now - self._last_commit, writing))
        self._last_commit = now
        if self.tuner.due(step):
            self._retune()

    def rolled_back(self) -> None:
        self._last_commit = None  # the incident's time is not a step's

    def _job_history(self) -> History:
        """What the job saw before this process, from the journal (rank 0 reads; every rank
        gets the same). The write cost carries over: a job whose attempts crash before
        their first write must not measure it from scratch each time."""
        said = None
        comm = self.ctx.comm
        if comm.rank == 0:
            events = list(read_journal(self.ctx.run_dir))
            starts = [
                float(e["time"]) for e in events if e["kind"] in ("run_start", "attempt_start")
            ]
            costs = [
                float(e["details"]["cost_s"])
                for e in events
                if e["kind"] == "interval"
                and e["details"].get("tier") == "persist"
                and e["details"].get("cost_s")
            ]
            supervised = any(e["kind"] == "attempt_start" for e in events)
            said = History(
                incidents=sum(1 for e in events if e["kind"] == "incident"),
                # The supervisor's restarts (one per attempt, whichever node said it; a
                # preemption is not one); without it, torchrun's restarts.
                restarts=len(per_attempt(events, "restart")) if supervised else self.ctx.attempt,
                seconds=self.ctx.clock.wall() - min(starts) if starts else 0.0,
                write_cost=costs[-1] if costs else None,
            )
        out: History = comm.broadcast_object(said)
        return out

    def _retune(self) -> None:
        """Every tune.every_steps steps (every rank at once): rank 0 measures and chooses,
        every rank applies the same intervals; a change is journaled with its inputs."""
        choice = None
        if self.ctx.comm.rank == 0:
            try:  # never leave the other ranks in the broadcast below
                choice = self._choose()
            except Exception as err:
                logger.warning("every_steps: auto: choosing failed (%r); intervals kept", err)
        said: tuple[Measured, dict[str, Any]] | None = self.ctx.comm.broadcast_object(choice)
        self._writes_from = self.durable.submitted
        self._step_times = []
        if said is None:
            return
        m, chosen = said
        for tier in ("snapshot", "persist"):
            c, old = chosen.get(tier), getattr(self.intervals, f"{tier}_steps")
            if c is None or c.every_steps == old:
                continue
            self._event(
                "interval", tier=tier, old=old, new=c.every_steps,
                optimum_s=round(c.interval_s, 4), cost_s=round(c.cost_s, 6),
                mtbf_s=round(c.mtbf_s, 1), step_s=round(c.step_s, 6), bounded_by=c.bounded_by,
                incidents=m.incidents, restarts=m.restarts, trained_s=round(m.trained_s, 1),
            )  # fmt: skip
            setattr(self.intervals, f"{tier}_steps", c.every_steps)

    def _choose(self) -> tuple[Measured, dict[str, Any]] | None:
        """Rank 0: what was measured since the last tuning and the intervals it gives
        (None: no step measured, e.g. right after a rollback)."""
        every = [s for s, _ in self._step_times]  # commit to commit, no incident inside
        if not every:
            return None
        idle = [s for s, w in self._step_times if not w]
        busy = [s for s, w in self._step_times if w]
        writes = self.durable.submitted - self._writes_from
        if idle and busy and writes >= 1:  # the loop's slowdown per durable write
            excess = sum(busy) - len(busy) * statistics.median(idle)
            if excess > 0:  # else noise: keep the last estimate
                self._write_cost = excess / writes
        stalls = list(self.keeper.stalls)
        h = self._history
        m = Measured(
            step_s=statistics.mean(every),
            snapshot_s=statistics.mean(stalls) if stalls else None,
            write_s=self._write_cost,  # the last measured (an earlier attempt's at first)
            incidents=h.incidents + len(self.recovery.incidents),
            restarts=h.restarts,
            trained_s=h.seconds + (self.ctx.clock.monotonic() - self._started),
        )
        i = self.intervals
        return m, self.tuner.retune(m, i.snapshot_steps, i.persist_steps)
