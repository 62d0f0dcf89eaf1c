"""What an attempt came to, and what earlier attempts in the run directory did.

The outcome comes from the exit code, or, because torchrun reports 1 whatever its workers
exited with, from the journal events the workers wrote for that attempt.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from orchestrator.events import (
    AttemptEnd,
    AttemptStart,
    Event,
    GaveUp,
    InplaceRecovery,
    RankReplaced,
    RunEnd,
    Unhealthy,
    of,
)
from orchestrator.journal import read_events
from orchestrator.protocol import (
    EVENT_GAVE_UP,
    EVENT_PREEMPTED,
    EVENT_PREEMPTING,
    EVENT_UNHEALTHY,
    EXCLUDE_NAME,
    EXIT_GAVE_UP,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_UNHEALTHY,
)
from orchestrator.rundir import write_atomic

logger = logging.getLogger(__name__)

OK, GAVE_UP, UNHEALTHY, PREEMPTED, CRASH, HANG = (
    "ok",
    "gave_up",
    "unhealthy",
    "preempted",
    "crash",
    "hang",
)
_BY_CODE = {
    EXIT_OK: OK,
    EXIT_GAVE_UP: GAVE_UP,
    EXIT_UNHEALTHY: UNHEALTHY,
    EXIT_PREEMPTED: PREEMPTED,
}
# "preempting" is written before the snapshot: a worker killed while writing it was still
# preempted (it resumes from the previous snapshot).
_BY_EVENT = {
    EVENT_GAVE_UP: GAVE_UP,
    EVENT_UNHEALTHY: UNHEALTHY,
    EVENT_PREEMPTED: PREEMPTED,
    EVENT_PREEMPTING: PREEMPTED,
}


@dataclass
class Attempt:
    number: int
    returncode: int
    outcome: str
    best_step: int | None  # highest step any local rank reported in this attempt
    runtime_s: float
    stalled: dict[int, int] | None = None  # rank -> last step, when it hung
    ended_at: float | None = None  # when its processes were gone (time.time())


def classify(run_dir: str, rc: int, attempt: int) -> str:
    """The outcome of an attempt, from its exit code or its workers' journal events. A run
    whose workers journaled a finished end is OK whatever the launcher exited with after
    it (a stop request that came as it finished, a teardown that crashed): restarting it
    would find nothing left to train."""
    if rc in _BY_CODE:
        return _BY_CODE[rc]
    finished = False
    for e in read_events(run_dir).events:  # torchrun masks its workers' codes
        if e.attempt != attempt:
            continue
        if e.kind in _BY_EVENT:
            return _BY_EVENT[e.kind]
        if isinstance(e.record, RunEnd) and e.record.status == "finished":
            finished = True
    return OK if finished else CRASH


def preemption(run_dir: str, attempt: int, wait_s: float = 0.0) -> dict[str, Any] | None:
    """The ``preempted`` event of ``attempt`` (whether its durable snapshot was written:
    ``persisted``), waiting up to ``wait_s`` for it when only ``preempting`` is there (the
    rank that commits may be on another node, its event in flight); None when the workers
    never got that far (stopped while writing it)."""
    deadline = time.monotonic() + wait_s
    while True:
        said = [e for e in read_events(run_dir).events if e.attempt == attempt
                and e.kind in (EVENT_PREEMPTED, EVENT_PREEMPTING)]  # fmt: skip
        done = [e for e in said if e.kind == EVENT_PREEMPTED]
        if done:
            return done[-1].wire()
        if not said or time.monotonic() >= deadline:
            return None
        time.sleep(0.2)


def gave_up_reason(run_dir: str, attempt: int) -> str:
    """Why the workers of ``attempt`` gave up, from their ``gave_up`` event."""
    for e in read_events(run_dir).of(GaveUp):
        if e.attempt == attempt:
            return str(e.details.get("why", "a budget is spent"))
    return "a budget is spent, or input a restart cannot fix; see gave_up in the journal"


def last_journaled_step(run_dir: str, attempt: int) -> int | None:
    """The highest step the workers of ``attempt`` journaled (a fault, a snapshot, an
    incident): a crash's step even when the last heartbeat is an interval older."""
    steps = [e.step for e in read_events(run_dir).events if e.attempt == attempt and e.rank >= 0]
    return max(steps, default=None)


def exclude_hosts(run_dir: str) -> list[str]:
    """Add the hosts the health checks named (every ``unhealthy`` event) to
    ``RUN_DIR/exclude_hosts``, one per line, for the scheduler to leave out on requeue
    (launch/slurm.sbatch passes them to ``--exclude``); returns the file's hosts."""
    path = os.path.join(run_dir, EXCLUDE_NAME)
    hosts: set[str] = set()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            hosts = {line.strip() for line in f if line.strip()}
    for e in read_events(run_dir).of(Unhealthy):
        hosts.update(e.record.hosts)
    try:
        write_atomic(path, "".join(f"{h}\n" for h in sorted(hosts)))
    except OSError as err:  # a full disk: the exit code still says unhealthy
        logger.error("%s cannot be written (%s): exclude %s by hand", path, err, sorted(hosts))
    return sorted(hosts)


def node_of(event: Event[Any] | dict[str, Any]) -> Any:
    """The node a supervisor event came from (journals before nodes had names: the host)."""
    d = event.details if isinstance(event, Event) else event["details"]
    return d.get("node", d.get("host"))


def next_attempt_number(run_dir: str, node: str) -> int:
    """The attempt this node starts next: one past its own last (attempts continue across
    supervisor restarts), or the attempt another node has started, when higher: a node that
    comes back late joins the attempt the others wait in, under the same id."""
    own = others = -1
    for e in read_events(run_dir).of(AttemptStart):
        if node_of(e) == node:
            own = max(own, e.attempt)
        else:
            others = max(others, e.attempt)
    return max(own + 1, others)


def inplace_steps(run_dir: str, attempt: int) -> tuple[int | None, ...]:
    """The in-place recoveries of ``attempt`` (issue 33), in order: the step each one
    resumed from (rank 0's ``inplace_recovery``), None where it was not journaled (the
    first step after it never committed). One per generation: every node's agent that
    took part may journal the same one."""
    events = [e for e in read_events(run_dir).events if e.attempt == attempt]
    resumed = {e.record.generation: e.step for e in of(events, InplaceRecovery) if e.rank == 0}
    gens = sorted({e.record.generation for e in of(events, RankReplaced)})
    return tuple(resumed.get(g) for g in gens)


def history(run_dir: str, node: str) -> tuple[int, int]:
    """(best step so far, attempts in a row without progress) from this node's earlier
    supervisors, so the crash-loop rule also holds across requeues."""
    best, stalled = -1, 0
    for e in read_events(run_dir).of(AttemptEnd):
        if node_of(e) not in (node, None):
            continue
        step = e.record.best_step
        if e.record.outcome == OK or (step is not None and step > best):
            stalled = 0
        else:
            stalled += 1
        best = max(best, step if step is not None else best)
    return best, stalled
