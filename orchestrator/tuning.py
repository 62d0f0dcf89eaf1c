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
    bounded_by: str | None  # what moved it off the optimum: min, max, ring, multiple


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
    if steps < lo:
        steps, why = lo, "min"
    if steps > hi:
        steps, why = hi, "max"
    if multiple_of > 1 and steps % multiple_of:
        steps = max(multiple_of, round(steps / multiple_of) * multiple_of)
        why = why or "multiple"
    return Choice(steps, best, cost_s, mtbf, step_s, why)
