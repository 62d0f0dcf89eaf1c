"""The supervisor's decisions (launch/decide.py), rule by rule: a pure function, tested
in-process without processes, files or clocks (milliseconds each). The end-to-end tests of
the same rules through real launchers are tests/test_supervisor.py and tests/test_nodes.py."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from tenacity import wait_exponential_jitter

from launch.decide import (
    PREEMPTION,
    SILENT_PEERS,
    STOPPED_ON_REQUEST,
    Ask,
    AttemptEnd,
    Decision,
    Preemption,
    Restart,
    Stop,
    Tally,
    backoff,
    before_attempt,
    decide,
    needs_blame,
    no_agreement,
    progress,
)
from launch.nodes import Ended
from launch.outcomes import CRASH, GAVE_UP, HANG, OK, PREEMPTED, UNHEALTHY
from orchestrator.policy_sections import SupervisorPolicy
from orchestrator.protocol import (
    EXIT_CANNOT_START,
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    EXIT_NODE_LOST,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_STOPPED,
    EXIT_UNHEALTHY,
)

pytestmark = pytest.mark.timeout(30)

SUP = SupervisorPolicy()  # max_restarts 10, max_unhealthy 2, crash_loop_attempts 3


def end(outcome: str = CRASH, step: int | None = 10, **kw: Any) -> AttemptEnd:
    """An attempt that ended with ``outcome`` at ``step`` (its highest step)."""
    defaults: dict[str, Any] = {
        "number": 0,
        "returncode": {OK: 0, GAVE_UP: 71, UNHEALTHY: 72, PREEMPTED: 73}.get(outcome, 1),
        "runtime_s": 5.0,
    }
    return AttemptEnd(outcome=outcome, best_step=step, **{**defaults, **kw})


def stop(d: Decision) -> Stop:
    assert isinstance(d, Stop), d
    return d


def restart(d: Decision) -> Restart:
    assert isinstance(d, Restart), d
    return d


def replay(ends: list[AttemptEnd], sup: SupervisorPolicy = SUP) -> Stop:
    """Decide attempt after attempt from a fresh supervisor, as it does; the stop they come
    to (every attempt but the last must be restarted)."""
    tally = Tally()
    for i, e in enumerate(ends):
        d = decide(tally, replace(e, number=i), sup)
        if i == len(ends) - 1:
            return stop(d)
        tally = restart(d).tally
    raise AssertionError("no attempts")


# --- the ends no count is needed for ------------------------------------------------------
def test_a_command_that_cannot_start_stops_with_78_first() -> None:
    why = "cannot start 'nope': No such file"
    d = stop(decide(Tally(), end(CRASH, None, returncode=127, cannot_start=why), SUP))
    assert (d.code, d.reason) == (EXIT_CANNOT_START, why)


def test_finished_stops_with_0_whatever_else_happened() -> None:
    e = end(OK, 50, lost="n1 gone", signalled=True, ended=Ended("n1", 71, "gave up"))
    d = stop(decide(Tally(best=40, stalled=2), e, SUP))
    assert (d.code, d.reason) == (EXIT_OK, "finished")
    assert d.tally.best == 50


def test_a_lost_node_stops_with_77_before_a_preemption_is_looked_at() -> None:
    d = stop(decide(Tally(), end(PREEMPTED, lost="2 of 2 nodes alive"), SUP))
    assert (d.code, d.reason) == (EXIT_NODE_LOST, "node lost: 2 of 2 nodes alive")


def test_a_preemption_asks_for_its_event_then_exits_73_only_after_a_durable_snapshot() -> None:
    e = end(PREEMPTED, signalled=True)
    assert decide(Tally(), e, SUP) == Ask(PREEMPTION)
    saved = {"step": 35, "details": {"persisted": True}}
    d = stop(decide(Tally(), replace(e, preemption=Preemption(saved)), SUP))
    assert d.code == EXIT_PREEMPTED
    # No event, but the launcher's own 73 says the snapshot was written.
    d = stop(decide(Tally(), replace(e, preemption=Preemption(None)), SUP))
    assert d.code == EXIT_PREEMPTED


def test_a_preemption_without_a_durable_snapshot_exits_143_with_the_steps_lost() -> None:
    unsaved = {
        "step": 35,
        "details": {"persisted": False, "durable_step": 20, "steps_lost": 15, "url": "file://x"},
    }
    e = end(PREEMPTED, returncode=1, preemption=Preemption(unsaved))
    d = stop(decide(Tally(), e, SUP))
    assert d.code == EXIT_STOPPED
    assert "step 20" in d.reason and "15 step(s) are lost" in d.reason
    none_yet = {"step": 35, "details": {"persisted": False, "durable_step": None}}
    d = stop(decide(Tally(), replace(e, preemption=Preemption(none_yet)), SUP))
    assert d.code == EXIT_STOPPED and "there is no durable snapshot" in d.reason
    # Only "preempting", no preempted event and no 73: stopped while writing it.
    d = stop(decide(Tally(), replace(e, preemption=Preemption(None)), SUP))
    assert d.code == EXIT_STOPPED and "no preempted event followed" in d.reason


def test_a_signal_without_a_preemption_stops_with_143_before_gave_up() -> None:
    d = stop(decide(Tally(), end(GAVE_UP, signalled=True, gave_up_reason="budget"), SUP))
    assert d.code == EXIT_STOPPED and "did not stop as preempted" in d.reason


def test_gave_up_stops_with_71_and_the_workers_reason() -> None:
    d = stop(decide(Tally(), end(GAVE_UP, gave_up_reason="5 incidents in 100 steps"), SUP))
    assert (d.code, d.reason) == (EXIT_GAVE_UP, "the workers gave up: 5 incidents in 100 steps")


def test_a_node_that_ended_the_job_stops_this_one_with_its_code() -> None:
    e = end(CRASH, ended=Ended("n1", EXIT_CRASH_LOOP, "crash loop"), nnodes=2)
    d = stop(decide(Tally(), e, SUP))
    assert d.code == EXIT_CRASH_LOOP and d.reason.startswith("node n1 ended the job")
    # Ahead of the unhealthy count: that node will not join a restart.
    e = replace(e, outcome=UNHEALTHY)
    assert stop(decide(Tally(unhealthy=5), e, SUP)).code == EXIT_CRASH_LOOP


# --- unhealthy ---------------------------------------------------------------------------
def test_unhealthy_attempts_restart_until_over_max_unhealthy_then_72_excluding_hosts() -> None:
    sup = SupervisorPolicy(max_unhealthy=2, crash_loop_attempts=10)
    ends = [end(UNHEALTHY, 10 + i) for i in range(3)]  # progress each time: no crash loop
    d = replay(ends, sup)
    assert d.code == EXIT_UNHEALTHY and d.exclude_hosts
    assert d.reason.startswith("3 unhealthy attempts, over supervisor.max_unhealthy=2")
    assert d.tally.unhealthy == 3
    # max_unhealthy 0: the first one stops.
    assert stop(decide(Tally(), end(UNHEALTHY), SupervisorPolicy(max_unhealthy=0))).exclude_hosts


def test_unhealthy_attempts_without_progress_count_toward_the_crash_loop_too() -> None:
    sup = SupervisorPolicy(max_unhealthy=10)
    d = replay([end(UNHEALTHY, 10)] * 4, sup)  # the first makes progress (past -1)
    assert d.code == EXIT_CRASH_LOOP and not d.exclude_hosts


# --- the crash loop ----------------------------------------------------------------------
def test_attempts_in_a_row_without_progress_are_a_crash_loop() -> None:
    d = replay([end(CRASH, 10)] * 4)
    assert d.code == EXIT_CRASH_LOOP and d.tally.stalled == 3
    assert "3 attempts in a row made no progress past step 10" in d.reason
    assert "(last: crash, exit code 1)" in d.reason


def test_a_step_past_the_best_resets_the_count_and_the_best_step_equal_does_not() -> None:
    t = restart(decide(Tally(best=10, stalled=2), end(CRASH, 11), SUP)).tally
    assert (t.best, t.stalled) == (11, 0)
    assert stop(decide(Tally(best=10, stalled=2), end(CRASH, 10), SUP)).code == EXIT_CRASH_LOOP
    # A lower step (a rollback) is no progress either; the best stays.
    d = stop(decide(Tally(best=10, stalled=2), end(HANG, 5), SUP))
    assert d.code == EXIT_CRASH_LOOP and d.tally.best == 10


def test_the_count_carried_from_earlier_supervisors_holds() -> None:
    # launch/outcomes.py history(): two attempts without progress before a requeue.
    assert stop(decide(Tally(best=10, stalled=2), end(CRASH, 10), SUP)).code == EXIT_CRASH_LOOP


def test_without_heartbeats_a_long_life_is_progress() -> None:
    sup = SupervisorPolicy(progress_runtime_s=300.0)
    long = end(CRASH, None, runtime_s=300.0)
    assert progress(Tally(best=10), long, sup) == (True, 10)
    t = restart(decide(Tally(best=10, stalled=2), long, sup)).tally
    assert t.stalled == 0 and t.best == 10
    short = end(CRASH, None, runtime_s=299.9)
    assert progress(Tally(best=10), short, sup) == (False, 10)
    assert stop(decide(Tally(stalled=2), short, sup)).code == EXIT_CRASH_LOOP


def test_a_blameless_failure_neither_counts_nor_resets() -> None:
    e = end(CRASH, 10, blameless="ended for node n1", nnodes=2)
    t = restart(decide(Tally(best=10, stalled=2), e, SUP)).tally
    assert t.stalled == 2
    t = restart(decide(Tally(best=10, stalled=1), end(CRASH, 10, nnodes=2), SUP)).tally
    assert t.stalled == 2


def test_who_is_to_blame_is_asked_only_for_a_failure_without_progress() -> None:
    assert needs_blame(Tally(best=10), end(CRASH, 10), SUP)
    assert not needs_blame(Tally(best=10), end(CRASH, 11), SUP)
    assert not needs_blame(Tally(best=10), end(OK, 10), SUP)


def test_on_several_nodes_a_crash_loop_verdict_looks_at_the_peers_first() -> None:
    e = end(CRASH, 10, nnodes=2)
    assert decide(Tally(best=10, stalled=2), e, SUP) == Ask(SILENT_PEERS)
    # A peer that stopped beating died with the attempt: one attempt off the count.
    t = restart(decide(Tally(best=10, stalled=2), replace(e, silent_peers=("n1",)), SUP)).tally
    assert t.stalled == 2
    d = stop(decide(Tally(best=10, stalled=2), replace(e, silent_peers=()), SUP))
    assert d.code == EXIT_CRASH_LOOP
    # Below the verdict, nobody is asked.
    assert isinstance(decide(Tally(best=10, stalled=0), e, SUP), Restart)


# --- the restart budget and the backoff --------------------------------------------------
def test_max_restarts_spent_stops_with_75_after_the_crash_loop_rule() -> None:
    sup = SupervisorPolicy(max_restarts=2, crash_loop_attempts=10)
    d = replay([end(CRASH, i) for i in range(3)], sup)
    assert (d.code, d.reason) == (EXIT_RESTARTS_EXHAUSTED, "supervisor.max_restarts=2 spent")
    assert d.tally.restarts == 2
    sup = SupervisorPolicy(max_restarts=0, crash_loop_attempts=1)
    assert stop(decide(Tally(best=10), end(CRASH, 10), sup)).code == EXIT_CRASH_LOOP
    assert stop(decide(Tally(), end(CRASH, 10), sup)).code == EXIT_RESTARTS_EXHAUSTED


def test_a_restart_counts_and_waits_its_backoff() -> None:
    sup = SupervisorPolicy(backoff_s=2.0, backoff_max_s=120.0)
    r = restart(decide(Tally(restarts=2), end(CRASH, 10, jitter=0.5), sup))
    assert r.tally.restarts == 3 and r.tally.best == 10
    assert r.delay_s == 2.0 * 4 + 0.5 * 2.0


def test_the_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    sup = SupervisorPolicy(backoff_s=2.0, backoff_max_s=120.0)
    assert [backoff(n, sup, 0.0) for n in range(1, 9)] == [2, 4, 8, 16, 32, 64, 120, 120]
    assert backoff(1, sup, 0.999) == pytest.approx(3.998)
    assert backoff(10_000, sup, 0.5) == 120.0  # past what a float holds: the cap
    assert backoff(3, SupervisorPolicy(backoff_s=0.0), 0.9) == 0.0


def test_the_backoff_is_tenacity_s_exponential_jitter_with_the_draw_passed_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the supervisor computed before the rules moved here, draw for draw."""
    for b, cap in ((2.0, 120.0), (0.2, 1.0), (5.0, 7.0)):
        sup = SupervisorPolicy(backoff_s=b, backoff_max_s=cap)
        for n in range(1, 12):
            for draw in (0.0, 0.3, 0.999):
                monkeypatch.setattr(random, "uniform", lambda lo, hi, d=draw: lo + (hi - lo) * d)
                wait = wait_exponential_jitter(multiplier=b, max=cap, jitter=b)
                state: Any = type("S", (), {"attempt_number": n})()
                assert backoff(n, sup, draw) == pytest.approx(float(wait(state)))


# --- before an attempt -------------------------------------------------------------------
def test_before_an_attempt_a_signal_stops_with_143() -> None:
    assert before_attempt(False) is None
    assert before_attempt(True) == Stop(EXIT_STOPPED, STOPPED_ON_REQUEST)


def test_nodes_that_never_agree_stop_with_the_reason() -> None:
    assert no_agreement("n1 gone", None).code == EXIT_NODE_LOST
    d = no_agreement(None, Ended("n1", EXIT_GAVE_UP, "the workers gave up"))
    assert d.code == EXIT_GAVE_UP
    assert d.reason == (
        "node n1 ended the job (the workers gave up; exit 71): this node stops with it"
    )
    assert no_agreement(None, None) == Stop(EXIT_STOPPED, STOPPED_ON_REQUEST)
