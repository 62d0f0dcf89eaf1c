"""Snapshot intervals chosen from what they cost and how often they are needed (Young/Daly).

A tier that takes a snapshot every ``tau`` seconds of training, each costing ``delta``
seconds of training (the stall, or the slowdown while writing), and is needed on failures
that come every ``M`` seconds on average (a failure costs half an interval of redone work,
on average, plus a restart that does not depend on ``tau``), loses a fraction of its time

    overhead(tau) ~= delta / tau + (tau / 2 + R) / M

which is least at Young's ``tau = sqrt(2 * delta * M)``; Daly's higher-order estimate,
used here, corrects it for a ``delta`` that is not small next to ``M``:

    tau = sqrt(2 delta M) * (1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9) - delta   (delta < 2M)
    tau = M                                                                          (otherwise)

The two tiers of a run: the in-memory ring (``snapshot.every_steps: auto``) is needed on
incidents (rollbacks), and, when it lives in shared memory, on restarts too; the durable
tier (``persist.every_steps: auto``) on restarts (crashes, hangs, a lost node; a preemption
writes its own snapshot). ``M`` comes from the failures seen so far, pulled towards the
policy's prior while there is little history: ``M = (T_prior + T) / (T_prior / M_prior + n)``
after ``n`` failures in ``T`` seconds of training, ``T_prior`` being the prior's weight.
Assumptions: failures independent of the interval and of each other (Poisson), costs
steady, a failure anywhere costs the whole job the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's optimal time between snapshots (seconds of training) for a snapshot costing
    ``cost_s`` and failures every ``mtbf_s`` on average."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    x = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - cost_s


def mtbf_s(prior_mtbf_s: float, prior_weight_s: float, failures: int, observed_s: float) -> float:
    """The mean time between failures: the prior's, corrected by what was observed."""
    return (prior_weight_s + observed_s) / (prior_weight_s / prior_mtbf_s + failures)


def overhead(interval_s: float, cost_s: float, mtbf: float, restart_s: float = 0.0) -> float:
    """The model's fraction of time lost with snapshots every ``interval_s``."""
    return cost_s / interval_s + (interval_s / 2 + restart_s) / mtbf


@dataclass(frozen=True)
class Choice:
    """An interval in steps and why."""

    every_steps: int
    interval_s: float  # the optimum in seconds of training, before rounding and bounds
    cost_s: float
    mtbf_s: float
    step_s: float
    bounded_by: str | None  # what moved it off the optimum: min, max, multiple; probe:
    # no cost known yet, the next snapshot is written to measure it


def choose(
    cost_s: float,
    mtbf: float,
    step_s: float,
    lo: int = 1,
    hi: int = 100_000,
    multiple_of: int = 1,
) -> Choice:
    """The interval in steps nearest the optimum within [lo, hi], a multiple of
    ``multiple_of`` (the durable tier persists in-memory snapshots)."""
    best = daly_interval_s(cost_s, mtbf)
    steps = max(1, round(best / step_s)) if step_s > 0 else hi
    why = None
    if steps > hi:
        steps, why = hi, "max"
    if steps < lo:  # the minimum wins: below it the ring would have nothing sealed
        steps, why = lo, "min"
    if multiple_of > 1 and steps % multiple_of:
        down = max(multiple_of, steps // multiple_of * multiple_of)
        up = down + multiple_of
        # The nearer multiple that keeps the bounds (up only past hi if down is below lo).
        steps = up if (steps - down > up - steps and up <= hi) or down < lo else down
        why = why or "multiple"
    return Choice(steps, best, cost_s, mtbf, step_s, why)


@dataclass
class Measured:
    """What rank 0 saw since training started (this process), for :meth:`Tuner.retune`."""

    step_s: float  # seconds per step, overheads included
    snapshot_s: float | None  # mean stall of an in-memory snapshot
    write_s: float | None  # mean slowdown of the training loop per durable write
    incidents: int  # incidents (rollbacks) of the job so far
    restarts: int  # restarts of the job so far
    trained_s: float  # seconds the job has trained (earlier attempts included)


class Tuner:
    """``every_steps: auto``: the intervals each ``tune.every_steps`` steps, from measured
    costs and failure rates (the priors until there is history); the Guard applies and
    journals a change (``interval`` events, with these inputs)."""

    def __init__(
        self,
        tune: Any,
        snapshot_auto: bool,
        persist_auto: bool,
        shared_memory: bool,
        ring_min_steps: int,
    ) -> None:
        self.tune, self.snapshot_auto, self.persist_auto = tune, snapshot_auto, persist_auto
        self.shared_memory = shared_memory
        self.ring_min_steps = ring_min_steps

    @property
    def active(self) -> bool:
        return self.snapshot_auto or self.persist_auto

    def due(self, step: int) -> bool:
        return self.active and step > 0 and step % self.tune.every_steps == 0

    def retune(self, m: Measured, snapshot_steps: int, persist_steps: int | None) -> dict[str, Any]:
        """The intervals to use (``snapshot``, ``persist``) and why, for each automatic one."""
        t = self.tune
        incident_mtbf = mtbf_s(t.prior_incident_mtbf_s, t.prior_weight_s, m.incidents, m.trained_s)
        restart_mtbf = mtbf_s(t.prior_restart_mtbf_s, t.prior_weight_s, m.restarts, m.trained_s)
        out: dict[str, Any] = {}
        snap = snapshot_steps
        if self.snapshot_auto and m.snapshot_s is not None:
            # The ring is what incidents roll back to, and in shared memory what restarts
            # resume from as well: their rates add.
            rate = 1 / incident_mtbf + (1 / restart_mtbf if self.shared_memory else 0.0)
            c = choose(m.snapshot_s, 1 / rate, m.step_s, self.ring_min_steps, t.max_snapshot_steps)
            out["snapshot"] = c
            snap = c.every_steps
        if self.persist_auto and m.write_s is not None:
            c = choose(m.write_s, restart_mtbf, m.step_s, snap, t.max_persist_steps, snap)
            out["persist"] = c
        elif self.persist_auto:
            # Not measured yet: write at the next in-memory snapshot, to measure (a job
            # whose failures come sooner than its first write would never learn the cost).
            out["persist"] = Choice(snap, 0.0, 0.0, restart_mtbf, m.step_s, "probe")
        return out


@dataclass
class Intervals:
    """The snapshot intervals in force, in steps: the policy's, or under ``every_steps:
    auto`` the tuner's latest choice. The policy is frozen once loaded; these are what
    changes while training (the Guard's ring and the durable tier read them)."""

    snapshot_steps: int
    persist_steps: int | None

    @classmethod
    def of(cls, policy: Any) -> Intervals:
        return cls(policy.snapshot.every_steps, policy.persist.every_steps)


def resolve_auto(policy: Any) -> Any:
    """A copy of ``policy`` whose automatic intervals start at tune.initial_* (the persist
    one a multiple of the in-memory one)."""
    t, snapshot, persist = policy.tune, policy.snapshot, policy.persist
    if snapshot.auto_every_steps:
        every = max(t.initial_snapshot_steps, ring_min_steps(snapshot))
        snapshot = snapshot.model_copy(update={"every_steps": every})
    if persist.auto_every_steps:
        snap = snapshot.every_steps
        every = max(snap, round(t.initial_persist_steps / snap) * snap)
        persist = persist.model_copy(update={"every_steps": every})
    return policy.model_copy(update={"snapshot": snapshot, "persist": persist}, deep=True)


def ring_min_steps(snapshot: Any) -> int:
    """The shortest in-memory interval the ring allows: its sealed snapshots must span
    min_age_steps, and outlive seal_after_steps, within keep - 1 slots."""
    need = max(snapshot.min_age_steps, snapshot.seal_after_steps)
    return max(1, math.ceil(need / (snapshot.keep - 1)))
