"""What grows with the node count (issue 34, docs/scale.md). `status` and `report` on a run
of many nodes: past a few nodes they sum the nodes and ranks up and list those that need a
look, not one line each; `status --all` still shows every one (a synthetic run directory
written with the project's own writers: the journal, the heartbeats, the supervisors'
files). The durable commit waits for the ranks' parts with one listing of the step folder a
round, not a request per part (the real S3 server of the tests). In-process, seconds."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conftest import run
from launch.exporter import Exporter
from launch.nodes import IN_ATTEMPT, Peers
from launch.report import load, markdown, timeline
from launch.status import EACH_NODE_UP_TO, NEED_A_LOOK, follow, render
from orchestrator.errors import PersistError
from orchestrator.heartbeat import Heartbeat
from orchestrator.journal import Journal, read_events
from orchestrator.journal_tail import JournalTail
from orchestrator.manifest import step_dir
from orchestrator.protocol import ENV_NODE, METRICS_NAME
from orchestrator.store import DurableStore

pytestmark = pytest.mark.timeout(60)

NODES, PER_NODE = 24, 4  # past status's and report's limits (16 nodes, 64 ranks)


def many_nodes(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """24 nodes of 4 ranks in attempt 1 after a job-wide restart (every node journals it;
    n0007's cause differs); n0002 exited 77, n0004 exited 1, n0003's supervisor quiet for
    a minute; rank 13 two steps behind the others."""
    for i in range(NODES):
        node = f"n{i:04d}"
        monkeypatch.setenv(ENV_NODE, node)
        for attempt in (0, 1):
            sup = Journal(str(run_dir), -1, attempt)
            sup.write("attempt_start", 10 * attempt, {"node": node, "host": "h", "cmd": ["x"]})
            if attempt == 0:
                cause = "hang" if i == 7 else "crash"
                said = {"cause": cause, "returncode": 1, "restart": 1, "next_attempt": 1}
                sup.write("restart", 9, {**said, "delay_s": 1.0, "node": node})
            sup.close()
        for r in range(PER_NODE):
            rank = i * PER_NODE + r
            Heartbeat(str(run_dir), rank, 1, 1.0).beat(18 if rank == 13 else 20, force=True)
        peers = Peers(str(run_dir), node, NODES, 1.0)
        os.makedirs(os.path.dirname(peers.path), exist_ok=True)
        peers.at(1, IN_ATTEMPT)
        if i in (2, 4):
            peers.exited(77 if i == 2 else 1, "lost node n0003" if i == 2 else "crash loop")
    quiet = run_dir / "supervisors" / "n0003.json"
    doc = json.loads(quiet.read_text())
    quiet.write_text(json.dumps({**doc, "time": doc["time"] - 60}))


def rows(screen: str, prefix: str) -> list[list[str]]:
    return [ln.split() for ln in screen.splitlines() if ln.split()[:1] and
            ln.split()[0].startswith(prefix)]  # fmt: skip


def test_status_sums_up_many_nodes_and_lists_those_that_need_a_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    many_nodes(tmp_path, monkeypatch)
    screen = render(str(tmp_path))
    assert f"nodes {NODES}: running {NODES - 2} (1 quiet" in screen, screen
    assert "exited 2 (code 1: 1, code 77: 1)" in screen, screen
    # Only the nodes that need a look: exited other than 0, then the quiet one.
    assert [r[0] for r in rows(screen, "n0")] == ["n0002", "n0004", "n0003"], screen
    assert f"ranks {NODES * PER_NODE}: attempt 1 ({NODES * PER_NODE})" in screen, screen
    ranks = [r for r in rows(screen, "") if r[0].isdigit()]
    assert len(ranks) == NEED_A_LOOK and ranks[0][:3] == ["13", "1", "18"], screen  # behind
    assert f"and {NODES * PER_NODE - NEED_A_LOOK} more" in screen, screen
    assert len(screen.splitlines()) < 40, screen
    # --all: a line for every node and rank, as below the limits.
    every = run([sys.executable, "-m", "launch.cli", "status", str(tmp_path), "--all"], timeout=60)
    assert every.returncode == 0, every.stdout
    assert len(rows(every.stdout, "n0")) == NODES, every.stdout
    ranks = [r for r in rows(every.stdout, "") if r[0].isdigit()]
    assert sorted(int(r[0]) for r in ranks) == list(range(NODES * PER_NODE)), every.stdout


def test_report_says_a_restart_of_many_nodes_once_per_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    many_nodes(tmp_path, monkeypatch)
    rec = load(str(tmp_path))
    restarts = [row[3] for row in timeline(rec) if row[2] == "restart"]
    assert restarts == [
        f"attempt ended: crash (exit 1) on n0000 and {NODES - 2} other nodes",
        "attempt ended: hang (exit 1) on n0007",
    ], restarts
    md = markdown(str(tmp_path), rec, None, None)
    names = ", ".join(f"n{i:04d}" for i in range(EACH_NODE_UP_TO // 2))
    assert f"| nodes | {NODES}: {names}, ..., n{NODES - 1:04d} |" in md, md
    assert "| restarts | 1 |" in md, md


def test_the_commit_lists_the_step_folder_once_a_round_not_each_part(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's wait for the parts on S3: one LIST a round (a page per 1,000 names), a GET
    of each part, no HEAD per part; a part that never comes is named, as before."""
    import s3fs

    store = DurableStore(s3_url)
    for r in range(3):
        doc = {"rank": r, "nonce": "n", "files": {}}
        store._write_json(store.path(step_dir(5), f"rank_{r}.json"), doc)
    calls: Counter[str] = Counter()
    real = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        calls[method] += 1
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    manifest = store.commit(5, 3, "n", {}, timeout_s=10.0)
    assert calls["head_object"] == 0 and calls["list_objects_v2"] == 1, calls
    assert manifest["ranks"] == [0, 1, 2] and store.committed_steps() == [5]
    calls.clear()
    with pytest.raises(PersistError, match=r"ranks \[3\] did not write their part"):
        store.commit(5, 4, "n", {}, timeout_s=0.0)  # one round: rank 3's part never comes
    assert calls["head_object"] == 0 and calls["list_objects_v2"] == 1, calls


def test_the_exporter_reads_its_own_nodes_heartbeats_and_rank_0s_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scrape reads this node's heartbeats (not every node's: N x ranks files at every
    scrape of every node), and the newest metrics row says where the job is."""
    pytest.importorskip("prometheus_client")
    many_nodes(tmp_path, monkeypatch)
    monkeypatch.setenv(ENV_NODE, "n0009")
    Heartbeat(str(tmp_path), 39, 1, 1.0).beat(99, force=True)  # n0009's rank, far ahead

    def step() -> float:
        (family,) = [f for f in exporter.collect() if f.name == "orchestrator_step"]
        return float(family.samples[0].value)

    exporter = Exporter(str(tmp_path), "n0001", 0, "127.0.0.1")
    try:
        assert step() == 20  # n0001's ranks (13 is at 18), not n0009's
        row = {"time": 1.0, "step": 30, "attempt": 1, "loss": 1.0}
        (tmp_path / METRICS_NAME).write_text(json.dumps(row) + "\n")
        assert step() == 30  # rank 0's newest row
    finally:
        exporter.close()


def test_status_follow_reads_the_journal_as_it_grows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`status --follow` parses only what was appended since its last look; what it holds
    is what a full read gives (a line still being written counted once it ends)."""
    many_nodes(tmp_path, monkeypatch)

    def same(tail: JournalTail) -> None:
        full, got = read_events(str(tmp_path)), tail.update()
        assert [(e.time, e.kind, e.rank) for e in got.events] == [
            (e.time, e.kind, e.rank) for e in full.events
        ]
        assert (got.damaged, got.unknown) == (full.damaged, full.unknown)

    tail = JournalTail(str(tmp_path))
    same(tail)
    assert (
        render(str(tmp_path), log=tail.update()).splitlines()[1]
        == (render(str(tmp_path)).splitlines()[1])
    )  # the counts line: restarts 1, attempt 1
    Journal(str(tmp_path), -1, 1).write("attempt_end", 30, {"outcome": "ok", "node": "n0009"})
    n3 = tmp_path / "journal" / "n0003.jsonl"
    with n3.open("a") as f:
        f.write('{"time": 1e10, "kind": "hang", "step')  # being written
    got = tail.update()
    assert [e.kind for e in got.events].count("attempt_end") == 1 and not got.damaged
    with n3.open("a") as f:
        f.write("\n" + '{"kind": ' + "\n")  # that line torn for good, then a damaged one
    same(tail)
    assert len(tail.update().damaged) == 2
    n3.unlink()  # a node's file gone, another replaced: read again, as a full read
    n4 = tmp_path / "journal" / "n0004.jsonl"
    lines = n4.read_text().splitlines(keepends=True)
    n4.unlink()
    n4.write_text("".join(lines[:1]))
    same(tail)
    # --follow itself: one screen, summed up, and done once every supervisor has exited.
    for path in (tmp_path / "supervisors").glob("*.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "state": "exited"}))
    assert follow(str(tmp_path), 0.01) == 0
    assert f"nodes {NODES}: running 0, exited {NODES}" in capsys.readouterr().out


def test_the_scale_benchmark_runs(s3_endpoint: str) -> None:
    """benchmarks/bench_scale_parts.py at a tiny size (docs/scale.md's numbers come from it:
    its writers and readers must keep up with the code's)."""
    args = ["--nodes", "20", "--ranks-per-node", "4", "--parts", "8", "--commit-max", "8",
            "--health-worlds", "8", "--reps", "1", "--json"]  # fmt: skip
    r = run([sys.executable, "benchmarks/bench_scale_parts.py", *args], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    by = {row["part"]: row for row in rows}
    assert by["status"]["opens"] >= 20 * (2 + 4), by  # journals, supervisors, heartbeats
    assert int(by["status"]["note"].split()[0]) < 40, by  # summed up, not a line each
    assert by["commit, every part there"]["by_op"]["list_objects_v2"] == 1, by
    assert by["health gather: a look per key (before)"]["requests"] == 8, by
