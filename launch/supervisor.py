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
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from tenacity import wait_exponential_jitter

from launch.alerts import Alerter
from launch.endpoint import Endpoint, is_local, launcher_endpoint, route_addr, unreachable
from launch.exporter import Exporter
from launch.hangs import collect, culprit_words
from launch.janitor import Janitor
from launch.lock import lock_path
from launch.nodes import AGREEING, IN_ATTEMPT, Ended, Peers, agree, launcher_nodes
from launch.outcomes import (
    CRASH,
    GAVE_UP,
    HANG,
    OK,
    PREEMPTED,
    UNHEALTHY,
    Attempt,
    classify,
    exclude_hosts,
    gave_up_reason,
    history,
    last_journaled_step,
    next_attempt_number,
    preemption,
)
from launch.procs import Handles, descendants, describe, die_with_parent, proc_state, tee
from launch.progress import Stalls
from launch.replica import Replicator
from orchestrator.heartbeat import progress_time, read_heartbeats, suspects
from orchestrator.journal import Journal
from orchestrator.policy import Policy
from orchestrator.protocol import (
    ATTEMPTS_DIR,
    ENV_ATTEMPT,
    ENV_POLICY,
    ENV_RUN_DIR,
    ENV_SHM_DIR,
    ENV_SUPERVISOR_PID,
    EVENT_ATTEMPT_END,
    EVENT_ATTEMPT_START,
    EVENT_EXPORTER,
    EVENT_HANG,
    EVENT_NODE_LOST,
    EVENT_RESTART,
    EVENT_STOP_REQUESTED,
    EVENT_SUPERVISOR_EXIT,
    EXIT_CANNOT_START,
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    EXIT_NODE_LOST,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_STOPPED,
    EXIT_UNHEALTHY,
    POLICY_NAME,
    SUPERVISOR_RANK,
    clock_id,
    node_name,
    shm_root,
)
from orchestrator.rundir import write_policy
from orchestrator.stacks import STACK_SIGNAL

logger = logging.getLogger(__name__)
HANG_GRACE_S = 5.0  # after SIGTERM, what a hung attempt gets before SIGKILL
# Longer than this between two looks at the heartbeats, the supervisor itself did not run
# (a paused VM, a stopped process): hang ages restart (launch/progress.py). Bounded by half
# the hang timeout, and never under what a slow look can take.
PAUSE_S, MIN_PAUSE_S = 30.0, 5.0
# How long the exit code of a preemption waits for the preempted event that says whether
# its durable snapshot was written (the rank that commits may be on another node).
PREEMPTED_WAIT_S = 10.0
# How long a launcher may outlive its finished ranks (torchrun's exit barrier waits for the
# other nodes' launchers: seconds when they finish together, 300 s for one that never comes).
LINGER_S = 30.0
PROBED_PEERS = 4  # how many peers the store's host probes after a failed attempt
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
        self.sup = policy.supervisor
        self.run_dir = os.path.abspath(run_dir)
        self.cmd = cmd
        os.makedirs(self.run_dir, exist_ok=True)
        self.policy_path = self._write_policy(policy)
        self.host = socket.gethostname()
        self.node = node_name()  # the hostname, or $ORCHESTRATOR_NODE when simulating nodes
        self._signals = 0
        self._wake = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._term_sent_at: float | None = None
        self._max_step: int | None = None  # highest step seen in the current attempt
        self._seen = Handles()  # every process seen under the current attempt
        # The other nodes' supervisors (launch/nodes.py): one attempt id, one end.
        self.nnodes = launcher_nodes(cmd, os.environ)
        self.peers = Peers(self.run_dir, self.node, self.nnodes, self.sup.heartbeat_interval_s)
        # Where the launcher's rendezvous meets, and whether this node serves it
        # (launch/endpoint.py); a node that does not waits for it to answer.
        self._endpoint: Endpoint | None = (
            launcher_endpoint(cmd, os.environ) if self.nnodes > 1 else None
        )
        self._store_here = self._endpoint is not None and is_local(self._endpoint.host)
        self._left_for: str | None = None  # the node that left the current attempt first
        # The node's shared-memory ring (snapshot.shared_memory): kept across attempts,
        # removed when this supervisor stops for good.
        self.shm_dir = shm_root(policy.snapshot.shm_dir, self.run_dir, self.node)
        self._attempt = 0  # the current attempt
        self._lost: str | None = None  # why the current attempt was stopped for a lost node
        self._ended: Ended | None = None  # a peer that ended the job while we waited for it
        # snapshot.replicate: buddy: our ring's copy on another node, theirs here.
        self.replica: Replicator | None = None
        self._cannot_start: str | None = None  # why the command could not start at all
        self._announced = 0  # signals said to the person watching (outside the handler)
        self._first_signal_at: float | None = None  # set by the handler
        self._stop_journaled = False  # stop_requested written (once the journal is open)
        self.alerter = Alerter(policy.alerts, self.run_dir, self.node)
        self.exporter: Exporter | None = None  # export.prometheus_port
        self._blind: tuple[float, str] | None = None  # (since, why) hang judgement paused

    # --- the loop -------------------------------------------------------------------------
    def run(self) -> int:
        """Run attempts until one succeeds or a stop rule fires; return the exit code."""
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        self.peers.start()
        # Removes the ring should this process die without the finally below (SIGKILL).
        janitor = (
            Janitor(self.shm_dir, lock_path(self.run_dir, self.node))
            if self.policy.snapshot.shared_memory
            else None
        )
        if self.policy.snapshot.replicate == "buddy" and self.nnodes > 1:
            self.replica = Replicator(
                self.run_dir,
                self.node,
                self.shm_dir,
                self.peers.others,
                lambda kind, step, details: self.journal.write(kind, step, details),
                self.sup.heartbeat_interval_s,
            )
            self.peers.publish(replica=self.replica.address)
        if self._endpoint is not None:  # what the others see this node as (_store_words)
            self.peers.publish(addr=route_addr(self._endpoint.host))
        code, why = 1, "the supervisor failed (see its traceback)"
        try:
            code, why = self._loop()
            return code
        finally:
            if self.replica is not None:
                self.replica.close()
            # The other nodes stop with us (launch/nodes.py), and flush with us: first.
            self.peers.exited(code, why)
            if code != EXIT_OK and os.path.isdir(self.shm_dir):
                self._flush()
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            if janitor is not None:
                janitor.close()
            self.alerter.wait()
            if self.exporter is not None:
                self.exporter.close()
            if os.path.dirname(self.policy_path) != self.run_dir:  # a temporary one
                with contextlib.suppress(OSError):
                    os.unlink(self.policy_path)
            for s, h in old.items():
                signal.signal(s, h)

    def _loop(self) -> tuple[int, str]:
        attempt = next_attempt_number(self.run_dir, self.node)
        self.journal = journal = Journal(self.run_dir, SUPERVISOR_RANK, attempt)
        export = self.policy.export
        if export.prometheus_port is not None:
            try:
                self.exporter = Exporter(
                    self.run_dir, self.node, export.prometheus_port, export.prometheus_addr
                )
            except (RuntimeError, OSError) as err:  # not installed, port taken: say, go on
                where = f"{export.prometheus_addr}:{export.prometheus_port}"
                self._say(
                    f"no Prometheus endpoint on {where}: {err}; training goes on without it "
                    "(choose another export.prometheus_port, or 0 for a free one)"
                )
                journal.write(EVENT_EXPORTER, -1, {"error": str(err), "node": self.node})
            else:
                address = f"{socket.gethostname()}:{self.exporter.port}"
                self.peers.publish(prometheus=address)
                journal.write(
                    EVENT_EXPORTER,
                    -1,
                    {"port": self.exporter.port, "addr": export.prometheus_addr,
                     "address": address, "node": self.node},
                )  # fmt: skip
        restarts = unhealthy = 0
        best, stalled_attempts = history(self.run_dir, self.node)
        try:
            while True:
                if self.nnodes > 1:
                    agreed = self._agree(attempt)
                    if agreed is None:  # a node is lost or ended the job, or a signal came
                        return self._no_attempt(journal, best)
                    attempt = agreed
                journal.attempt = attempt
                self._attempt = attempt
                self.peers.at(attempt, IN_ATTEMPT)
                if self._signals:
                    return self._stop(journal, EXIT_STOPPED, "stopped on request", best)
                journal.write(
                    EVENT_ATTEMPT_START,
                    best,
                    {"cmd": self.cmd, "host": self.host, "node": self.node},
                )
                if self.replica is not None:
                    if attempt > 0:  # a ring lost with its node (or supervisor): a copy
                        self.replica.fetch_if_empty()
                    self.replica.start()
                a = self._run_attempt(attempt)
                if self._cannot_start is not None:  # restarting cannot help: say so at once
                    return self._stop(journal, EXIT_CANNOT_START, self._cannot_start, best)
                progressed = (a.best_step is not None and a.best_step > best) or (
                    # A script without the Guard writes no heartbeats: a long life is progress.
                    a.best_step is None and a.runtime_s >= self.sup.progress_runtime_s
                )
                best = max(best, a.best_step if a.best_step is not None else best)
                # Not this node's failure, nor the job's: it does not count toward the crash
                # loop (a node that is gone counts toward node_timeout_s instead).
                blameless = None if progressed or a.outcome == OK else self._blameless()
                journal.write(
                    EVENT_ATTEMPT_END,
                    best,
                    {
                        "returncode": a.returncode,
                        "outcome": a.outcome,
                        "best_step": a.best_step,
                        "stalled": a.stalled,
                        # When this node's ranks last moved (the goodput ledger's end of
                        # useful work for an attempt killed before its metrics were written).
                        "progress_time": self._progress_time(attempt),
                        "ended_at": a.ended_at,
                        "blameless": blameless,
                        "host": self.host,
                        "node": self.node,
                    },
                )
                if a.outcome == OK:
                    return self._stop(journal, EXIT_OK, "finished", best)
                if self._lost is not None:
                    return self._stop(journal, EXIT_NODE_LOST, f"node lost: {self._lost}", best)
                if a.outcome == PREEMPTED:  # 73 only when its durable snapshot was written
                    code, why = self._preempted(attempt, a.returncode)
                    return self._stop(journal, code, why, best)
                if self._signals:
                    return self._stop(
                        journal,
                        EXIT_STOPPED,
                        "stopped on request (signal); the workers did not stop as preempted, "
                        "so no durable snapshot was written for it: a requeue resumes from the "
                        "newest one",
                        best,
                    )
                if a.outcome == GAVE_UP:
                    return self._stop(
                        journal,
                        EXIT_GAVE_UP,
                        f"the workers gave up: {gave_up_reason(self.run_dir, attempt)}",
                        best,
                    )
                ended = self._ended or (self.peers.ended() if self.nnodes > 1 else None)
                if ended is not None:  # no use restarting: that node will not join
                    return self._stop(
                        journal,
                        ended.exit_code,
                        f"node {ended.node} ended the job ({ended.reason}; exit "
                        f"{ended.exit_code}): this node stops with it",
                        best,
                    )
                if a.outcome == UNHEALTHY:
                    unhealthy += 1
                    if unhealthy > self.sup.max_unhealthy:
                        exclude_hosts(self.run_dir)  # the scheduler requeues without them
                        return self._stop(
                            journal,
                            EXIT_UNHEALTHY,
                            f"{unhealthy} unhealthy "
                            "attempts, over supervisor.max_unhealthy="
                            f"{self.sup.max_unhealthy}: check this node",
                            best,
                        )
                if progressed:
                    stalled_attempts = 0
                elif blameless is None:
                    stalled_attempts += 1
                if stalled_attempts >= self.sup.crash_loop_attempts and self.nnodes > 1:
                    # Before a verdict that blames this node: a peer that died with the
                    # attempt looks alive until its file is stale_s old. Look that long.
                    gone = self.peers.silent(self.peers.stale_s)
                    if gone:
                        stalled_attempts -= 1
                        journal.write(
                            "crash_not_counted",
                            best,
                            {"why": f"node(s) {gone} stopped beating", "node": self.node},
                        )
                if stalled_attempts >= self.sup.crash_loop_attempts:
                    return self._stop(
                        journal,
                        EXIT_CRASH_LOOP,
                        f"crash loop: {stalled_attempts} attempts in a row made no progress "
                        f"past step {best} (last: {a.outcome}, exit code {a.returncode}); "
                        f"this looks like a bug or a broken node, not bad luck: read "
                        f"{self._log_path(attempt)}",
                        best,
                    )
                if restarts >= self.sup.max_restarts:
                    return self._stop(
                        journal,
                        EXIT_RESTARTS_EXHAUSTED,
                        f"supervisor.max_restarts={self.sup.max_restarts} spent",
                        best,
                    )
                restarts += 1
                delay = self._backoff(restarts)
                journal.write(
                    EVENT_RESTART,
                    best,
                    {
                        "cause": a.outcome,
                        "returncode": a.returncode,
                        "restart": restarts,
                        "next_attempt": attempt + 1,
                        "delay_s": round(delay, 3),
                        "node": self.node,
                    },
                )
                self._say(
                    f"attempt {attempt} ended: {a.outcome} "
                    f"({describe(a.returncode, killed_by_us=a.outcome == HANG)}); "
                    f"restart {restarts} in {delay:.1f} s"
                )
                if self._sleep(delay):
                    return self._stop(journal, EXIT_STOPPED, "stopped on request", best)
                # One past ours, or the attempt the other nodes are already in (launch/nodes.py).
                attempt = max(attempt + 1, next_attempt_number(self.run_dir, self.node))
        finally:
            if self.replica is not None:  # it journals: before the journal closes
                self.replica.close()
            self.alerter.wait()  # the alerts journal their outcome too
            journal.close()

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds``, or less if a signal comes (then True)."""
        deadline = time.monotonic() + seconds
        while True:
            self._wake.clear()  # set by other wakes too (the launcher's end of output)
            if self._signals:  # after the clear: the handler counts before it wakes us
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._wake.wait(left)

    def _agree(self, attempt: int) -> int | None:
        """The attempt every node starts next, agreed through the run directory before the
        launcher starts (launch/nodes.py :func:`agree`); None when it never can be: a node
        lost for supervisor.node_timeout_s (``_lost``), one that ended the job (``_ended``),
        a signal. A node that is not the store's host also waits for the rendezvous endpoint
        to answer: an attempt started across a cut network only fails on the launcher's
        timeout, and the time that takes counts toward node_timeout_s, never a crash loop."""
        said: set[str] = set()
        cut_since: float | None = None
        probed_at, cut = -float("inf"), None
        while not self._signals:
            self.peers.at(attempt, AGREEING)
            attempt, start = agree(attempt, self.peers.live(), self.nnodes)
            self.peers.at(attempt, AGREEING)
            lost = self.peers.lost(self.sup.node_timeout_s)
            if lost is not None:
                self._note_lost(lost + self._store_words())
                return None
            self._ended = self.peers.ended(fresh=False)
            if self._ended is not None:
                return None
            now = time.monotonic()
            if self._endpoint is not None and not self._store_here and now - probed_at > 2.0:
                probed_at, cut = now, unreachable(self._endpoint)
                if cut is not None and cut_since is None:
                    self.journal.write(
                        "endpoint_unreachable",
                        -1,
                        {"endpoint": str(self._endpoint), "why": cut, "node": self.node,
                         "node_timeout_s": self.sup.node_timeout_s},
                    )  # fmt: skip
                cut_since = (cut_since or now) if cut is not None else None
            if cut is not None and cut_since is not None:
                waited = time.monotonic() - cut_since
                if waited > self.sup.node_timeout_s:
                    self._note_lost(
                        f"the launcher's rendezvous endpoint {self._endpoint} cannot be reached "
                        f"from node {self.node} for {waited:.0f} s ({cut}; "
                        f"supervisor.node_timeout_s={self.sup.node_timeout_s:g}){self._store_words()}"
                        ": mend the network between the nodes, then requeue the job; the run "
                        "resumes from its newest durable snapshot"
                    )
                    return None
                wait = f"the rendezvous endpoint {self._endpoint} ({cut})"
            elif start:
                return attempt
            else:
                wait = f"the nodes to agree on attempt {attempt}"
            if wait not in said:
                said.add(wait)
                self._say(f"waiting for {wait}")
            # Every node reads every node's file at each look: as rarely as liveness is
            # judged (Peers.poll_s), so many nodes stay cheap on the shared file system.
            self._wake.wait(self.peers.poll_s)
        return None

    def _no_attempt(self, journal: Journal, best: int) -> tuple[int, str]:
        """Stop, when the nodes never agreed on the next attempt (see :meth:`_agree`)."""
        if self._lost is not None:
            return self._stop(journal, EXIT_NODE_LOST, f"node lost: {self._lost}", best)
        if self._ended is not None:
            e = self._ended
            return self._stop(
                journal,
                e.exit_code,
                f"node {e.node} ended the job ({e.reason}; exit {e.exit_code}): this node "
                "stops with it",
                best,
            )
        return self._stop(journal, EXIT_STOPPED, "stopped on request", best)

    def _blameless(self) -> str | None:
        """Why the attempt that just failed is not this node's doing, if so: it was ended
        because another node had left it, a node's supervisor is not alive, or the network
        between the nodes does not answer (the rendezvous endpoint from a node that does not
        hold the store; the other nodes from the one that does)."""
        if self._left_for is not None:
            return f"ended for node {self._left_for}"
        if self.nnodes <= 1:
            return None
        live = self.peers.live()
        if len(live) < self.nnodes - 1:
            return f"{self.nnodes - 1 - len(live)} node(s) without a live supervisor"
        if self._endpoint is None:
            return None
        if not self._store_here:
            cut = unreachable(self._endpoint)
            return f"the rendezvous endpoint does not answer: {cut}" if cut else None
        # A few peers say whether this node's network is cut (each probe may take its
        # timeout): on a thousand nodes, probing them all would stall the restart.
        for node, info in sorted(live.items())[:PROBED_PEERS]:
            addr = info.get("addr")
            cut = unreachable(Endpoint(str(addr), self._endpoint.port)) if addr else None
            if cut is not None:
                return f"node {node} does not answer: {cut}"
        return None

    def _store_words(self) -> str:
        """Which node holds the launcher's store, for the lost-node message."""
        if self._endpoint is None:
            return ""
        if self._store_here:
            return f"; this node ({self.node}) holds the launcher's store at {self._endpoint}"
        holders = [
            f"{node} (host {info.get('host')})"
            for node, info in self.peers.others().items()
            if self._endpoint.host in (info.get("host"), info.get("addr"))
        ]
        where = f"node {holders[0]}" if len(holders) == 1 else "the node at that address"
        return (
            f"; {where} holds the launcher's store at {self._endpoint}: if that node is the one "
            "lost, every other node's launcher fails with it (docs/supervisor.md, "
            "'The store's host', says how to make it survive that)"
        )

    def _backoff(self, restart: int) -> float:
        wait = wait_exponential_jitter(
            initial=self.sup.backoff_s, max=self.sup.backoff_max_s, jitter=self.sup.backoff_s
        )
        state: Any = type("S", (), {"attempt_number": restart})()
        return float(wait(state)) if self.sup.backoff_s > 0 else 0.0

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
            self._say(f"{path} cannot be written ({err}); the workers read the policy from {tmp}")
            return tmp

    def _preempted(self, attempt: int, returncode: int) -> tuple[int, str]:
        """Exit 73 only when the preemption's durable snapshot was written (a worker's own
        73 says so too); else 143, said loudly with how many steps are lost (the
        preempted event has them)."""
        event = preemption(self.run_dir, attempt, PREEMPTED_WAIT_S)
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

    def _stop(self, journal: Journal, code: int, why: str, best: int) -> tuple[int, str]:
        self._announce()
        event = journal.write(
            EVENT_SUPERVISOR_EXIT, best, {"exit_code": code, "reason": why, "node": self.node}
        )
        if code in ALERT_ON_EXIT:
            self.alerter.alert(ALERT_ON_EXIT[code], event, journal, best)
        self._say(f"{why}; exit {code}")
        return code, why

    def _flush(self) -> None:
        """Before the node's shared-memory ring goes: its newest valid slot into the durable
        tier when newer than the newest durable snapshot (orchestrator/flush.py, in a helper
        process: reading the slots needs torch, which the supervisor never imports)."""
        # On several nodes the helpers wait for each other (bounded) to agree on the step.
        wait_s = 60.0 if self.nnodes > 1 else 0.0
        cmd = [sys.executable, "-m", "orchestrator.flush", "--run-dir", self.run_dir,
               "--shm-dir", self.shm_dir, "--policy", self.policy_path,
               "--attempt", str(self._attempt), "--node", self.node,
               "--wait-s", str(wait_s)]  # fmt: skip
        try:
            out = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=self.policy.persist.commit_timeout_s + wait_s,
            )
            said = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-500:]
        except subprocess.TimeoutExpired:
            said = f"timed out after {self.policy.persist.commit_timeout_s + wait_s} s"
        self._say(f"flush of the shared-memory ring to the durable tier: {said}")

    # --- one attempt ----------------------------------------------------------------------
    def _run_attempt(self, attempt: int) -> Attempt:
        env = {
            **os.environ,
            ENV_POLICY: self.policy_path,
            ENV_RUN_DIR: self.run_dir,
            ENV_ATTEMPT: str(attempt),
            ENV_SUPERVISOR_PID: str(os.getpid()),
            ENV_SHM_DIR: self.shm_dir,
        }
        started = time.monotonic()
        self._max_step = None
        self._lost = self._ended = self._left_for = None
        self._done_since: float | None = None  # since when all its ranks said "done"
        with self._open_log(attempt) as log:
            try:
                self._proc = proc = subprocess.Popen(
                    self.cmd,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: we signal all of it
                    preexec_fn=die_with_parent,  # nothing outlives a SIGKILLed supervisor
                )
            except OSError as err:  # not found, not executable: no attempt can succeed
                found = shutil.which(self.cmd[0]) or os.path.isfile(self.cmd[0])
                hint = (
                    "the file is there, so its interpreter (its #! line) was not found"
                    if isinstance(err, FileNotFoundError) and found
                    else "on PATH? executable?"
                )
                self._cannot_start = (
                    f"cannot start {self.cmd[0]!r}: {err.strerror or err} "
                    f"({type(err).__name__}); check the command after `--` ({hint})"
                )
                return Attempt(attempt, 127, CRASH, None, 0.0)
            if self._signals:  # a signal came while we were starting it
                self._kill(signal.SIGTERM)
                self._term_sent_at = time.monotonic()
            # Its end of output wakes the watch below at once, not at its next poll: the
            # next attempt starts that much sooner.
            copier = threading.Thread(
                target=tee, args=(proc.stdout, log, self._wake.set), daemon=True
            )
            copier.start()
            stalled = self._watch(proc, attempt, started)
            rc = proc.wait()
            self._sweep()
            ended = time.time()  # before the reading below: the ledger's end of the attempt
            runtime = time.monotonic() - started
            copier.join(timeout=5)
        self._proc = None
        self._term_sent_at = None
        journaled = last_journaled_step(self.run_dir, attempt)
        best = max((s for s in (self._max_step, journaled) if s is not None), default=None)
        if stalled is not None:
            return Attempt(attempt, rc, HANG, best, runtime, stalled, ended)
        return Attempt(attempt, rc, classify(self.run_dir, rc, attempt), best, runtime, None, ended)

    def _open_log(self, attempt: int) -> Any:
        """The attempt's output log; where it cannot be opened (a full or read-only disk),
        the output still goes to the console."""
        try:
            os.makedirs(os.path.dirname(self._log_path(attempt)), exist_ok=True)
            return open(self._log_path(attempt), "ab")
        except OSError as err:
            self._say(f"{self._log_path(attempt)} cannot be written ({err}): console only")
            return open(os.devnull, "ab")

    def _watch(
        self, proc: subprocess.Popen[bytes], attempt: int, started: float
    ) -> dict[int, int] | None:
        """Poll until the child exits; on a hang, stop it and return the stalled ranks.
        ``started``: when the attempt started, on the monotonic clock."""
        pause_s = max(MIN_PAUSE_S, min(PAUSE_S, self.sup.hang_timeout_s / 2))
        stalls = Stalls(clock_id(), pause_s)
        while True:
            self._wake.clear()  # before the poll: a wake after it ends the wait below at once
            if proc.poll() is not None:
                return None
            self._announce()
            self._seen.add(descendants(proc.pid))  # torchrun puts workers in new sessions
            if (
                self._term_sent_at is not None
                and time.monotonic() - self._term_sent_at > self.sup.grace_s
            ):
                self._kill(signal.SIGKILL)
            beats = self._beats(attempt)  # one read: the hang event describes what it found
            if not beats and self._waiting_for_nodes(attempt):
                self._kill(signal.SIGTERM)  # nothing to lose: its workers have not started
                try:
                    proc.wait(self.sup.grace_s)
                except subprocess.TimeoutExpired:
                    self._kill(signal.SIGKILL)
                return None
            if self._term_sent_at is None and self.nnodes > 1:
                ahead = self.peers.ahead(attempt)
                if ahead is not None:
                    self._leave(proc, attempt, ahead)
                    return None
            if self._lingering(proc, attempt, beats):
                return None
            # During a graceful stop the ranks wait for the preemption's durable snapshot
            # (rank 0 writes it, the others wait for its verdict, beating no progress):
            # grace_s bounds that, not hang_timeout_s.
            stopping = self._term_sent_at is not None
            stalled = None if stopping else self._stalled(beats, started, stalls)
            if stalled is not None:
                behind = suspects(beats)
                every_rank = [  # every node's, for the culprit: the one outside the collective
                    b for b in read_heartbeats(self.run_dir) if b.get("attempt") == attempt
                ]
                stacks, named, states = collect(
                    self.run_dir, attempt, self.node, beats, self._ask_stacks, every_rank,
                    state=self._state,
                )  # fmt: skip
                hang_event = self.journal.write(
                    EVENT_HANG,
                    max(stalled.values(), default=-1),
                    {
                        "stalled_ranks": stalled,
                        # Where each rank stood; the ones behind the rest are the suspects.
                        "phases": {int(b["rank"]): b.get("phase") for b in beats},
                        "suspects": behind,
                        # From the stacks: the ranks not inside the collective others wait in,
                        # and those that could not answer (frozen: their /proc state).
                        "culprits": named,
                        "states": states,  # this node's ranks' /proc states
                        "stacks": stacks,
                        "hang_timeout_s": self.sup.hang_timeout_s,
                        "host": self.host,
                        "node": self.node,
                        "log": self._log_path(attempt),
                    },
                )
                what = (
                    f"ranks {sorted(stalled)} made no progress for "
                    f"{self.sup.hang_timeout_s:.0f} s (last steps {stalled}"
                    + (f"; ranks {behind} are behind the others, suspect them)" if behind else ")")
                    + "".join(f"; {culprit_words(c)}" for c in named)
                    if stalled
                    else f"no rank wrote a heartbeat within {self.sup.start_timeout_s} s"
                )
                self.alerter.alert("hang", hang_event, self.journal, hang_event["step"])
                self._say(f"hang: {what}; stopping (log: {self._log_path(attempt)})")
                self._kill(signal.SIGTERM)
                try:
                    # A hung rank cannot take a graceful stop (nor can the ranks blocked in
                    # a collective with it): a short grace lets launchers and NCCL's flight
                    # recorder write what they can, not grace_s of a snapshot nobody writes.
                    proc.wait(min(self.sup.grace_s, HANG_GRACE_S))
                except subprocess.TimeoutExpired:
                    self._kill(signal.SIGKILL)
                return stalled
            self._wake.wait(0.5)

    def _leave(self, proc: subprocess.Popen[bytes], attempt: int, ahead: str) -> None:
        """End an attempt another node has left (it proposes or runs a later one): its
        ranks are gone, so ours can only fail or hang in a collective with them. Killed, not
        stopped gracefully: a graceful stop is itself a collective the others left."""
        self._left_for = ahead.split(" ", 1)[0]
        self.journal.write(
            "attempt_left",
            self._max_step if self._max_step is not None else -1,
            {"why": ahead, "attempt": attempt, "node": self.node, "host": self.host},
        )
        self._say(f"node {ahead}: ending attempt {attempt}, which it left")
        self._kill(signal.SIGKILL)
        proc.wait()

    def _lingering(
        self, proc: subprocess.Popen[bytes], attempt: int, beats: list[dict[str, Any]]
    ) -> bool:
        """Whether the launcher outlived its finished ranks for LINGER_S, and was ended. The
        job is finished (a ``run_end`` says so) but torchrun's exit barrier waits for every
        node's launcher of its rendezvous round, up to 300 s: one that restarted into
        another round (a replaced node) never arrives there."""
        if not beats or any(b.get("phase") != "done" for b in beats):
            self._done_since = None
            return False
        now = time.monotonic()
        if self._done_since is None or now - self._done_since < LINGER_S:
            self._done_since = self._done_since or now
            return False
        if classify(self.run_dir, -1, attempt) != OK:  # not finished: look again later
            self._done_since = now
            return False
        self.journal.write(
            "launcher_lingered",
            self._max_step if self._max_step is not None else -1,
            {"seconds": round(now - self._done_since, 1), "attempt": attempt, "node": self.node},
        )
        self._say(
            f"the launcher outlived its finished ranks by {now - self._done_since:.0f} s "
            "(waiting for another node's launcher in its exit barrier): ending it"
        )
        self._kill(signal.SIGTERM)
        self._kill(signal.SIGCONT)  # a stopped launcher takes its SIGTERM only once continued
        try:
            proc.wait(self.sup.grace_s)
        except subprocess.TimeoutExpired:
            self._kill(signal.SIGKILL)
        return True

    def _waiting_for_nodes(self, attempt: int) -> bool:
        """While our workers wait in the rendezvous: has a node stopped for good, or been
        gone for node_timeout_s? (Then this attempt can never start.)"""
        lost = self.peers.lost(self.sup.node_timeout_s)
        ended = self.peers.ended(fresh=False) if self.nnodes > 1 else None
        if ended is not None and ended.exit_code == EXIT_OK:
            ended = None  # the job finished: our workers end with it on their own
        if lost is not None:
            self._note_lost(lost + self._store_words())
        self._ended = ended
        return lost is not None or ended is not None

    def _note_lost(self, why: str) -> None:
        self._lost = why
        self.journal.write(
            EVENT_NODE_LOST,
            self._max_step if self._max_step is not None else -1,
            {"why": why, "nnodes": self.nnodes, "node_timeout_s": self.sup.node_timeout_s,
             "node": self.node, "host": self.host,
             "endpoint": str(self._endpoint) if self._endpoint is not None else None},
        )  # fmt: skip

    def _ask_stacks(self, beats: list[dict[str, Any]]) -> list[int]:
        """Signal the ranks of ``beats`` for their stacks, through the pidfds held since they
        were seen (never a recycled pid); returns the ranks reached."""
        reached = self._seen.send(STACK_SIGNAL, only={int(b.get("pid", -1)) for b in beats})
        return [int(b["rank"]) for b in beats if b.get("pid") in reached]

    def _sweep(self) -> None:
        """Kill workers the launcher left behind (SIGKILLed torchrun leaves orphans)."""
        self._seen.send(signal.SIGKILL)
        self._seen.close()

    def _beats(self, attempt: int) -> list[dict[str, Any]]:
        beats = [b for b in read_heartbeats(self.run_dir, self.node) if b.get("attempt") == attempt]
        steps = [int(b["step"]) for b in beats]
        if steps:  # the highest step seen, even if a rollback lowers a rank's latest beat
            self._max_step = max(steps + ([self._max_step] if self._max_step is not None else []))
        return beats

    def _progress_time(self, attempt: int) -> float | None:
        """The latest progress of this node's ranks in ``attempt``, from their heartbeats."""
        times = [progress_time(b) for b in self._beats(attempt) if b.get("phase") != "done"]
        return max(times) if times else None

    def _stalled(
        self, beats: list[dict[str, Any]], started: float, stalls: Stalls
    ) -> dict[int, int] | None:
        """The ranks (and their last steps) with no progress for hang_timeout_s; {} when
        none wrote a beat within start_timeout_s; None when nothing is late. On this host's
        monotonic clock (``started`` too), never the wall clock (launch/progress.py)."""
        now = time.monotonic()
        if stalls.look(now):
            self._say(
                f"the supervisor did not run for {stalls.paused_s:.0f} s (a paused VM or "
                "process?): hang ages count from now"
            )
        if self._run_dir_refuses(now):
            stalls.restart(now)  # silence is no hang while the beats cannot be written
            return None
        if not beats:
            limit = self.sup.start_timeout_s
            if limit is not None and stalls.elapsed(started, now) > limit:
                return {}  # nothing started: a hang before the first step
            return None
        late = {
            int(b["rank"]): int(b["step"])
            for b in beats
            if b.get("phase") != "done" and stalls.age(b, now) > self.sup.hang_timeout_s
        }
        return late or None

    def _run_dir_refuses(self, now: float) -> bool:
        """While this supervisor's own file in the run directory cannot be written (read-only,
        I/O errors; a full disk is written in place), the ranks' heartbeats cannot be either:
        hangs are not judged by them. Said and journaled when it starts and when it ends
        (an event the journal cannot take waits for it, see orchestrator/journal.py)."""
        failing = self.peers.failing
        step = self._max_step if self._max_step is not None else -1
        if failing is not None and self._blind is None:
            self._blind = (now, failing)
            self._say(
                f"the run directory refuses writes ({failing}): hang detection is paused "
                "(the ranks' heartbeats cannot be written either) until it takes them again"
            )
            self.journal.write("hang_detection_paused", step, {"error": failing, "node": self.node})
        elif failing is None and self._blind is not None:
            since, why = self._blind
            self._blind = None
            self._say("the run directory takes writes again: hang detection resumes")
            self.journal.write(
                "hang_detection_resumed",
                step,
                {"error": why, "seconds": round(now - since, 3), "node": self.node},
            )
        return self._blind is not None

    def _state(self, pid: int) -> str | None:
        """The /proc state of a worker this attempt holds (never a recycled pid's)."""
        return proc_state(pid) if self._seen.holds(pid) else None

    # --- signals and helpers ----------------------------------------------------------------
    def _on_signal(self, signum: int, frame: object) -> None:
        """Forward the stop; nothing is printed or logged here (a handler that takes the
        logging or stdout lock the interrupted code holds deadlocks or raises): the main
        loop says it (:meth:`_announce`)."""
        self._signals += 1
        self._last_signal = signum
        if self._first_signal_at is None:
            self._first_signal_at = time.time()
        self._wake.set()
        if self._signals == 1 or signum == signal.SIGTERM:
            # Forward: the Guard turns it into a collective stop with a durable snapshot.
            self._kill(signal.SIGTERM)
            if self._term_sent_at is None:
                self._term_sent_at = time.monotonic()
        else:
            self._kill(signal.SIGKILL)

    _last_signal: int = signal.SIGTERM

    def _announce(self) -> None:
        """Say, from the main loop, what the signal handler did since the last call (and
        journal it: the goodput ledger counts a preemption from its signal)."""
        journal = getattr(self, "journal", None)  # a signal may come before it is open
        if journal is not None and self._first_signal_at is not None and not self._stop_journaled:
            self._stop_journaled = True
            journal.write(
                EVENT_STOP_REQUESTED,
                self._max_step if self._max_step is not None else -1,
                {
                    "signal": signal.Signals(self._last_signal).name,
                    "signal_time": self._first_signal_at,
                    "node": self.node,
                },
            )
        if self._announced >= self._signals:
            return
        if self._announced == 0 or self._last_signal == signal.SIGTERM:
            self._say(
                f"got {signal.Signals(self._last_signal).name}: stopping the workers "
                f"gracefully (up to {self.sup.grace_s:.0f} s); press Ctrl-C again to kill "
                "them now"
            )
        else:
            self._say("second interrupt: killing the workers now")
        self._announced = self._signals

    def _kill(self, sig: int) -> None:
        """Signal the launcher's process group and every worker under it (torchrun starts
        its workers in sessions of their own, out of reach of the group)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        self._seen.add(descendants(proc.pid))
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        self._seen.send(sig)

    def _log_path(self, attempt: int) -> str:
        return os.path.join(self.run_dir, ATTEMPTS_DIR, str(attempt), "output.log")

    @staticmethod
    def _say(msg: str) -> None:
        logger.warning("%s", msg)  # what a person watching the job must see
