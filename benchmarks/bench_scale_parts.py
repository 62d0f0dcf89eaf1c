"""What grows with the node count besides the supervisors' coordination (issue 34, item 2),
measured on a synthetic run directory written with the project's own writers
(``orchestrator.journal.Journal``, ``orchestrator.heartbeat.Heartbeat``, the supervisors'
files as ``launch.nodes.Peers`` writes them), and the durable commit against the real S3
server the tests use (moto, tests/s3_server.py). docs/scale.md reads these numbers.

    python benchmarks/bench_scale_parts.py --nodes 8,128,1024          # the table
    python benchmarks/bench_scale_parts.py --nodes 8 --parts 64 --json # one row per line

Each reader runs once to warm the page cache, then ``--reps`` times; the median is shown.
``opens`` counts every file opened (Python's ``open`` audit event: ``open()`` and
``os.open``), ``lists`` every directory listed (``os.listdir``/``os.scandir``/``glob``),
``KB`` the bytes read (``rchar`` of /proc/self/io: every read() of the process). Local disk
with a warm page cache: on NFS or Lustre every open is one or more round trips to a server
(docs/scale.md), so ``opens`` is the column that carries over, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # s3_server: the tests' moto helpers

from launch.nodes import IN_ATTEMPT, Peers  # noqa: E402
from orchestrator.heartbeat import Heartbeat, read_heartbeats  # noqa: E402
from orchestrator.journal import Journal, read_events  # noqa: E402
from orchestrator.journal_tail import JournalTail  # noqa: E402
from orchestrator.protocol import ENV_NODE, METRICS_NAME, SUPERVISORS_DIR  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_scale_stores import commit_rows, health_rows  # noqa: E402

COUNTS: Counter[str] = Counter()
_COUNTING = [False]


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _COUNTING[0]:
        return
    if event == "open":
        COUNTS["opens"] += 1
    elif event in ("os.listdir", "os.scandir", "glob.glob"):
        COUNTS["lists"] += 1


sys.addaudithook(_audit)


def _rchar() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("rchar:"))


def measure(fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    """Median wall time (ms), and the opens, listings and KB read of one call (warm)."""
    fn()  # warm: page cache, imports, lazy state
    times, counts = [], {}
    for _ in range(reps):
        COUNTS.clear()
        before = _rchar()
        _COUNTING[0] = True
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
        _COUNTING[0] = False
        counts = {"opens": COUNTS["opens"], "lists": COUNTS["lists"],
                  "kb": round((_rchar() - before) / 1024)}  # fmt: skip
    return {"ms": round(statistics.median(times), 1), **counts, "out": out}


# --- the synthetic run directory -----------------------------------------------------------------
@contextmanager
def _as_node(node: str) -> Iterator[None]:
    old = os.environ.get(ENV_NODE)
    os.environ[ENV_NODE] = node
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_NODE, None)
        else:
            os.environ[ENV_NODE] = old


def build_run(run_dir: str, nodes: int, per_node: int, extra_events: int) -> None:
    """A job of ``nodes`` x ``per_node`` ranks in its second attempt (the first ended in a
    crash and a job-wide restart): each node's journal (its supervisor's and its ranks'
    events), its ranks' heartbeats, its supervisor's file; three nodes not running well
    (one exited 77, one exited 1, one whose file stopped changing a minute ago); rank 0's
    decisions and metrics as a run of 1,000 steps writes them."""
    os.makedirs(os.path.join(run_dir, SUPERVISORS_DIR), exist_ok=True)
    host = "host"
    for i in range(nodes):
        node = f"n{i:04d}"
        with _as_node(node):
            _node_journal(run_dir, node, host, i, per_node, extra_events)
            for r in range(per_node):
                hb = Heartbeat(run_dir, i * per_node + r, 1, 1.0)
                hb.beat(1000 - (r == 5 and i == 1) * 3, force=True)  # one rank behind
            peers = Peers(run_dir, node, nodes, 1.0)
            peers.publish(addr=f"{host}-{i}:29500", replica=f"{host}-{i}:29600")
            peers.at(1, IN_ATTEMPT)
            if i == 2 and nodes > 2:
                peers.exited(77, "lost node n0003")
            if i == 4 and nodes > 4:
                peers.exited(1, "crash loop")
    if nodes > 3:  # n0003's supervisor stopped beating a minute ago
        path = os.path.join(run_dir, SUPERVISORS_DIR, "n0003.json")
        doc = json.loads(Path(path).read_text())
        doc["time"] -= 60
        Path(path).write_text(json.dumps(doc))
    with open(os.path.join(run_dir, METRICS_NAME), "w", encoding="utf-8") as f:
        t0 = time.time() - 10  # 1,000 steps of 10 ms, up to now
        for s in range(1000):
            row = {"time": t0 + s / 100, "step": s, "attempt": int(s >= 500), "loss": 3 - s / 500,
                   "grad_norm": 1.0, "lr": 1e-3, "step_s": 0.01, "check_s": 0.001,
                   "outcome": "ok"}  # fmt: skip
            f.write(json.dumps(row) + "\n")


def _node_journal(
    run_dir: str, node: str, host: str, i: int, per_node: int, extra_events: int
) -> None:
    """What one node's supervisor and ranks journal over two attempts."""
    for attempt in (0, 1):
        sup = Journal(run_dir, -1, attempt)
        sup.write("attempt_start", 500 * attempt, {"node": node, "host": host, "cmd": ["torchrun"]})
        for r in range(per_node):
            j = Journal(run_dir, i * per_node + r, attempt)
            j.write("first_step", 500 * attempt, {"resumed": attempt > 0})
            j.close()
        if i == 0:  # rank 0's decisions: once for the job
            j = Journal(run_dir, 0, attempt)
            j.write("run_start", 500 * attempt, {"world_size": per_node})
            for s in range(500 * attempt, 500 * attempt + 500, 50):
                j.write("snapshot", s, {"stall_ms": 3.0, "tier": "memory"})
                if s % 100 == 0:
                    j.write("persist", s, {"url": "s3://b/p", "bytes": 1 << 30, "write_s": 9.0})
            j.close()
        for k in range(extra_events):
            sup.write("persist_retry", 500 * attempt + k, {"op": "write", "error": "SlowDown"})
        if attempt == 0:
            sup.write("attempt_end", 499, {"outcome": "crashed", "returncode": 1, "node": node})
            restart = {"cause": "crash", "returncode": 1, "restart": 1, "next_attempt": 1}
            sup.write("restart", 499, {**restart, "delay_s": 1.0, "node": node})
        sup.close()


# --- the readers ---------------------------------------------------------------------------------
def run_dir_rows(nodes: int, per_node: int, extra_events: int, reps: int) -> list[dict[str, Any]]:
    from launch.exporter import Exporter, RunFollower
    from launch.nodes import supervisors
    from launch.report import write_report
    from launch.status import render

    base = tempfile.mkdtemp(prefix="scale-")
    run_dir = os.path.join(base, "run")
    try:
        t0 = time.perf_counter()
        build_run(run_dir, nodes, per_node, extra_events)
        built_s = time.perf_counter() - t0
        tail = JournalTail(run_dir)  # status --follow: each screen reads what was appended
        tail.update()
        follower = RunFollower(run_dir)
        follower.update()  # caught up: a poll reads only what was appended since
        node = "n0000"
        with _as_node(node):
            beat = Heartbeat(run_dir, 0, 1, 1.0)  # a rank's writer, as every interval_s
        cases: list[tuple[str, Callable[[], Any], Callable[[Any], str]]] = [
            ("status", lambda: render(run_dir), lambda s: f"{len(s.splitlines())} lines"),
            ("status --follow: a later screen", lambda: render(run_dir, log=tail.update()),
             lambda s: f"{len(s.splitlines())} lines"),
            ("report", lambda: write_report(run_dir, os.path.join(base, "rep")),
             lambda r: f"{len(Path(r[0]).read_text().splitlines())} md lines"),
            ("journal: full read", lambda: read_events(run_dir),
             lambda log: f"{len(log.events)} events"),
            ("journal: poll by offset", follower.update, lambda _: "nothing new"),
            ("supervisors: every file", lambda: supervisors(run_dir), lambda s: f"{len(s)} files"),
            ("heartbeats: one rank's write", lambda: beat.beat(1000, force=True),
             lambda _: "write_record: a temporary file renamed"),
            ("heartbeats: one node", lambda: read_heartbeats(run_dir, node),
             lambda b: f"{len(b)} ranks"),
            ("heartbeats: every node", lambda: read_heartbeats(run_dir),
             lambda b: f"{len(b)} ranks"),
        ]  # fmt: skip
        try:
            exporter = Exporter(run_dir, node, 0, "127.0.0.1")
        except RuntimeError:  # prometheus-client missing: the row is left out
            exporter = None
        if exporter is not None:
            scrape = exporter.collect
            cases.append(("exporter: one scrape", lambda: list(scrape()), lambda m: f"{len(m)}"))
        rows = []
        for name, fn, say in cases:
            m = measure(fn, reps)
            rows.append({"part": name, "nodes": nodes, "ranks": nodes * per_node,
                         "ms": m["ms"], "opens": m["opens"], "lists": m["lists"], "kb": m["kb"],
                         "note": say(m["out"])})  # fmt: skip
        if exporter is not None:
            exporter.close()
        rows.append({"part": "(writing the run directory)", "nodes": nodes,
                     "ranks": nodes * per_node, "ms": round(built_s * 1e3), "opens": None,
                     "lists": None, "kb": None, "note": "not a reader"})  # fmt: skip
        return rows
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --- the table -----------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]], s3: list[dict[str, Any]]) -> str:
    out = [
        "| part | nodes | ranks | ms | opens | lists | KB read | |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['part']} | {r['nodes']} | {r['ranks']} | {r['ms']} | "
            f"{_n(r['opens'])} | {_n(r['lists'])} | {_n(r['kb'])} | {r['note']} |"
        )
    if s3:
        out += ["", "| durable commit (moto S3), health gather (TCPStore) | parts or ranks | ms | "
                "requests | by operation | |",
                "|---|---:|---:|---:|---|---|"]  # fmt: skip
        for r in s3:
            ops = ", ".join(f"{k} {v}" for k, v in r["by_op"].items())
            cells = [r["part"], r["parts"], r["ms"], r["requests"], ops, r["note"]]
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(out)


def _n(x: Any) -> str:
    return "-" if x is None else str(x)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="8,128,1024", help="node counts, comma-separated")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument(
        "--extra-events",
        type=int,
        default=0,
        help="more events per node and attempt (a longer or rougher run)",
    )
    p.add_argument(
        "--parts",
        default="64,1024,8192",
        help="durable parts (ranks) to commit on S3, comma-separated; '' skips",
    )
    p.add_argument(
        "--commit-max",
        type=int,
        default=1024,
        help="above this many parts only the LIST is measured (moto is slow)",
    )
    p.add_argument(
        "--health-worlds",
        default="64,1024,8192",
        help="ranks whose health evidence one rank reads from a TCPStore; '' skips",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in args.nodes.split(",") if x]:
        rows += run_dir_rows(n, args.ranks_per_node, args.extra_events, args.reps)
    parts = [int(x) for x in args.parts.split(",") if x]
    s3 = commit_rows(parts, args.commit_max) if parts else []
    worlds = [int(x) for x in args.health_worlds.split(",") if x]
    s3 += health_rows(worlds) if worlds else []
    if args.json:
        for r in rows + s3:
            print(json.dumps(r))
    else:
        print(table(rows, s3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
