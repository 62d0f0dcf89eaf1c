"""The supervisor: runs the launcher command, restarts it, stops it, and says why.

One supervisor per node wraps whatever starts the workers (``torchrun``, ``deepspeed``,
``python``, ``srun``). It talks to the workers only through the environment
(``ORCHESTRATOR_POLICY``, ``ORCHESTRATOR_RUN_DIR``, ``ORCHESTRATOR_ATTEMPT``), the run
directory (journal, heartbeats) and exit codes, so it also restarts scripts that never
import the library.

Every attempt runs in its own session (process group), its output streamed to the console
and to ``RUN_DIR/attempts/<n>/output.log``. The outcome of an attempt comes from the exit
code, or, because torchrun reports 1 whatever its workers exited with, from the journal
events the workers wrote for that attempt (``gave_up``, ``preempted``, ``unhealthy``).

This module composes the parts and journals what they did: the decisions (restart after how
long, or stop with which code) are launch/decide.py's, a pure function; one attempt's
process and its watch, launch/runner.py (launch/launcher.py, the process and the signals;
launch/watch.py, hang detection); the other nodes, launch/cluster.py; the side services
(exporter, buddy replica, janitor, alerts), launch/services.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import tempfile
from dataclasses import replace

from launch.cluster import Cluster
from launch.decide import (
    PREEMPTION,
    STOPPED_ON_REQUEST,
    Ask,
    AttemptEnd,
    Preemption,
    Restart,
    Stop,
    Tally,
    before_attempt,
    decide,
    needs_blame,
    no_agreement,
    progress,
)
from launch.launcher import Launcher, StopRequests, log_path
from launch.nodes import IN_ATTEMPT
from launch.outcomes import (
    GAVE_UP,
    HANG,
    Attempt,
    exclude_hosts,
    gave_up_reason,
    history,
    inplace_steps,
    next_attempt_number,
    preemption,
)
from launch.procs import describe
from launch.runner import HANG_GRACE_S, AttemptRunner
from launch.services import Services
from launch.watch import HangWatch
from orchestrator import events
from orchestrator.journal import Journal
from orchestrator.policy import Policy
from orchestrator.protocol import (
    EVENT_ATTEMPT_START,
    EVENT_RESTART,
    EVENT_SUPERVISOR_EXIT,
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    EXIT_NODE_LOST,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_STOPPED,
    EXIT_UNHEALTHY,
    POLICY_NAME,
    SUPERVISOR_RANK,
    node_name,
)
from orchestrator.rundir import write_policy

__all__ = ["HANG_GRACE_S", "Supervisor"]

logger = logging.getLogger(__name__)
# How long the exit code of a preemption waits for the preempted event that says whether
# its durable snapshot was written (the rank that commits may be on another node).
PREEMPTED_WAIT_S = 10.0
ALERT_ON_EXIT = {  # the supervisor's exits that page someone (alerts.events)
    EXIT_GAVE_UP: "gave_up",
    EXIT_UNHEALTHY: "unhealthy",
    EXIT_CRASH_LOOP: "crash_loop",
    EXIT_NODE_LOST: "node_lost",
    EXIT_RESTARTS_EXHAUSTED: "restarts_exhausted",
}


class Supervisor:
    def __init__(self, policy: Policy, run_dir: str, cmd: list[str]) -> None:
        self.policy = policy
        self.sup = sup = policy.supervisor
        self.run_dir = run_dir = os.path.abspath(run_dir)
        self.cmd = cmd
        os.makedirs(run_dir, exist_ok=True)
        self.policy_path = self._write_policy(policy)
        self.host = socket.gethostname()
        self.node = node = node_name()  # the hostname, or $ORCHESTRATOR_NODE when simulating
        self.launcher = Launcher()
        self.stops = StopRequests(self.launcher, node, sup.grace_s)
        # The other nodes' supervisors (launch/cluster.py): one attempt id, one end.
        self.cluster = Cluster(
            run_dir, node, cmd, sup, step=lambda: self.watch.step, wake=self.stops.wake
        )
        peers = self.cluster.peers
        self.watch = HangWatch(
            run_dir, node, sup, failing=lambda: peers.failing, refresh=peers.refresh
        )
        self.services = Services(policy, run_dir, node, self.cluster.peers)
        self.runner = AttemptRunner(
            cmd, run_dir, sup, self.launcher, self.stops, self.watch, self.cluster,
            self.services.alerter,
        )  # fmt: skip
        self._attempt = 0  # the current attempt
        self.journal: Journal | None = None

    # --- the loop -------------------------------------------------------------------------
    def run(self) -> int:
        """Run attempts until one succeeds or a stop rule fires; return the exit code."""
        self.stops.install()
        self.cluster.start()
        self.services.start()
        code, why = 1, "the supervisor failed (see its traceback)"
        try:
            code, why = self._loop()
            return code
        finally:
            if self.services.replica is not None:
                self.services.replica.close()
            # The other nodes stop with us (launch/nodes.py), and flush with us: first.
            self.cluster.peers.exited(code, why)
            self.services.close(code, self._attempt, self.policy_path)
            if os.path.dirname(self.policy_path) != self.run_dir:  # a temporary one
                with contextlib.suppress(OSError):
                    os.unlink(self.policy_path)
            self.stops.restore()

    def _loop(self) -> tuple[int, str]:
        attempt = next_attempt_number(self.run_dir, self.node)
        self.journal = journal = Journal(self.run_dir, SUPERVISOR_RANK, attempt)
        for part in (self.watch, self.cluster, self.services, self.runner):
            part.journal = journal
        self.services.open_exporter(journal)
        best, stalled = history(self.run_dir, self.node)
        tally = Tally(best=best, stalled=stalled)
        try:
            while True:
                if self.cluster.nnodes > 1:
                    agreed = self.cluster.agree(attempt, self.stops)
                    if agreed is None:  # a node is lost or ended the job, or a signal came
                        c = self.cluster
                        return self._stop(no_agreement(c.lost, c.ended), tally.best)
                    attempt = agreed
                journal.attempt = self._attempt = attempt
                self.cluster.peers.at(attempt, IN_ATTEMPT)
                stop = before_attempt(self.stops.count > 0)
                if stop is not None:
                    return self._stop(stop, tally.best)
                journal.write(
                    EVENT_ATTEMPT_START,
                    tally.best,
                    {"cmd": self.cmd, "host": self.host, "node": self.node},
                )
                self.services.before_attempt(attempt)
                env = self.runner.env(attempt, self.policy_path, self.services.shm_dir)
                a = self.runner.run(attempt, env)
                decision = self._after(a, tally)
                if isinstance(decision, Stop):
                    return self._stop(decision, decision.tally.best)
                tally = decision.tally
                if self._restart(a, decision):  # a signal came during the backoff
                    return self._stop(Stop(EXIT_STOPPED, STOPPED_ON_REQUEST), tally.best)
                # One past ours, or the attempt the other nodes are already in (launch/nodes.py).
                attempt = max(attempt + 1, next_attempt_number(self.run_dir, self.node))
        finally:
            self.services.quiesce()  # they journal: before the journal closes
            journal.close()

    def _after(self, a: Attempt, tally: Tally) -> Stop | Restart:
        """What to do after attempt ``a`` (launch/decide.py), with its end journaled and the
        facts the decision asks for looked up."""
        end = AttemptEnd(
            number=a.number,
            returncode=a.returncode,
            outcome=a.outcome,
            best_step=a.best_step,
            runtime_s=a.runtime_s,
            cannot_start=self.runner.cannot_start,
            nnodes=self.cluster.nnodes,
            log_path=log_path(self.run_dir, a.number),
            jitter=random.random(),
        )
        if end.cannot_start is None:  # an attempt that never started has no end
            # Not this node's failure, nor the job's: it does not count toward the crash
            # loop (a node that is gone counts toward node_timeout_s instead).
            blameless = self.cluster.blameless() if needs_blame(tally, end, self.sup) else None
            self._journal_end(a, progress(tally, end, self.sup)[1], blameless)
            end = replace(
                end,
                blameless=blameless,
                lost=self.cluster.lost,
                signalled=self.stops.count > 0,
                gave_up_reason=gave_up_reason(self.run_dir, a.number)
                if a.outcome == GAVE_UP
                else "",
                ended=self.cluster.ended_now(),
                inplace=inplace_steps(self.run_dir, a.number),
            )
        decision = decide(tally, end, self.sup)
        while isinstance(decision, Ask):
            end = self._answer(decision, end, progress(tally, end, self.sup)[1])
            decision = decide(tally, end, self.sup)
        if isinstance(decision, Stop) and decision.exclude_hosts:
            exclude_hosts(self.run_dir)  # the scheduler requeues without them
        return decision

    def _answer(self, ask: Ask, end: AttemptEnd, best: int) -> AttemptEnd:
        """Look up what the decision asks for (each may take seconds)."""
        if ask.what == PREEMPTION:  # 73 only when its durable snapshot was written
            event = preemption(self.run_dir, end.number, PREEMPTED_WAIT_S)
            return replace(end, preemption=Preemption(event))
        # Before a verdict that blames this node: a peer that died with the attempt looks
        # alive until its file is stale_s old. Look that long.
        peers = self.cluster.peers
        gone = peers.silent(peers.stale_s)
        if gone:
            assert self.journal is not None
            self.journal.write(
                "crash_not_counted",
                best,
                {"why": f"node(s) {gone} stopped beating", "node": self.node},
            )
        return replace(end, silent_peers=tuple(gone))

    def _journal_end(self, a: Attempt, best: int, blameless: str | None) -> None:
        assert self.journal is not None
        end = events.AttemptEnd(
            outcome=a.outcome,
            returncode=a.returncode,
            best_step=a.best_step,
            ended_at=a.ended_at,
            # When this node's ranks last moved (the goodput ledger's end of useful work for
            # an attempt killed before its metrics were written).
            progress_time=self.watch.progress_time(a.number),
            node=self.node,
            host=self.host,
        )
        self.journal.emit(best, end, stalled=a.stalled, blameless=blameless)

    def _restart(self, last: Attempt, r: Restart) -> bool:
        """Journal and say the restart, then wait its backoff; True when a signal came."""
        assert self.journal is not None
        attempt = last.number
        self.journal.write(
            EVENT_RESTART,
            r.tally.best,
            {
                "cause": last.outcome,
                "returncode": last.returncode,
                "restart": r.tally.restarts,
                "next_attempt": attempt + 1,
                "delay_s": round(r.delay_s, 3),
                "node": self.node,
            },
        )
        _say(
            f"attempt {attempt} ended: {last.outcome} "
            f"({describe(last.returncode, killed_by_us=last.outcome == HANG)}); "
            f"restart {r.tally.restarts} in {r.delay_s:.1f} s"
        )
        return self.stops.sleep(r.delay_s)

    def _stop(self, stop: Stop, best: int) -> tuple[int, str]:
        assert self.journal is not None
        self.stops.announce(self.journal, self.watch.step)
        code, why = stop.code, stop.reason
        event = self.journal.write(
            EVENT_SUPERVISOR_EXIT, best, {"exit_code": code, "reason": why, "node": self.node}
        )
        if code in ALERT_ON_EXIT:
            self.services.alerter.alert(ALERT_ON_EXIT[code], event, self.journal, best)
        _say(f"{why}; exit {code}")
        return code, why

    def _write_policy(self, policy: Policy) -> str:
        """The resolved policy for the workers (``ORCHESTRATOR_POLICY``): in the run directory,
        or, when it cannot be written there (a full disk), in a temporary file. Bookkeeping
        must not stop the job; the workers need the policy, not its place."""
        path = os.path.join(self.run_dir, POLICY_NAME)
        try:
            write_policy(path, policy)
            return path
        except OSError as err:
            fd, tmp = tempfile.mkstemp(prefix="orchestrator-policy-", suffix=".yaml")
            os.close(fd)
            write_policy(tmp, policy)
            _say(f"{path} cannot be written ({err}); the workers read the policy from {tmp}")
            return tmp


def _say(msg: str) -> None:
    logger.warning("%s", msg)  # what a person watching the job must see
