"""The snapshot interval model (orchestrator/tuning.py) against a simulated run: failures
drawn from a Poisson process, each losing the work since the last snapshot plus a restart.
No training: the model's choice must land within 10% of the Young/Daly optimum, and its
simulated goodput within a hair of the best interval a sweep finds."""

from __future__ import annotations

import math
import random

import pytest

from orchestrator.tuning import choose, daly_interval_s, mtbf_s, overhead

pytestmark = pytest.mark.timeout(120)


def simulate(
    interval_s: float, cost_s: float, mtbf: float, restart_s: float, work_s: float, seed: int
) -> float:
    """Goodput (useful work / wall time) of ``work_s`` seconds of training with a snapshot
    costing ``cost_s`` after every ``interval_s`` of it, failures every ``mtbf`` on average."""
    rng = random.Random(seed)
    wall = done = 0.0
    fail_at = rng.expovariate(1 / mtbf)
    while done < work_s:
        chunk = min(interval_s, work_s - done)
        if wall + chunk + cost_s > fail_at:  # lost: the chunk and its snapshot
            wall = fail_at + restart_s
            fail_at = wall + rng.expovariate(1 / mtbf)
            continue
        wall += chunk + cost_s
        done += chunk
    return work_s / wall


@pytest.mark.parametrize(
    ("cost_s", "mtbf", "step_s"),
    [(0.05, 600.0, 0.2), (2.0, 3600.0, 1.0), (30.0, 4 * 3600.0, 5.0)],
    ids=["memory-ring", "local-disk", "object-store"],
)
def test_the_chosen_interval_is_the_young_daly_optimum(
    cost_s: float, mtbf: float, step_s: float
) -> None:
    # History: 200 MTBFs of training with the failures at the true rate, and a prior
    # wrong by 4x (weighing one MTBF): the estimate must follow the history.
    observed_s = 200 * mtbf
    failures = round(observed_s / mtbf)
    estimate = mtbf_s(prior_mtbf_s=mtbf / 4, prior_weight_s=mtbf, failures=failures,
                      observed_s=observed_s)  # fmt: skip
    chosen = choose(cost_s, estimate, step_s)
    young = math.sqrt(2 * cost_s * mtbf)
    optimum = daly_interval_s(cost_s, mtbf)
    assert abs(optimum - young) / young < 0.05  # Daly refines Young; both agree here
    got = chosen.every_steps * step_s
    assert abs(got - optimum) / optimum < 0.10, (got, optimum, chosen)
    # A sweep of the simulated run: the model's choice is as good as the sweep's best.
    work = 300 * mtbf
    restart = 60.0
    grid = [optimum * f for f in (0.25, 0.5, 0.7, 1.0, 1.4, 2.0, 4.0)]
    seeds = range(8)
    sim = {
        tau: sum(simulate(tau, cost_s, mtbf, restart, work, s) for s in seeds) / len(seeds)
        for tau in [*grid, got]
    }
    best = max(sim[t] for t in grid)
    assert sim[got] >= best - 0.002, (sim, got)
    # And the model's own curve has its minimum there.
    assert (
        overhead(got, cost_s, mtbf, restart)
        <= min(overhead(t, cost_s, mtbf, restart) for t in grid) * 1.01
    )


def test_the_prior_rules_until_there_is_history_and_bounds_hold() -> None:
    # No failure seen in a short run: the prior's MTBF, barely moved.
    assert mtbf_s(3600.0, 3600.0, failures=0, observed_s=60.0) == pytest.approx(3660.0)
    # Many seen: the observed rate wins over the prior.
    assert mtbf_s(3600.0, 3600.0, failures=100, observed_s=100 * 60.0) == pytest.approx(
        (3600 + 6000) / 101
    )
    # Bounds: the ring's minimum, a maximum, a multiple of the in-memory interval.
    assert choose(0.01, 100.0, 1.0, lo=5).every_steps == 5
    assert choose(0.01, 100.0, 1.0, lo=5).bounded_by == "min"
    assert choose(100.0, 1e9, 0.1, hi=1000).every_steps == 1000
    multiple = choose(2.0, 3600.0, 1.0, multiple_of=40)
    assert multiple.every_steps % 40 == 0 and multiple.bounded_by == "multiple"
    assert daly_interval_s(10.0, 4.0) == 4.0  # a snapshot dearer than failures are rare


def test_an_unmeasured_durable_cost_is_probed_at_the_next_snapshot() -> None:
    """With no durable write measured yet (failures came before it), the tier writes at
    the next in-memory snapshot to measure one, instead of keeping a long initial interval
    that the failures never let it reach; once measured, the optimum rules."""
    from orchestrator.policy import Policy
    from orchestrator.tuning import Measured, Tuner

    tuner = Tuner(Policy().tune, True, True, shared_memory=False, ring_min_steps=2)
    m = Measured(step_s=0.04, snapshot_s=0.003, write_s=None, incidents=1, restarts=1,
                 trained_s=20.0)  # fmt: skip
    chosen = tuner.retune(m, snapshot_steps=10, persist_steps=100)
    snap = chosen["snapshot"].every_steps
    assert (chosen["persist"].every_steps, chosen["persist"].bounded_by) == (snap, "probe")
    measured = tuner.retune(
        Measured(**{**m.__dict__, "write_s": 0.05}), snapshot_steps=snap, persist_steps=snap
    )
    assert measured["persist"].bounded_by != "probe" and measured["persist"].cost_s == 0.05


def test_bounds_hold_together_whatever_the_multiple() -> None:
    """Rounding to a multiple of the ring's interval never crosses the maximum, and the
    ring's minimum (below it nothing would be sealed) wins over a smaller maximum; the
    starting interval of ``auto`` respects that minimum too."""
    from orchestrator.policy import parse_policy
    from orchestrator.tuning import resolve_auto, ring_min_steps

    for hi, multiple in ((20_000, 700), (100, 60), (45, 10), (7, 3)):
        c = choose(1.0, 1e12, 1.0, lo=multiple, hi=hi, multiple_of=multiple)
        assert c.every_steps <= hi and c.every_steps % multiple == 0, (hi, multiple, c)
    assert choose(1.0, 1e12, 1.0, lo=50, hi=20).every_steps == 50
    p = parse_policy({
        "snapshot": {"every_steps": "auto", "seal_after_steps": 50, "keep": 2},
        "persist": {"every_steps": "auto"},
    })  # fmt: skip
    auto = resolve_auto(p)
    assert auto.snapshot.every_steps >= ring_min_steps(auto.snapshot) == 50
    assert auto.persist.every_steps % auto.snapshot.every_steps == 0
