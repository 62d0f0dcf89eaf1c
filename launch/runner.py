"""One attempt, from its launcher's start to its end: the environment the workers read, the
launcher started (launch/launcher.py), watched until it exits or is ended (a hang,
launch/watch.py; a node lost or ahead, launch/cluster.py; a launcher that outlives its
finished ranks), and what it came to (launch/outcomes.py).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from typing import Any

from launch.alerts import Alerter
from launch.cluster import Cluster
from launch.launcher import Launcher, StopRequests, log_path, open_log
from launch.nodes import is_agent
from launch.outcomes import CRASH, HANG, OK, Attempt, classify, last_journaled_step
from launch.procs import descendants
from launch.watch import HangWatch
from orchestrator.journal import Journal
from orchestrator.policy_sections import SupervisorPolicy
from orchestrator.protocol import (
    ENV_ATTEMPT,
    ENV_POLICY,
    ENV_RUN_DIR,
    ENV_SHM_DIR,
    ENV_SUPERVISOR_PID,
)

logger = logging.getLogger(__name__)
HANG_GRACE_S = 5.0  # after SIGTERM, what a hung attempt gets before SIGKILL


def _say(msg: str) -> None:
    logger.warning("%s", msg)  # what a person watching the job must see


class AttemptRunner:
    """Runs the attempts of one node's supervisor, one at a time."""

    def __init__(
        self,
        cmd: list[str],
        run_dir: str,
        sup: SupervisorPolicy,
        launcher: Launcher,
        stops: StopRequests,
        watch: HangWatch,
        cluster: Cluster,
        alerter: Alerter,
    ) -> None:
        self.cmd, self.run_dir, self.sup = cmd, run_dir, sup
        self.launcher, self.stops, self.watch = launcher, stops, watch
        self.cluster, self.alerter = cluster, alerter
        self.node = cluster.node
        self.journal: Journal | None = None  # set once the supervisor opens it
        self.cannot_start: str | None = None  # why the command could not start at all
        self._done_since: float | None = None  # since when all its ranks said "done"
        self.hung_alone: dict[int, int] | None = None  # a hang whose culprits were killed alone

    def run(self, attempt: int, env: dict[str, str]) -> Attempt:
        """Start ``attempt`` with ``env`` (:meth:`env`), watch it to its end: its outcome."""
        started = time.monotonic()
        self.watch.begin()
        self.cluster.begin()
        self._done_since = None
        launcher = self.launcher
        with open_log(log_path(self.run_dir, attempt)) as log:
            self.cannot_start = launcher.start(self.cmd, env, log, self.stops.wake.set)
            if self.cannot_start is not None:  # no attempt can succeed
                return Attempt(attempt, 127, CRASH, None, 0.0)
            if self.stops.count:  # a signal came while we were starting it
                launcher.kill(signal.SIGTERM)
                launcher.term_sent_at = time.monotonic()
            self.hung_alone = None
            stalled = self._watch(attempt, started)
            rc = launcher.finish()
            self.watch.settle()
            ended = time.time()  # before the reading below: the ledger's end of the attempt
            runtime = time.monotonic() - started
            launcher.forget()
        journaled = last_journaled_step(self.run_dir, attempt)
        best = max((s for s in (self.watch.max_step, journaled) if s is not None), default=None)
        outcome = classify(self.run_dir, rc, attempt)
        if stalled is None and outcome == CRASH and self.hung_alone is not None:
            stalled = self.hung_alone  # replaced alone, then the agent fell back: a hang
        if stalled is not None:
            return Attempt(attempt, rc, HANG, best, runtime, stalled, ended)
        return Attempt(attempt, rc, outcome, best, runtime, None, ended)

    def env(self, attempt: int, policy_path: str, shm_dir: str) -> dict[str, str]:
        """What the workers of ``attempt`` read (orchestrator/protocol.py)."""
        return {
            **os.environ,
            ENV_POLICY: policy_path,
            ENV_RUN_DIR: self.run_dir,
            ENV_ATTEMPT: str(attempt),
            ENV_SUPERVISOR_PID: str(os.getpid()),
            ENV_SHM_DIR: shm_dir,
        }

    def _watch(self, attempt: int, started: float) -> dict[int, int] | None:
        """Poll until the launcher exits; on a hang, stop it and return the stalled ranks.
        ``started``: when the attempt started, on the monotonic clock."""
        launcher, proc = self.launcher, self.launcher.proc
        assert proc is not None
        while True:
            self.stops.wake.clear()  # before the poll: a wake after it ends the wait at once
            if proc.poll() is not None:
                return None
            self.stops.announce(self.journal, self.watch.step)
            launcher.seen.add(descendants(proc.pid))  # torchrun: workers in new sessions
            if (
                launcher.term_sent_at is not None
                and time.monotonic() - launcher.term_sent_at > self.sup.grace_s
            ):
                launcher.kill(signal.SIGKILL)
            beats = self.watch.beats(attempt)  # one read: the hang event describes it
            if self._ended_early(proc, attempt, beats):
                return None
            # During a graceful stop the ranks wait for the preemption's durable snapshot
            # (rank 0 writes it, the others wait for its verdict, beating no progress):
            # grace_s bounds that, not hang_timeout_s.
            stopping = launcher.term_sent_at is not None
            stalled = None if stopping else self.watch.stalled(beats, started)
            if stalled is not None:
                alone = self._alone(beats)
                named = self.watch.report(
                    attempt, stalled, beats, launcher, self.alerter,
                    "killing the culprits alone: the node agent replaces them"
                    if alone else "stopping",
                )  # fmt: skip
                if alone and self._kill_alone(named, beats):
                    self.hung_alone = stalled
                    continue
                # A hung rank cannot take a graceful stop (nor can the ranks blocked in a
                # collective with it): a short grace lets launchers and NCCL's flight
                # recorder write what they can, not grace_s of a snapshot nobody writes.
                launcher.terminate(min(self.sup.grace_s, HANG_GRACE_S))
                return stalled
            self.stops.wake.wait(0.5)

    def _alone(self, beats: list[dict[str, Any]]) -> bool:
        """Whether a hang's culprits may be killed alone: the launcher is the node agent
        with in place on (one node), which replaces them (orchestrator/agent.py)."""
        return bool(beats) and self.sup.in_place and self.cluster.nnodes == 1 and is_agent(self.cmd)

    def _kill_alone(self, named: list[dict[str, Any]], beats: list[dict[str, Any]]) -> bool:
        """SIGKILL the culprits alone (their peers then leave the collective they wait in
        by its error, and the agent replaces them) when they are a minority that others
        wait for; False: the attempt is ended as before."""
        ranks = {int(b["rank"]) for b in beats}
        bad = {int(c["rank"]) for c in named}
        if not bad or not bad < ranks or 2 * len(bad) > len(ranks):
            return False  # everyone stuck alike (a fabric hang), or nobody to blame
        pids = {int(b.get("pid", -1)) for b in beats if int(b["rank"]) in bad}
        if len(self.launcher.seen.send(signal.SIGKILL, only=pids)) < len(pids):
            return False  # a culprit not held (never seen, or gone): no guess at a pid
        _say(f"hang: killed rank(s) {sorted(bad)} alone; the node agent replaces them")
        self.watch.rearm(self.sup.in_place_timeout_s)
        return True

    def _ended_early(
        self, proc: subprocess.Popen[bytes], attempt: int, beats: list[dict[str, Any]]
    ) -> bool:
        """Whether the attempt was ended for another reason than a hang: its nodes will
        never all come, another node left it, or its launcher outlived its finished ranks."""
        if not beats and self.cluster.waiting_for_nodes():
            # Nothing to lose: its workers have not started.
            self.launcher.terminate(self.sup.grace_s)
            return True
        if self.launcher.term_sent_at is None and self.cluster.nnodes > 1:
            ahead = self.cluster.peers.ahead(attempt)
            if ahead is not None:
                self._leave(proc, attempt, ahead)
                return True
        return self._lingering(proc, attempt, beats)

    def _leave(self, proc: subprocess.Popen[bytes], attempt: int, ahead: str) -> None:
        """End an attempt another node has left (it proposes or runs a later one): its
        ranks are gone, so ours can only fail or hang in a collective with them. Killed, not
        stopped gracefully: a graceful stop is itself a collective the others left."""
        assert self.journal is not None
        self.cluster.left_for = ahead.split(" ", 1)[0]
        self.journal.write(
            "attempt_left",
            self.watch.step,
            {"why": ahead, "attempt": attempt, "node": self.node, "host": self.cluster.host},
        )
        _say(f"node {ahead}: ending attempt {attempt}, which it left")
        self.launcher.kill(signal.SIGKILL)
        proc.wait()

    def _lingering(
        self, proc: subprocess.Popen[bytes], attempt: int, beats: list[dict[str, Any]]
    ) -> bool:
        """Whether the launcher outlived its finished ranks for ``supervisor.linger_s``, and
        was ended. The job is finished (a ``run_end`` says so) but torchrun's exit barrier
        waits for every node's launcher of its rendezvous round, up to 300 s: one that
        restarted into another round (a replaced node) never arrives there."""
        assert self.journal is not None
        if not beats or any(b.get("phase") != "done" for b in beats):
            self._done_since = None
            return False
        now = time.monotonic()
        if self._done_since is None or now - self._done_since < self.sup.linger_s:
            self._done_since = self._done_since or now
            return False
        if classify(self.run_dir, -1, attempt) != OK:  # not finished: look again later
            self._done_since = now
            return False
        self.journal.write(
            "launcher_lingered",
            self.watch.step,
            {"seconds": round(now - self._done_since, 1), "attempt": attempt, "node": self.node},
        )
        _say(
            f"the launcher outlived its finished ranks by {now - self._done_since:.0f} s "
            "(waiting for another node's launcher in its exit barrier): ending it"
        )
        self.launcher.kill(signal.SIGTERM)
        self.launcher.kill(signal.SIGCONT)  # a stopped launcher takes SIGTERM once continued
        # Its ranks are done, so nothing is left to save; and a launcher blocked in the
        # barrier's store wait runs no Python signal handler until that returns: grace_s
        # (the ranks' time to write a snapshot) would only delay the end by as much.
        self.launcher.wait_or_kill(min(self.sup.grace_s, HANG_GRACE_S))
        return True
