"""The supervisor's decisions: after an attempt, restart (after how long) or stop (with which
exit code, and why).

A pure function of what the attempts came to and the policy's ``supervisor`` section: no
files, no clocks, no processes, no random draws (the backoff's jitter comes in as a number).
launch/supervisor.py gathers the facts, asks, and acts on the answer; tests/test_decide.py
tests every rule in milliseconds. A fact that costs a wait to learn (the preemption's
``preempted`` event, which may be in flight from another node; whether a peer stopped
beating) is looked up only when a rule needs it: :func:`decide` returns :class:`Ask` for
it and is asked again with the answer.

After an attempt, the first rule that applies decides (docs/supervisor.md):

1. the command could not start at all: stop, 78 (CANNOT_START);
2. the workers finished: stop, 0;
3. a node was lost while the attempt waited for it: stop, 77 (NODE_LOST);
4. the workers stopped as preempted: 73 when the durable snapshot was written (the
   ``preempted`` event says ``persisted``, or, with no event, the launcher's own 73), else
   143 (STOPPED) with the steps lost;
5. a signal reached the supervisor and the workers did not stop as preempted: 143;
6. the workers gave up: 71 (GAVE_UP) with their reason;
7. another node's supervisor ended the job: stop with its exit code;
8. unhealthy: counted; more than ``max_unhealthy`` of them: stop, 72 (UNHEALTHY), the hosts
   the health checks named written for the scheduler to exclude;
9. crash loop: an attempt with progress (a step past the best so far; for a script that
   writes no heartbeats, a life of ``progress_runtime_s``) resets the count; one without
   adds one, unless it is blameless (another node's doing); ``crash_loop_attempts`` in a
   row: stop, 74 (CRASH_LOOP); on several nodes only after a look at the peers: one that
   stopped beating takes one attempt off the count (the attempt died with it);
   in-place recoveries (a dead rank replaced alone, issue 33) count too (:func:`stalls`);
10. ``max_restarts`` restarts made, in-place recoveries included: stop, 75
    (RESTARTS_EXHAUSTED);
11. else restart, after an exponential backoff with jitter (:func:`backoff`).

The counts start from this node's earlier supervisors' ``attempt_end`` events (the best step
and the attempts in a row without progress: launch/outcomes.py ``history``); restarts and
unhealthy attempts count from 0 in each supervisor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from launch.nodes import Ended
from launch.outcomes import GAVE_UP, OK, PREEMPTED, UNHEALTHY
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

__all__ = [
    "Decision",
    "PREEMPTION",
    "SILENT_PEERS",
    "STOPPED_ON_REQUEST",
    "Ask",
    "AttemptEnd",
    "Preemption",
    "Restart",
    "Stop",
    "Tally",
    "backoff",
    "before_attempt",
    "decide",
    "needs_blame",
    "no_agreement",
    "preempted",
    "progress",
    "stalls",
]

STOPPED_ON_REQUEST = "stopped on request"
PREEMPTION, SILENT_PEERS = "preemption", "silent_peers"  # what an Ask asks for


@dataclass(frozen=True)
class Tally:
    """What the attempts so far add up to."""

    best: int = -1  # the highest step any attempt reached (-1: none)
    stalled: int = 0  # attempts in a row without progress past ``best`` (the crash loop)
    restarts: int = 0  # restarts this supervisor made
    unhealthy: int = 0  # attempts that ended UNHEALTHY under this supervisor
    inplace: int = 0  # in-place recoveries under this supervisor (count toward max_restarts)


@dataclass(frozen=True)
class Preemption:
    """What the workers said of their preemption: the ``preempted`` event (None: there is
    none, only ``preempting`` or nothing: they were stopped while writing its snapshot)."""

    event: Mapping[str, Any] | None


@dataclass(frozen=True)
class AttemptEnd:
    """The facts of the attempt that just ended, as the supervisor saw them."""

    number: int
    returncode: int
    outcome: str  # launch/outcomes.py: ok, gave_up, unhealthy, preempted, crash, hang
    best_step: int | None  # the highest step its ranks reached (None: no heartbeat)
    runtime_s: float
    cannot_start: str | None = None  # why the command could not start at all
    blameless: str | None = None  # why its failure was not this node's doing
    lost: str | None = None  # a node lost while the attempt waited for it
    signalled: bool = False  # a signal reached the supervisor
    gave_up_reason: str = ""  # the workers' gave_up event's reason
    ended: Ended | None = None  # another node's supervisor that stopped for good
    nnodes: int = 1
    log_path: str = ""  # the attempt's output log, named in a crash-loop verdict
    jitter: float = 0.0  # a uniform draw in [0, 1): the backoff's jitter
    preemption: Preemption | None = None  # None: not looked at yet (an Ask)
    silent_peers: tuple[str, ...] | None = None  # None: not looked at yet (an Ask)
    # Its in-place recoveries, in order: the step each resumed from (None: not journaled)
    inplace: tuple[int | None, ...] = ()


@dataclass(frozen=True)
class Restart:
    """Start the next attempt after ``delay_s``; ``tally`` counts this restart."""

    delay_s: float
    tally: Tally


@dataclass(frozen=True)
class Stop:
    """Stop with exit ``code``, saying ``reason``."""

    code: int
    reason: str
    tally: Tally = Tally()
    exclude_hosts: bool = False  # first write the hosts the health checks named


@dataclass(frozen=True)
class Ask:
    """Look up ``what`` (:data:`PREEMPTION`, :data:`SILENT_PEERS`), then decide again."""

    what: str


Decision = Restart | Stop | Ask


def progress(tally: Tally, end: AttemptEnd, sup: SupervisorPolicy) -> tuple[bool, int]:
    """(whether ``end`` made progress, the best step now). Progress is a step past the best
    so far; a script without the Guard writes no heartbeats, so for it a long life is."""
    step = end.best_step
    made = (step is not None and step > tally.best) or (
        step is None and end.runtime_s >= sup.progress_runtime_s
    )
    return made, max(tally.best, step if step is not None else tally.best)


def needs_blame(tally: Tally, end: AttemptEnd, sup: SupervisorPolicy) -> bool:
    """Whether to look up whose fault the attempt was (only a failure without progress
    can count toward the crash loop)."""
    return not progress(tally, end, sup)[0] and end.outcome != OK


def no_agreement(lost: str | None, ended: Ended | None) -> Stop:
    """Stop when the nodes never agreed on the next attempt (launch/cluster.py): a node was
    lost for node_timeout_s (77), another ended the job (its code), or a signal came (143)."""
    if lost is not None:
        return Stop(EXIT_NODE_LOST, f"node lost: {lost}")
    if ended is not None:
        return Stop(ended.exit_code, _ended_words(ended))
    return Stop(EXIT_STOPPED, STOPPED_ON_REQUEST)


def before_attempt(signalled: bool) -> Stop | None:
    """Stop before an attempt starts when a signal came (143), else start it."""
    return Stop(EXIT_STOPPED, STOPPED_ON_REQUEST) if signalled else None


def decide(tally: Tally, end: AttemptEnd, sup: SupervisorPolicy) -> Decision:
    """Restart, stop, or ask first: the rules of the module's docstring, in that order."""
    made, best = progress(tally, end, sup)
    now = replace(tally, best=best)
    stop = _stop_outright(end, now)
    if stop is not None:
        return stop
    if end.outcome == UNHEALTHY:
        now = replace(now, unhealthy=now.unhealthy + 1)
        if now.unhealthy > sup.max_unhealthy:
            why = (
                f"{now.unhealthy} unhealthy attempts, over supervisor.max_unhealthy="
                f"{sup.max_unhealthy}: check this node"
            )
            return Stop(EXIT_UNHEALTHY, why, now, exclude_hosts=True)
    if made:
        now = replace(now, stalled=stalls(end.inplace, made=True))
    elif end.blameless is None:
        now = replace(now, stalled=now.stalled + 1 + stalls(end.inplace, made=False))
    now = replace(now, inplace=now.inplace + len(end.inplace))
    if now.stalled >= sup.crash_loop_attempts and end.nnodes > 1:
        # Before a verdict that blames this node: a peer that died with the attempt looks
        # alive until its file is stale; the supervisor looks that long.
        if end.silent_peers is None:
            return Ask(SILENT_PEERS)
        if end.silent_peers:
            now = replace(now, stalled=now.stalled - 1)
    if now.stalled >= sup.crash_loop_attempts:
        why = (
            f"crash loop: {now.stalled} attempts in a row made no progress past step "
            f"{now.best} (last: {end.outcome}, exit code {end.returncode}); this looks like "
            f"a bug or a broken node, not bad luck: read {end.log_path}"
        )
        return Stop(EXIT_CRASH_LOOP, why, now)
    if now.restarts + now.inplace >= sup.max_restarts:
        why = f"supervisor.max_restarts={sup.max_restarts} spent"
        if now.inplace:
            why += f" ({now.restarts} restart(s), {now.inplace} in-place recovery(ies))"
        return Stop(EXIT_RESTARTS_EXHAUSTED, why, now)
    now = replace(now, restarts=now.restarts + 1)
    return Restart(backoff(now.restarts, sup, end.jitter), now)


def stalls(inplace: tuple[int | None, ...], made: bool) -> int:
    """What a failed attempt's in-place recoveries add to the crash-loop count: each one is
    an attempt of its own (a rank died and training went on from a snapshot). In an
    attempt without progress none made any: each counts. In one with progress, the count
    starts again at it; a recovery that resumed from no step past an earlier one of the
    attempt's (the ranks died again before the next snapshot) counts, as the attempts in a
    row that die at the same step do."""
    if not made:
        return len(inplace)
    out, best = 0, -1
    for i, step in enumerate(inplace):
        if step is not None and step > best:
            best = step
        elif i and step is not None:
            out += 1
    return out


def _stop_outright(end: AttemptEnd, now: Tally) -> Stop | Ask | None:
    """Rules 1-7: the ends no count is needed for."""
    if end.cannot_start is not None:  # restarting cannot help
        return Stop(EXIT_CANNOT_START, end.cannot_start, now)
    if end.outcome == OK:
        return Stop(EXIT_OK, "finished", now)
    if end.lost is not None:
        return Stop(EXIT_NODE_LOST, f"node lost: {end.lost}", now)
    if end.outcome == PREEMPTED:
        if end.preemption is None:
            return Ask(PREEMPTION)
        code, why = preempted(end.preemption, end.returncode)
        return Stop(code, why, now)
    if end.signalled:
        return Stop(
            EXIT_STOPPED,
            "stopped on request (signal); the workers did not stop as preempted, so no "
            "durable snapshot was written for it: a requeue resumes from the newest one",
            now,
        )
    if end.outcome == GAVE_UP:
        return Stop(EXIT_GAVE_UP, f"the workers gave up: {end.gave_up_reason}", now)
    if end.ended is not None:  # no use restarting: that node will not join
        return Stop(end.ended.exit_code, _ended_words(end.ended), now)
    return None


def preempted(p: Preemption, returncode: int) -> tuple[int, str]:
    """Exit 73 only when the preemption's durable snapshot was written (a worker's own 73
    says so too, when no event does); else 143, with how many steps are lost."""
    event = p.event
    d = event["details"] if event is not None else {}
    if d.get("persisted") is True or (event is None and returncode == EXIT_PREEMPTED):
        return EXIT_PREEMPTED, "the workers were preempted after a durable snapshot"
    if event is None:
        why = (
            "the workers were stopped while writing the durable snapshot of their "
            "preemption (no preempted event followed): it was not written"
        )
    else:
        newest = d.get("durable_step")
        why = (
            f"PREEMPTED WITHOUT A DURABLE SNAPSHOT at step {event['step']} (the write to "
            f"{d.get('url')} failed or outran supervisor.grace_s; see persist_failed in "
            "the journal): "
            + (
                f"the newest durable snapshot is step {newest}"
                if newest is not None
                else "there is no durable snapshot"
            )
            + f", so {d.get('steps_lost')} step(s) are lost and will be trained again"
        )
    return EXIT_STOPPED, f"{why}; exit {EXIT_STOPPED}, not {EXIT_PREEMPTED}"


def backoff(restart: int, sup: SupervisorPolicy, jitter: float) -> float:
    """The delay before restart number ``restart`` (1, 2, ...): ``backoff_s`` doubled per
    restart, plus up to ``backoff_s`` of jitter (``jitter``: a draw in [0, 1)), at most
    ``backoff_max_s``; 0 when ``backoff_s`` is 0. (tenacity's ``wait_exponential_jitter``,
    which the supervisor used before, with its random draw taken out.)"""
    if sup.backoff_s <= 0:
        return 0.0
    try:
        delay = sup.backoff_s * 2 ** (restart - 1) + jitter * sup.backoff_s
    except OverflowError:  # a restart count past what a float holds: the cap
        delay = sup.backoff_max_s
    return float(max(0.0, min(delay, sup.backoff_max_s)))


def _ended_words(e: Ended) -> str:
    return f"node {e.node} ended the job ({e.reason}; exit {e.exit_code}): this node stops with it"
