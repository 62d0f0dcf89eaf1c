"""Which way this node's supervisor reaches the others (``supervisor.store``): the run
directory's files (launch/nodes.py) or a key-value store (launch/store_peers.py).

``auto`` (the default) uses a TCPStore served by the supervisor of the node that holds the
launcher's rendezvous, on the rendezvous port + 1: that node's loss ends the job anyway (the
launchers' own store is there), so the supervisors' store adds no new way to fail. A launcher
that names no endpoint keeps the files. One node never needs either.
"""

from __future__ import annotations

import hashlib
import os
import threading

from launch.endpoint import Endpoint, _split, is_local
from launch.kv import KV, TCPKV, serve_tcp
from launch.nodes import Coordinator, FilePeers
from launch.store_peers import StorePeers
from orchestrator.errors import PolicyError
from orchestrator.policy_sections import SupervisorPolicy

TCP_PORT_OFFSET = 1  # the supervisors' store: the launcher's rendezvous port + this


def store_timeout_s(sup: SupervisorPolicy) -> float:
    """How long one store call may take: long enough for a loaded store, short enough that
    a cut network is noticed within a few intervals (the time counts toward node_timeout_s)."""
    return max(5.0, 4 * sup.heartbeat_interval_s)


def make_peers(
    run_dir: str,
    node: str,
    nnodes: int,
    sup: SupervisorPolicy,
    endpoint: Endpoint | None,
    wake: threading.Event | None = None,
) -> Coordinator:
    """This node's view of the others, the way ``supervisor.store`` says (``wake``: set when
    a store's news arrives, to end the supervisor's wait)."""
    if nnodes <= 1 or sup.store == "files" or (sup.store == "auto" and endpoint is None):
        return FilePeers(run_dir, node, nnodes, sup.heartbeat_interval_s)
    timeout_s = store_timeout_s(sup)
    if sup.store.startswith("etcd://"):
        return _on_etcd(run_dir, node, nnodes, sup, timeout_s, wake)
    if sup.store.startswith("tcp://"):
        where = _split(sup.store[len("tcp://") :], 0)
        if not where.port:
            raise PolicyError(f"supervisor.store: {sup.store} names no port (tcp://host:port)")
    elif endpoint is None:
        raise PolicyError(
            "supervisor.store: tcp needs the launcher's rendezvous endpoint (torchrun "
            "--rdzv-endpoint, --master-addr, or MASTER_ADDR): name the store as tcp://host:port"
        )
    else:
        where = Endpoint(endpoint.host, endpoint.port + TCP_PORT_OFFSET)
    local = is_local(where.host)
    served: list[TCPKV] = []

    def connect() -> KV:
        # Serve it if its address is ours and nobody here does yet (tried again at each
        # connect: the port may have been held a moment), else be a client of whoever does.
        if not served and local:
            served.extend(s for s in [serve_tcp(where.port, timeout_s, where.host)] if s)
        if not served:
            return TCPKV(where.host, where.port, timeout_s)
        # A connection of its own to the store this process serves (kept in `served`): a
        # call that timed out under load spoils a connection, never the store.
        kv = TCPKV("127.0.0.1", where.port, timeout_s)
        kv.serving = True
        return kv

    this = " (this one)" if local else ""
    words = (
        f"; the supervisor of the node at {where.host}{this} serves it: if that node is "
        "lost, so is the store"
    )
    return StorePeers(
        run_dir,
        node,
        nnodes,
        sup.heartbeat_interval_s,
        connect,
        node_timeout_s=sup.node_timeout_s,
        store_words=words,
        where=f"tcp://{where}",
        linger_s=min(sup.node_timeout_s, sup.grace_s + 2 * max(10.0, 5 * sup.heartbeat_interval_s)),
        wake=wake,
    )


def _on_etcd(
    run_dir: str,
    node: str,
    nnodes: int,
    sup: SupervisorPolicy,
    timeout_s: float,
    wake: threading.Event | None,
) -> StorePeers:
    """Through the cluster's etcd, under this run directory's prefix: no node serves it, so
    no node's loss takes it down (etcd has its own members for that)."""
    from launch.kv_etcd import connect as etcd

    url, prefix = sup.store, run_prefix(run_dir)
    return StorePeers(
        run_dir, node, nnodes, sup.heartbeat_interval_s, lambda: etcd(url, prefix, timeout_s),
        node_timeout_s=sup.node_timeout_s, store_words=" (the cluster's etcd)", where=url,
        linger_s=0.0, wake=wake,
    )  # fmt: skip


def run_prefix(run_dir: str) -> str:
    """One run directory's keys in a store shared by many jobs (etcd): a requeued job finds
    its earlier keys (an end already there is an earlier job's: launch/store_peers.py)."""
    digest = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
    return f"/orchestrator/{digest}/"
