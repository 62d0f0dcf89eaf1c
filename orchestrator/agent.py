"""The node agent: the launcher of one attempt under ``orchestrator launch --nproc-per-node N``
(``python -m orchestrator.agent``), a torchrun-compatible front end that starts its node's
ranks itself so that a dead rank can be replaced alone (issue 33; design:
docs/dev/issue-33-design.md 3.1-3.3; the contract with the ranks:
orchestrator/inplace_protocol.py).

Like torchrun it joins torch's own rendezvous (c10d or static, several nodes), assigns
ranks, starts each with torchrun's environment, forwards SIGTERM/SIGINT and exits 0 when
every rank succeeded, 1 otherwise (torchrun masks its workers' codes: the supervisor reads
the journal). Unlike torchrun, the agent of group rank 0 hosts a control store and a fresh
group store per generation (``MASTER_ADDR``/``MASTER_PORT``), and a rank that dies is
replaced alone when ``supervisor.in_place`` allows it (orchestrator/agent_heal.py).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
import uuid
from types import FrameType
from typing import Any

from torch.distributed import Store, TCPStore

from orchestrator import inplace_protocol as IP
from orchestrator.agent_heal import Healer
from orchestrator.agent_ranks import Layout, Ranks, common_env, rank_command
from orchestrator.agent_spare import Spares
from orchestrator.policy import load_policy

logger = logging.getLogger("orchestrator.agent")
POLL_S = 0.02
CONTROL_KEY = "orchestrator/agent/control"  # node 0's control store, in the rendezvous store
MASTER_KEY = "orchestrator/agent/master"  # generation 0's group store, likewise
DONE_KEY = "orchestrator/agent/done"  # nodes whose ranks all succeeded (the exit barrier)
EXIT_BARRIER_S = 300.0  # torchrun's exit barrier timeout


def parse(argv: list[str]) -> argparse.Namespace:
    """torchrun's options that the agent honours (the others are refused by argparse)."""
    p = argparse.ArgumentParser(prog="python -m orchestrator.agent")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    p.add_argument("--nnodes", default="1", help="N or MIN:MAX, as torchrun")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--standalone", action="store_true")
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="static")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="")
    p.add_argument("--rdzv-id", "--rdzv_id", default="none")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    p.add_argument("--master-port", "--master_port", type=int, default=29500)
    p.add_argument("--local-addr", "--local_addr", default=None)
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    p.add_argument("--module", "-m", action="store_true")
    p.add_argument("--no-python", "--no_python", action="store_true")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.max_restarts:
        p.error("--max-restarts: the supervisor restarts attempts; the agent takes 0 only")
    if a.standalone:  # torchrun: c10d on localhost, a fresh port and run id
        a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    return a


def _nodes(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition(":")
    return int(lo), int(hi or lo)


def rendezvous(a: argparse.Namespace) -> tuple[Store | None, int, int, str]:
    """torchrun's rendezvous: (its store, this node's group rank, nodes, node 0's address).
    One node without a c10d endpoint needs none (torchrun's static case, trivially)."""
    lo, hi = _nodes(a.nnodes)
    if hi == 1 and a.rdzv_backend == "static":
        return None, 0, 1, "127.0.0.1"
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    conf: dict[str, Any] = dict(kv.split("=", 1) for kv in a.rdzv_conf.split(",") if kv)
    endpoint = a.rdzv_endpoint
    if a.rdzv_backend == "static":
        conf["rank"] = a.node_rank
        endpoint = endpoint or f"{a.master_addr}:{a.master_port}"
    params = RendezvousParameters(
        backend=a.rdzv_backend, endpoint=endpoint, run_id=a.rdzv_id, min_nodes=lo,
        max_nodes=hi, local_addr=a.local_addr, **conf,
    )  # fmt: skip
    info = get_rendezvous_handler(params).next_rendezvous()
    boot = info.bootstrap_store_info
    addr = boot.master_addr if boot is not None else socket.getfqdn()
    return info.store, info.rank, info.world_size, addr


def layout(a: argparse.Namespace, store: Store | None, group_rank: int, nodes: int) -> Layout:
    """Ranks as torchrun assigns them: by group rank, each node's LOCAL_WORLD_SIZE."""
    n = a.nproc_per_node
    run_id = a.rdzv_id
    if store is None:
        return Layout(n, 0, 1, 0, n, run_id)
    store.set(f"orchestrator/agent/lws/{group_rank}", str(n))
    sizes = [int(store.get(f"orchestrator/agent/lws/{g}")) for g in range(nodes)]
    return Layout(n, group_rank, nodes, sum(sizes[:group_rank]), sum(sizes), run_id)


def stores(
    store: Store | None, group_rank: int, addr: str
) -> tuple[list[TCPStore], TCPStore, tuple[str, int]]:
    """Node 0 hosts the control store and generation 0's group store; every node learns
    their ports through the rendezvous store. (the servers this node hosts, which must
    live as long as the agent; the control store; generation 0's master address)."""
    server = group = None
    if group_rank == 0:
        server = TCPStore(addr, 0, is_master=True, wait_for_workers=False)
        group = TCPStore(addr, 0, is_master=True, wait_for_workers=False)
        if store is not None:
            store.set(CONTROL_KEY, f"{addr}:{server.port}")
            store.set(MASTER_KEY, f"{addr}:{group.port}")
    if store is not None:
        caddr, cport = store.get(CONTROL_KEY).decode().rsplit(":", 1)
        maddr, mport = store.get(MASTER_KEY).decode().rsplit(":", 1)
    else:
        assert server is not None and group is not None
        caddr, cport, maddr, mport = addr, str(server.port), addr, str(group.port)
    client = server or TCPStore(caddr, int(cport), is_master=False)
    hosted = [s for s in (server, group) if s is not None]
    return hosted, client, (maddr, int(mport))


class Agent:
    """Runs the node's ranks to their end: 0 when all succeeded, 1 otherwise."""

    def __init__(self, ranks: Ranks, healer: Healer) -> None:
        self.ranks, self.healer = ranks, healer
        self.signal: int | None = None  # the signal to forward, once one came

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum

    def run(self) -> int:
        while True:
            if self.signal is not None:  # torchrun: forward it, wait, fail
                logger.warning("agent: got signal %d, forwarding it to the ranks", self.signal)
                self.ranks.send(self.signal)
                self.ranks.wait_all(None)
                return 1
            fell_back = self.healer.sync()  # another node's agent gave up in place
            if fell_back is not None:
                logger.warning("agent: no in-place recovery (%s): stopping the ranks", fell_back)
                self.ranks.stop()
                return 1
            codes = [r.poll() for r in self.ranks.ranks]
            if all(c == 0 for c in codes):
                return 0
            dead = [r for r, c in zip(self.ranks.ranks, codes, strict=True) if c not in (None, 0)]
            if dead:
                if not self.healer.heal(dead, lambda: self.signal is not None):
                    self.ranks.stop()
                    return 1
                self.ranks.refill_spares()  # the generation formed: the CPU is free again
            time.sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = parse(sys.argv[1:] if argv is None else argv)
    sup = load_policy().supervisor
    store, group_rank, nodes, addr = rendezvous(a)
    lay = layout(a, store, group_rank, nodes)
    in_place = sup.in_place
    if store is None:
        addr = "127.0.0.1"
    elif group_rank == 0:
        addr = addr or socket.getfqdn()
    hosted, control, master = stores(store, group_rank, addr)
    env = common_env(a.nproc_per_node, in_place)
    env[IP.ENV_CONTROL_ADDR], env[IP.ENV_CONTROL_PORT] = control.host, str(control.port)
    cmd = rank_command(a.script, a.args, a.module, a.no_python)
    spares = Spares(sup.in_place_spares, cmd, env) if in_place and sup.in_place_spares else None
    ranks = Ranks(lay, cmd, env, spares=spares)
    healer = Healer(ranks, control, master[0], in_place, sup)
    agent = Agent(ranks, healer)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, agent.on_signal)
    ranks.start_all(master, 0)
    try:
        code = agent.run()
        if code == 0 and nodes > 1:
            exit_barrier(control, group_rank, nodes)
        return code
    finally:
        ranks.close_spares()
        healer.close()
        del hosted  # the stores' servers end with the agent, after its ranks


def exit_barrier(control: TCPStore, group_rank: int, nodes: int) -> None:
    """Node 0 hosts the stores every node's ranks use: like torchrun's exit barrier, its
    agent waits for the others' ranks to finish (bounded) before it ends them."""
    control.add(DONE_KEY, 1)
    deadline = time.monotonic() + EXIT_BARRIER_S
    while group_rank == 0 and int(control.add(DONE_KEY, 0)) < nodes:
        if time.monotonic() >= deadline:
            logger.warning(
                "agent: exit barrier: not every node finished within %g s", EXIT_BARRIER_S
            )
            return
        time.sleep(0.1)


if __name__ == "__main__":
    sys.exit(main())
