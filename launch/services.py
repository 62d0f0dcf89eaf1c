"""The supervisor's side services: the Prometheus exporter (launch/exporter.py), the buddy
replica of the node's shared-memory ring (launch/replica.py), the janitor that removes the
ring should the supervisor die without doing it (launch/janitor.py), the alerts
(launch/alerts.py), and the ring's flush into the durable tier when the supervisor stops.

None of them decides anything: each one starts with the supervisor, and a service that
cannot start (a port taken, a package missing) is said and journaled, never fatal.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from typing import Any

from launch.alerts import Alerter
from launch.exporter import Exporter
from launch.janitor import Janitor
from launch.lock import lock_path
from launch.nodes import Coordinator
from launch.replica import Replicator
from orchestrator.journal import Journal
from orchestrator.policy import Policy
from orchestrator.protocol import EVENT_EXPORTER, EXIT_NODE_LOST, EXIT_OK, shm_root

logger = logging.getLogger(__name__)


def _say(msg: str) -> None:
    logger.warning("%s", msg)  # what a person watching the job must see


class Services:
    """The side services of one node's supervisor, from its start to its end."""

    def __init__(self, policy: Policy, run_dir: str, node: str, peers: Coordinator) -> None:
        self.policy, self.run_dir, self.node, self.peers = policy, run_dir, node, peers
        # The node's shared-memory ring (snapshot.shared_memory): kept across attempts,
        # removed when this supervisor stops for good.
        self.shm_dir = shm_root(policy.snapshot.shm_dir, run_dir, node)
        self.alerter = Alerter(policy.alerts, run_dir, node)
        self.exporter: Exporter | None = None  # export.prometheus_port
        # snapshot.replicate: buddy: our ring's copy on another node, theirs here.
        self.replica: Replicator | None = None
        self.janitor: Janitor | None = None
        self.journal: Journal | None = None  # set once the supervisor opens it

    def start(self) -> None:
        """What runs before the journal opens: the janitor and the replica server."""
        # Removes the ring should this process die without close() below (SIGKILL). Under
        # shared_memory: auto only the ranks know whether the ring fits (they size it): a
        # janitor of a ring never made removes nothing.
        if self.policy.snapshot.shared_memory is not False:
            self.janitor = Janitor(self.shm_dir, lock_path(self.run_dir, self.node))
        if self.policy.snapshot.replicate == "buddy" and self.peers.nnodes > 1:
            self.replica = Replicator(
                self.run_dir,
                self.node,
                self.shm_dir,
                self.peers.others,
                self._event,
                self.policy.supervisor.heartbeat_interval_s,
            )
            self.peers.publish(replica=self.replica.address)

    def _event(self, kind: str, step: int, details: dict[str, Any]) -> object:
        assert self.journal is not None, "the replica starts sending once the journal is open"
        return self.journal.write(kind, step, details)

    def open_exporter(self, journal: Journal) -> None:
        """Serve the metrics (export.prometheus_port), said in the journal; one that cannot
        (not installed, the port taken) is said, and training goes on without it."""
        export = self.policy.export
        if export.prometheus_port is None:
            return
        try:
            self.exporter = Exporter(
                self.run_dir, self.node, export.prometheus_port, export.prometheus_addr
            )
        except (RuntimeError, OSError) as err:  # not installed, port taken: say, go on
            where = f"{export.prometheus_addr}:{export.prometheus_port}"
            _say(
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

    def before_attempt(self, attempt: int) -> None:
        if self.replica is not None:
            if attempt > 0:  # a ring lost with its node (or supervisor): a copy
                self.replica.fetch_if_empty()
            self.replica.start()

    def quiesce(self) -> None:
        """Before the journal closes: the replica and the alerts journal their outcome."""
        if self.replica is not None:
            self.replica.close()
        self.alerter.wait()

    def close(self, code: int, attempt: int, policy_path: str) -> None:
        """The supervisor stops for good (after the other nodes were told): the ring flushed
        into the durable tier when the run did not finish, then removed; the rest let go."""
        if code != EXIT_OK and os.path.isdir(self.shm_dir):
            self._flush(attempt, policy_path, node_lost=code == EXIT_NODE_LOST)
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        if self.janitor is not None:
            self.janitor.close()
        self.alerter.wait()
        if self.exporter is not None:
            self.exporter.close()

    def _flush(self, attempt: int, policy_path: str, node_lost: bool) -> None:
        """Before the node's shared-memory ring goes: its newest valid slot into the durable
        tier when newer than the newest durable snapshot (orchestrator/flush.py, in a helper
        process: reading the slots needs torch, which the supervisor never imports)."""
        # On several nodes the helpers wait for each other (bounded) to agree on the step; not
        # for a node known lost (exit 77): its ranks' slots cannot come, so nothing can be
        # flushed, and waiting would only hold back the exit that names it by a minute.
        wait_s = 60.0 if self.peers.nnodes > 1 and not node_lost else 0.0
        cmd = [sys.executable, "-m", "orchestrator.flush", "--run-dir", self.run_dir,
               "--shm-dir", self.shm_dir, "--policy", policy_path,
               "--attempt", str(attempt), "--node", self.node,
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
        _say(f"flush of the shared-memory ring to the durable tier: {said}")
