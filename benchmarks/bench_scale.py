"""A thousand supervisors on one machine (issue 34): the real coordination code of
launch/store_peers.py, one instance per simulated node, as threads in several processes
(16 a process, their starts spread out: 64 Python processes share this machine's 2 cores),
against a real TCPStore served by a process of its own (the store's host, which the
``store`` scenario kills and ``stopped`` stops).

    python -m benchmarks.bench_scale --nodes 8,128,1024           # docs/scale.md's table
    python -m benchmarks.bench_scale --nodes 48 --interval 0.5 --node-timeout 5 --json rows.json

Scenarios, each on a fresh store:
- ``crash``: every node agrees on attempt 0; one node then proposes attempt 1 (its attempt
  crashed); every other node sees it is ahead, proposes 1, and all start 1; then one node
  stops for good (exit 74) and every node sees that end and its code.
- ``lost``: after attempt 0, one node's supervisor stops beating (SIGKILL, as the store sees
  it); the first node whose ``lost()`` names it exits 77 and sets the end, as a supervisor
  does; every node names it itself or through that end, and the time from its last beat
  (the last add the store took) is measured against ``node_timeout_s`` + one interval.
- ``store``: after attempt 0, the store's process is SIGKILLed; every node's ``lost()`` names
  the store within ``node_timeout_s`` plus an interval, and no call hangs.
- ``stopped``: the same with the store's process SIGSTOPped (it answers nothing and closes
  nothing: torch's client waits without end, so the call in flight is what is counted).
- ``files`` (``--files``): ``crash`` through the run directory's files (launch/nodes.py) for
  comparison, counting the files opened.

Reported per scenario: seconds to agree / to see the end / to name the lost node (max over
nodes; for a lost node also the median and the min, which must not be under the timeout),
store round trips per second (all nodes) and per node per interval, and for the files the
opens per second. Times are on one monotonic clock (one machine). ``BENCH_SCALE_OUTS=FILE``
writes every node's own numbers there (the last scenario's), to look into a slow one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any

from launch import nodes as nodes_mod
from launch.kv import KV, TCPKV, _tcpstore
from launch.nodes import AGREEING, IN_ATTEMPT, Coordinator, FilePeers
from launch.store_peers import StorePeers
from orchestrator.errors import EXIT_NODE_LOST

# Nodes per process: torch's TCPStore client stops connecting past about 24 clients in one
# process (measured with torch 2.13: the 25th times out), and one supervisor is one process.
THREADS_PER_PROC = 16
STAGGER_S = 0.25
CONNECTS_PER_S = 40
STORE_TIMEOUT_S: float | None = None  # --store-timeout: the supervisors' own, else


class _TimedKV(TCPKV):
    """A client that notes when its last add (a beat) returned."""

    beat_at: float | None = None

    def add(self, key: str, amount: int) -> int:
        got = super().add(key, amount)
        self.beat_at = time.monotonic()
        return got


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(port: int, ready: Any) -> None:
    """The store's host: serves until killed. First in line for the CPU, as on a cluster,
    where it does not share two cores with a thousand supervisors (root only)."""
    with contextlib.suppress(OSError):
        os.nice(-15)
    # torch's server looks up the name of every client that connects (getnameinfo, on its one
    # thread). On its default dual-stack socket a loopback client is ::ffff:127.0.0.1, which
    # /etc/hosts does not name, so each connect asks the resolver: this sandbox's drops about
    # 2% of queries (5 s each), and 1,024 nodes joining stalled the server for minutes. An
    # IPv4 socket makes the client 127.0.0.1, which /etc/hosts answers at once. (On a cluster
    # the same lookups go to its DNS: docs/scale.md, "Limits and assumptions".)
    sock = socket.socket(socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(4096)
    TCPStore = _tcpstore()
    store = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
        timeout=datetime.timedelta(seconds=30), master_listen_fd=sock.fileno(),
    )  # fmt: skip
    ready.set()
    while store is not None:  # held: the store lives as long as this process
        time.sleep(3600)


def _wait(p: Coordinator) -> None:
    """The supervisor's wait between looks (launch/cluster.py): a poll, ended early by the
    store's news."""
    wake = getattr(p, "wake", None)
    if wake is None:
        time.sleep(p.poll_s)
    else:
        wake.wait(p.poll_s)
        wake.clear()


def _agree(p: Coordinator, attempt: int, deadline: float) -> float | None:
    """Propose ``attempt`` until every node is at it (as launch/cluster.py does)."""
    while time.monotonic() < deadline:
        p.at(attempt, AGREEING)
        top, start = p.propose(attempt)
        p.lost(3600.0)  # as launch/cluster.py's loop looks each time (the files read them)
        if start and top == attempt:
            p.at(attempt, IN_ATTEMPT)
            return time.monotonic()
        _wait(p)
    return None


def _drive(p: Coordinator, idx: int, cfg: dict[str, Any], out: dict[str, Any]) -> None:
    """One node's supervisor, as the scenario says."""
    limit = cfg["limit_s"]
    # Staggered within a process: torch's TCPStore clients time out connecting when many
    # connect from one process at once (one supervisor is one process on a real cluster).
    # So is the whole job on this 2-core machine: about CONNECTS_PER_S connects a second
    # (64 processes of Python starve the one serving the store).
    procs = -(-cfg["nodes"] // THREADS_PER_PROC)
    time.sleep(max(STAGGER_S, procs / CONNECTS_PER_S) * (idx % THREADS_PER_PROC))
    p.start()
    out["agreed0"] = _agree(p, 0, time.monotonic() + limit)
    out["go"] = cfg["go"].wait(limit)  # every node agreed on 0: the fault comes now
    t0 = time.monotonic()
    if cfg["scenario"] in ("crash", "files"):
        if idx == 0:
            out["agreed1"] = _agree(p, 1, t0 + limit)
        else:
            while p.ahead(0) is None and time.monotonic() < t0 + limit:
                _wait(p)
            out["saw_ahead"] = time.monotonic()
            out["agreed1"] = _agree(p, 1, t0 + limit)
        cfg["ended_go"].wait(limit)
        if idx == 1:
            out["end_at"] = time.monotonic()
            p.exited(74, "gave up (simulated)")
            return
        while time.monotonic() < t0 + 2 * limit:
            p.lost(3600.0)  # the files: this is what reads them; the store: a cached look
            if (end := p.ended(fresh=False)) is not None:
                break
            _wait(p)
        out["ended"] = (time.monotonic(), end and end.node, end and end.exit_code)
    elif cfg["scenario"] in ("lost", "store", "stopped"):
        if cfg["scenario"] == "lost" and idx == cfg["victim"]:
            assert isinstance(p, StorePeers)
            p._stop.set()  # its supervisor is gone: no more beats, no exit said
            if p._thread is not None:
                p._thread.join()
            # Counted from its last beat that the store took (a starved thread's last beat
            # can be seconds before the stop).
            out["last_beat"] = getattr(p._kv, "beat_at", None) or time.monotonic()
            return
        # As launch/cluster.py: a node's own verdict, or the end a node that named it first
        # set (the supervisor then exits 77 with that node's words: "one end").
        while time.monotonic() < t0 + limit:
            if (why := p.lost(cfg["node_timeout_s"])) is not None:
                out["lost"] = (time.monotonic(), why)
                if cfg["scenario"] == "lost":
                    p.exited(EXIT_NODE_LOST, why)  # (a lost store: nobody can tell the others)
                return
            if (end := p.ended(fresh=False)) is not None and end.exit_code == EXIT_NODE_LOST:
                out["lost"], out["by_end"] = (time.monotonic(), end.reason), True
                return
            _wait(p)


def _proc(
    names: list[int], cfg: dict[str, Any], store: tuple[str, int], q: Any, go: Any, ended_go: Any
) -> None:
    """One process of simulated nodes: a thread per node."""
    _tcpstore()  # torch imported once, before the threads, and as quiet as the supervisor's

    cfg = {**cfg, "go": go, "ended_go": ended_go}
    run_dir, interval = cfg["run_dir"], cfg["interval_s"]
    files_opened = [0]
    if cfg["scenario"] == "files":
        real = nodes_mod.supervisors

        def counted(d: str) -> list[dict[str, Any]]:
            got = real(d)
            files_opened[0] += len(got)
            return got

        nodes_mod.supervisors = counted
    peers: list[Coordinator] = []
    kvs: list[TCPKV] = []
    for i in names:
        if cfg["scenario"] == "files":
            peers.append(FilePeers(run_dir, f"n{i:04d}", cfg["nodes"], interval))
            continue

        def connect(kvs: list[TCPKV] = kvs) -> KV:
            kv = _TimedKV(store[0], store[1], cfg["store_timeout_s"])
            kvs.append(kv)
            return kv

        peers.append(StorePeers(
            run_dir, f"n{i:04d}", cfg["nodes"], interval, connect,
            node_timeout_s=cfg["node_timeout_s"], store_words="", linger_s=0.0,
            where=f"tcp://{store[0]}:{store[1]}", wake=threading.Event(),
        ))  # fmt: skip
    outs: list[dict[str, Any]] = [{} for _ in names]
    threads = [
        threading.Thread(target=_drive, args=(p, i, cfg, o), daemon=True)
        for p, i, o in zip(peers, names, outs, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * cfg["limit_s"])
    ops = sum(kv.ops for kv in kvs)
    q.put({"outs": outs, "ops": ops, "files_opened": files_opened[0], "at": time.monotonic()})
    q.close()
    q.join_thread()  # flushed before the exit below
    os._exit(0)  # daemon beat threads: nothing to wait for


def run(n: int, scenario: str, interval_s: float, node_timeout_s: float) -> dict[str, Any]:
    """One scenario at ``n`` nodes; the measured numbers."""
    ctx = mp.get_context("fork")
    port = _free_port()
    ready = ctx.Event()
    server = ctx.Process(target=_serve, args=(port, ready), daemon=True)
    server.start()
    assert ready.wait(60), "the store did not start"
    run_dir = tempfile.mkdtemp(prefix=f"scale-{scenario}-{n}-")
    cfg = {
        "nodes": n, "scenario": scenario, "interval_s": interval_s, "run_dir": run_dir,
        "node_timeout_s": node_timeout_s,
        "store_timeout_s": STORE_TIMEOUT_S or max(5.0, 4 * interval_s),
        "limit_s": node_timeout_s * 4 + 60, "victim": n - 1,
    }  # fmt: skip
    q, go, ended_go = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=_proc, args=(list(range(s, min(n, s + THREADS_PER_PROC))), cfg,
                                        ("127.0.0.1", port), q, go, ended_go))
        for s in range(0, n, THREADS_PER_PROC)
    ]  # fmt: skip
    t_start = time.monotonic()
    for p in procs:
        p.start()
    fault = _phases(n, scenario, server, go, ended_go, run_dir, t_start, cfg["limit_s"])
    got = [q.get(timeout=6 * cfg["limit_s"]) for _ in procs]
    for p in procs:
        p.join(30)
    server.kill()
    outs = [o for g in got for o in g["outs"]]
    return _report(n, scenario, outs, got, fault, t_start, interval_s, node_timeout_s)


def _phases(
    n: int, scenario: str, server: Any, go: Any, ended_go: Any, run_dir: str, t0: float,
    limit: float,
) -> dict[str, float]:  # fmt: skip
    """The parent's side: wait until every node agreed on 0 (counted from their files'
    attempt, which every node writes on change), then release the fault."""
    deadline = t0 + limit
    while time.monotonic() < deadline:
        sups = nodes_mod.supervisors(run_dir)
        if len(sups) == n and all(s.get("phase") == IN_ATTEMPT for s in sups):
            break
        time.sleep(0.2)
    fault = {"at": time.monotonic()}
    if scenario in ("store", "stopped"):
        os.kill(server.pid, signal.SIGKILL if scenario == "store" else signal.SIGSTOP)
    go.set()
    if scenario in ("crash", "files"):
        while time.monotonic() < deadline + limit:
            sups = nodes_mod.supervisors(run_dir)
            if len(sups) == n and all(
                (int(s.get("attempt", -1)), s.get("phase")) == (1, IN_ATTEMPT) for s in sups
            ):
                break
            time.sleep(1.0)
        fault["end_go"] = time.monotonic()
        ended_go.set()
    return fault


def _report(
    n: int, scenario: str, outs: list[dict[str, Any]], got: list[dict[str, Any]],
    fault: dict[str, float], t0: float, interval_s: float, node_timeout_s: float,
) -> dict[str, Any]:  # fmt: skip
    duration = max(g["at"] for g in got) - t0
    a0 = [o.get("agreed0") for o in outs]
    row: dict[str, Any] = {
        "nodes": n, "scenario": scenario, "seconds": round(duration, 1),
        "all_agreed_0": all(a0),
        "agree_0_s": round(max(a for a in a0 if a) - t0, 2) if any(a0) else None,
    }  # fmt: skip
    if scenario in ("crash", "files"):
        a1 = [o.get("agreed1") for o in outs if "agreed1" in o]
        row["all_agreed_1"] = len(a1) == n and all(a1)
        row["agree_after_crash_s"] = (
            round(max(a for a in a1 if a) - fault["at"], 2) if any(a1) else None
        )
        ends = [o["ended"] for o in outs if "ended" in o]
        row["same_end"] = len(ends) == n - 1 and all(e[1] == "n0001" and e[2] == 74 for e in ends)
        row["end_seen_s"] = round(max(e[0] for e in ends) - fault["end_go"], 2) if ends else None
    if scenario in ("lost", "store", "stopped"):
        losts = [o["lost"] for o in outs if "lost" in o]
        want = f"n{n - 1:04d}" if scenario == "lost" else "store"
        row["all_named"] = len(losts) == (n - 1 if scenario == "lost" else n) and all(
            w is not None and want in w for _, w in losts
        )
        start = [o["last_beat"] for o in outs if "last_beat" in o] or [fault["at"]]
        took = sorted(t - start[0] for t, _ in losts)
        row["detect_s"] = round(took[-1], 2) if took else None  # the slowest node
        row["detect_median_s"] = round(took[len(took) // 2], 2) if took else None
        row["detect_min_s"] = round(took[0], 2) if took else None  # never before the timeout
        row["bound_s"] = node_timeout_s + interval_s
        row["example"] = next((w for _, w in losts if w), None)
        row["by_end"] = sum(1 for o in outs if o.get("by_end"))  # named through the end
    ops = sum(g["ops"] for g in got)
    if os.environ.get("BENCH_SCALE_OUTS"):  # every node's own numbers, to look into
        with open(os.environ["BENCH_SCALE_OUTS"], "w", encoding="utf-8") as f:
            json.dump({"t0": t0, "fault": fault, "outs": outs}, f)
    row["store_ops_per_s"] = round(ops / duration, 1)
    row["ops_per_node_per_interval"] = round(ops / duration / n * interval_s, 2)
    if scenario == "files":
        opened = sum(g["files_opened"] for g in got)
        row["files_opened_per_s"] = round(opened / duration, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="8,128,1024")
    ap.add_argument("--scenarios", default="crash,lost,store,stopped")
    ap.add_argument("--files", default="8,128", help="node counts to run `files` at too")
    # 2 s: what this machine drives at 1,024 nodes (about 900 store calls a second in all)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--node-timeout", type=float, default=30.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--store-timeout", type=float, default=30.0,
                    help="a store client's timeout (the supervisors' own is 4 intervals): "
                    "longer here, where 1,024 nodes joining starve the store of CPU")  # fmt: skip
    a = ap.parse_args(argv)
    global STORE_TIMEOUT_S
    STORE_TIMEOUT_S = a.store_timeout
    rows = []
    for n in [int(x) for x in a.nodes.split(",")]:
        scenarios = a.scenarios.split(",")
        if str(n) in a.files.split(","):
            scenarios.append("files")
        for sc in scenarios:
            row = run(n, sc, a.interval, a.node_timeout)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
