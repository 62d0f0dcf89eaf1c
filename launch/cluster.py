"""What one node's supervisor does with the other nodes' (launch/nodes.py): agree on the
attempt every node starts next, notice a node lost (or one that ended the job) while they
wait for each other, and say when a failed attempt was not this node's doing.

A node that does not hold the launcher's rendezvous store also waits for its endpoint to
answer (launch/endpoint.py) before it starts an attempt: one started across a cut network
only fails on the launcher's timeout, and the time that takes counts toward
``node_timeout_s``, never toward a crash loop.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from launch.coordination import make_peers
from launch.endpoint import Endpoint, is_local, launcher_endpoint, route_addr, unreachable
from launch.launcher import StopRequests
from launch.nodes import AGREEING, Coordinator, Ended, launcher_nodes
from orchestrator.journal import Journal
from orchestrator.policy_sections import SupervisorPolicy
from orchestrator.protocol import EVENT_NODE_LOST, EXIT_OK

logger = logging.getLogger(__name__)
PROBED_PEERS = 4  # how many peers the store's host probes after a failed attempt


def _say(msg: str) -> None:
    logger.warning("%s", msg)  # what a person watching the job must see


class Cluster:
    """This node among the job's nodes (one node: every answer is the trivial one)."""

    def __init__(
        self,
        run_dir: str,
        node: str,
        cmd: list[str],
        sup: SupervisorPolicy,
        step: Callable[[], int],
        wake: threading.Event | None = None,
    ) -> None:
        self.node, self.sup = node, sup
        self.host = socket.gethostname()
        self._step = step  # the highest step seen (for the events)
        self.nnodes = launcher_nodes(cmd, os.environ)
        # Where the launcher's rendezvous meets, and whether this node serves it
        # (launch/endpoint.py); a node that does not waits for it to answer.
        self.endpoint: Endpoint | None = (
            launcher_endpoint(cmd, os.environ) if self.nnodes > 1 else None
        )
        self.store_here = self.endpoint is not None and is_local(self.endpoint.host)
        # The other nodes' supervisors: through a store, or the run directory's files.
        self.peers: Coordinator = make_peers(run_dir, node, self.nnodes, sup, self.endpoint, wake)
        self.journal: Journal | None = None  # set once the supervisor opens it
        self.lost: str | None = None  # why the current attempt was stopped for a lost node
        self.ended: Ended | None = None  # a peer that ended the job while we waited for it
        self.left_for: str | None = None  # the node that left the current attempt first

    def start(self) -> None:
        self.peers.start()
        if self.endpoint is not None:  # what the others see this node as (store_words)
            self.peers.publish(addr=route_addr(self.endpoint.host))

    def begin(self) -> None:
        """A new attempt: nothing lost, ended or left yet."""
        self.lost = self.ended = self.left_for = None

    def agree(self, attempt: int, stops: StopRequests) -> int | None:
        """The attempt every node starts next, agreed through the run directory before the
        launcher starts (launch/nodes.py :func:`agree`); None when it never can be: a node
        lost for supervisor.node_timeout_s (``lost``), one that ended the job (``ended``),
        a signal. A node that is not the store's host also waits for the rendezvous endpoint
        to answer (:meth:`_cut`)."""
        said: set[str] = set()
        cut_since: float | None = None
        probed_at, cut = -float("inf"), None
        while True:
            stops.wake.clear()  # before the look: news after it (a signal, the store's view)
            if stops.count:  # ends the wait below at once
                break
            self.peers.at(attempt, AGREEING)
            attempt, start = self.peers.propose(attempt)
            self.peers.at(attempt, AGREEING)
            lost = self.peers.lost(self.sup.node_timeout_s)
            if lost is not None:
                self.note_lost(lost + self.store_words())
                return None
            self.ended = self.peers.ended(fresh=False)
            if self.ended is not None:
                return None
            now = time.monotonic()
            if self.endpoint is not None and not self.store_here and now - probed_at > 2.0:
                probed_at, cut = now, unreachable(self.endpoint)
                if cut is not None and cut_since is None:
                    self._journal().write(
                        "endpoint_unreachable",
                        -1,
                        {"endpoint": str(self.endpoint), "why": cut, "node": self.node,
                         "node_timeout_s": self.sup.node_timeout_s},
                    )  # fmt: skip
                cut_since = (cut_since or now) if cut is not None else None
            if cut is not None and cut_since is not None:
                if self._cut_too_long(cut, cut_since):
                    return None
                wait = f"the rendezvous endpoint {self.endpoint} ({cut})"
            elif start:
                return attempt
            else:
                wait = f"the nodes to agree on attempt {attempt}"
            if wait not in said:
                said.add(wait)
                _say(f"waiting for {wait}")
            # A look reads every node's file (files) or one cached view (a store): as often
            # as the coordinator's poll_s, so many nodes stay cheap.
            stops.wake.wait(self.peers.poll_s)
        return None

    def _cut_too_long(self, cut: str, cut_since: float) -> bool:
        """Whether the rendezvous endpoint has not answered for node_timeout_s (then the
        node is noted lost)."""
        waited = time.monotonic() - cut_since
        if waited <= self.sup.node_timeout_s:
            return False
        self.note_lost(
            f"the launcher's rendezvous endpoint {self.endpoint} cannot be reached "
            f"from node {self.node} for {waited:.0f} s ({cut}; "
            f"supervisor.node_timeout_s={self.sup.node_timeout_s:g}){self.store_words()}"
            ": mend the network between the nodes, then requeue the job; the run "
            "resumes from its newest durable snapshot"
        )
        return True

    def waiting_for_nodes(self) -> bool:
        """While our workers wait in the rendezvous: has a node stopped for good, or been
        gone for node_timeout_s? (Then this attempt can never start.)"""
        lost = self.peers.lost(self.sup.node_timeout_s)
        ended = self.peers.ended(fresh=False) if self.nnodes > 1 else None
        if ended is not None and ended.exit_code == EXIT_OK:
            ended = None  # the job finished: our workers end with it on their own
        if lost is not None:
            self.note_lost(lost + self.store_words())
        self.ended = ended
        return lost is not None or ended is not None

    def ended_now(self) -> Ended | None:
        """A peer that ended the job: seen while waiting, or in the files now."""
        return self.ended or (self.peers.ended() if self.nnodes > 1 else None)

    def note_lost(self, why: str) -> None:
        self.lost = why
        self._journal().write(
            EVENT_NODE_LOST,
            self._step(),
            {"why": why, "nnodes": self.nnodes, "node_timeout_s": self.sup.node_timeout_s,
             "node": self.node, "host": self.host,
             "endpoint": str(self.endpoint) if self.endpoint is not None else None},
        )  # fmt: skip

    def blameless(self) -> str | None:
        """Why the attempt that just failed is not this node's doing, if so: it was ended
        because another node had left it, a node's supervisor is not alive, or the network
        between the nodes does not answer (the rendezvous endpoint from a node that does not
        hold the store; the other nodes from the one that does)."""
        if self.left_for is not None:
            return f"ended for node {self.left_for}"
        if self.nnodes <= 1:
            return None
        live = self.peers.live()
        if len(live) < self.nnodes - 1:
            return f"{self.nnodes - 1 - len(live)} node(s) without a live supervisor"
        if self.endpoint is None:
            return None
        if not self.store_here:
            cut = unreachable(self.endpoint)
            return f"the rendezvous endpoint does not answer: {cut}" if cut else None
        # A few peers say whether this node's network is cut (each probe may take its
        # timeout): on a thousand nodes, probing them all would stall the restart.
        for node, info in sorted(live.items())[:PROBED_PEERS]:
            addr = info.get("addr")
            cut = unreachable(Endpoint(str(addr), self.endpoint.port)) if addr else None
            if cut is not None:
                return f"node {node} does not answer: {cut}"
        return None

    def store_words(self) -> str:
        """Which node holds the launcher's store, for the lost-node message."""
        if self.endpoint is None:
            return ""
        if self.store_here:
            return f"; this node ({self.node}) holds the launcher's store at {self.endpoint}"
        holders = [
            f"{node} (host {info.get('host')})"
            for node, info in self.peers.others().items()
            if self.endpoint.host in (info.get("host"), info.get("addr"))
        ]
        where = f"node {holders[0]}" if len(holders) == 1 else "the node at that address"
        return (
            f"; {where} holds the launcher's store at {self.endpoint}: if that node is the one "
            "lost, every other node's launcher fails with it (docs/supervisor.md, "
            "'The store's host', says how to make it survive that)"
        )

    def _journal(self) -> Journal:
        assert self.journal is not None, "the supervisor opens the journal first"
        return self.journal
