"""Issue 33 item 4: the crash-loop and max_restarts rules (launch/decide.py) count in-place
recoveries (a dead rank replaced alone) as well as full restarts. Pure decisions, in
milliseconds, and the supervisor's look-up of an attempt's recoveries in a journal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from launch.decide import AttemptEnd, Restart, Stop, Tally, decide, stalls
from launch.outcomes import CRASH, OK, inplace_steps
from orchestrator.policy_sections import SupervisorPolicy
from orchestrator.protocol import EXIT_CRASH_LOOP, EXIT_OK, EXIT_RESTARTS_EXHAUSTED

pytestmark = pytest.mark.timeout(30)

SUP = SupervisorPolicy()  # max_restarts 10, crash_loop_attempts 3


def end(step: int, inplace: tuple[int | None, ...], outcome: str = CRASH) -> AttemptEnd:
    return AttemptEnd(number=0, returncode=0 if outcome == OK else 1, outcome=outcome,
                      best_step=step, runtime_s=5.0, inplace=inplace)  # fmt: skip


def test_recoveries_that_resume_from_the_same_step_count_toward_the_crash_loop() -> None:
    """Rank 1 dies at step 27 again and again, the ranks resuming from step 25 each time:
    attempt 0 made progress (its first recovery too), its second recovery did not (1);
    attempt 1 made none: it and both its recoveries count (1 + 3 = 4 >= 3): exit 74 after
    6 deaths, where counting attempts alone would take 4 attempts (12 deaths)."""
    d = decide(Tally(), end(27, (25, 25)), SUP)
    assert isinstance(d, Restart)
    assert (d.tally.stalled, d.tally.inplace, d.tally.restarts, d.tally.best) == (1, 2, 1, 27)
    d2 = decide(d.tally, end(27, (25, 25)), SUP)
    assert isinstance(d2, Stop) and d2.code == EXIT_CRASH_LOOP
    assert (d2.tally.stalled, d2.tally.inplace) == (4, 4)


def test_recoveries_with_progress_between_them_do_not() -> None:
    d = decide(Tally(best=5, stalled=2), end(40, (10, 20, 30)), SUP)
    assert isinstance(d, Restart) and (d.tally.stalled, d.tally.inplace) == (0, 3)
    assert stalls((10, None, 20), made=True) == 0  # not journaled: not counted against it
    assert stalls((10, 10, 5, 20), made=True) == 2
    assert stalls((10, None), made=False) == 2


def test_in_place_recoveries_spend_max_restarts() -> None:
    sup = SupervisorPolicy(max_restarts=3)
    d = decide(Tally(), end(40, (10, 20)), sup)  # 0 restarts + 2 in place: one restart left
    assert isinstance(d, Restart) and (d.tally.restarts, d.tally.inplace) == (1, 2)
    d2 = decide(d.tally, end(60, ()), sup)  # 1 + 2 = 3: spent
    assert isinstance(d2, Stop) and d2.code == EXIT_RESTARTS_EXHAUSTED
    assert (d2.tally.restarts, d2.tally.inplace) == (1, 2)
    # without in-place recoveries the rule is as before
    d3 = decide(Tally(restarts=2), end(60, ()), sup)
    assert isinstance(d3, Restart) and d3.tally.restarts == 3


def test_a_run_that_finishes_after_recoveries_ends_0() -> None:
    d = decide(Tally(restarts=9, inplace=5), end(40, (10, 10), outcome=OK), SUP)
    assert isinstance(d, Stop) and d.code == EXIT_OK


def _ev(t: float, kind: str, step: int, by: int, **details: Any) -> dict[str, Any]:
    return {"time": t, "kind": kind, "attempt": 1, "step": step, "rank": by,
            "details": details}  # fmt: skip


def test_the_supervisor_reads_an_attempts_recoveries_once_per_generation(tmp_path: Path) -> None:
    """Generation 1 journaled by two nodes' agents and healed (resumed from step 20);
    generation 2 replaced but its first step never committed (None); attempt 0's
    replacement is its own (no recovery of its generation journaled in it: None)."""
    rep = {"rank": 1, "cause": "signal"}
    lines = [
        {**_ev(1.0, "rank_replaced", -1, -1, generation=1, **rep), "attempt": 0},
        _ev(2.0, "rank_replaced", -1, -1, generation=1, **rep, node="n0"),
        _ev(2.1, "rank_replaced", -1, -1, generation=1, **rep, node="n1"),
        _ev(2.5, "inplace_recovery", 20, 0, generation=1, replaced=[1]),
        _ev(2.5, "inplace_recovery", 20, 1, generation=1, replaced=[1]),  # not rank 0's
        _ev(3.0, "rank_replaced", -1, -1, generation=2, **rep),
    ]
    (tmp_path / "journal").mkdir()
    (tmp_path / "journal" / "n0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert inplace_steps(str(tmp_path), 1) == (20, None)
    assert inplace_steps(str(tmp_path), 0) == (None,)
    assert inplace_steps(str(tmp_path), 2) == ()
