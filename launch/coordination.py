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
) -> Coordinator:
    """This node's view of the others, the way ``supervisor.store`` says."""
    if nnodes <= 1 or sup.store == "files" or (sup.store == "auto" and endpoint is None):
        return FilePeers(run_dir, node, nnodes, sup.heartbeat_interval_s)
    if sup.store.startswith("etcd://"):
        raise PolicyError(
            f"supervisor.store: {sup.store}: etcd is not supported by this version; use auto "
            "(a TCPStore on the rendezvous node) or files"
        )
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
    timeout_s = store_timeout_s(sup)
    local = is_local(where.host)
    served: list[TCPKV] = []

    def connect() -> KV:
        # Serve it if its address is ours and nobody here does yet (tried again at each
        # connect: the port may have been held a moment), else be a client of whoever does.
        if not served and local:
            served.extend(s for s in [serve_tcp(where.port, timeout_s, where.host)] if s)
        return served[0] if served else TCPKV(where.host, where.port, timeout_s)

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
    )


def run_prefix(run_dir: str) -> str:
    """The keys of one run directory in a store shared by many jobs (etcd)."""
    return "/orchestrator/" + hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
