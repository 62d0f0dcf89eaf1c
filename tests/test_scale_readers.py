"""`status` and `report` on a run of many nodes (issue 34, docs/scale.md): past a few nodes
they sum the nodes and ranks up and list those that need a look, not one line each; `status
--all` still shows every one. A synthetic run directory written with the project's own
writers (the journal, the heartbeats, the supervisors' files). In-process, a second."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import run
from launch.nodes import IN_ATTEMPT, Peers
from launch.report import load, markdown, timeline
from launch.status import EACH_NODE_UP_TO, NEED_A_LOOK, render
from orchestrator.heartbeat import Heartbeat
from orchestrator.journal import Journal
from orchestrator.protocol import ENV_NODE

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
