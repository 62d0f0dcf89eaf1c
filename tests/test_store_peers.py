"""The supervisors agreeing through a store (issue 34): the watcher's rules
(launch/store_view.py) on their own, the coordination code of many simulated supervisors
against a real TCPStore (benchmarks/bench_scale.py, in a subprocess), and real supervisors
whose store's host is SIGKILLed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, kinds
from launch.nodes import RUNNING, agree_view
from launch.store_view import Watching, judge, resume
from orchestrator.errors import EXIT_NODE_LOST

pytestmark = pytest.mark.timeout(300)


def _rec(attempt: int, state: str = RUNNING) -> dict[str, Any]:
    return {"attempt": attempt, "state": state, "host": "h", "pid": 1}


def _look(w: Watching, now: float, beats: dict[str, int], recs: dict[str, Any], n: int = 3):
    return judge(w, now, beats, recs, nnodes=n, stale_s=10.0, quiet_s=1.0, watcher="a")


def test_the_view_agrees_only_when_every_node_is_alive_and_at_the_top() -> None:
    w = Watching(since=0.0)
    recs = {"a": _rec(2), "b": _rec(2)}
    v = _look(w, 0.0, {"a": 1, "b": 1}, recs)
    assert (v["alive"], v["agreed"], v["top"]) == (2, False, 2)  # the third never came
    recs["c"] = _rec(1)
    v = _look(w, 1.0, {"a": 2, "b": 2, "c": 1}, recs)
    assert (v["agreed"], v["top"], v["top_node"]) == (False, 2, "b")
    assert agree_view(1, v, "c") == (2, False)  # c takes up 2 and waits
    recs["c"] = _rec(2)
    v = _look(w, 2.0, {"a": 3, "b": 3, "c": 2}, recs)
    assert v["agreed"] and agree_view(2, v, "c") == (2, True)
    assert agree_view(3, v, "a") == (3, False)  # a proposes a later one: not yet


def test_a_lost_node_counts_from_its_last_beat_and_is_named() -> None:
    w = Watching(since=0.0)
    recs = {"a": _rec(0), "b": _rec(0), "c": _rec(0)}
    _look(w, 0.0, {"a": 1, "b": 1, "c": 1}, recs)
    _look(w, 1.0, {"a": 2, "b": 2, "c": 2}, recs)  # c's last change, seen at 1.0
    v = _look(w, 5.0, {"a": 6, "b": 6, "c": 2}, recs)
    assert v["alive"] == 3 and v["incomplete_for"] == -1.0  # quiet, within stale_s
    assert v["quiet"] == {"c": 4.0}
    v = _look(w, 12.0, {"a": 13, "b": 13, "c": 2}, recs)
    assert v["alive"] == 2 and v["down"] == ["c"]
    assert v["incomplete_for"] == 11.0  # since its last beat, not since it went stale
    assert "not alive: c (host h, pid 1, running, unchanged for 11 s)" in v["missing"]


def test_a_node_that_never_started_counts_from_the_watch_and_exited_ones_are_down() -> None:
    w = Watching(since=100.0)
    v = _look(w, 100.0, {"a": 1}, {"a": _rec(0)})
    v = _look(w, 130.0, {"a": 9}, {"a": _rec(0)})
    assert v["incomplete_for"] == 30.0 and "2 node(s) never started" in v["missing"]
    w = Watching(since=0.0)
    recs = {"a": _rec(0), "b": _rec(0, "exited")}
    v = _look(w, 0.0, {"a": 1, "b": 4}, recs, n=2)
    assert v["down"] == ["b"] and v["alive"] == 1 and v["quiet"] == {}


def test_a_new_watcher_carries_the_silences_on() -> None:
    """The watch changes hands (its node lost, or too slow to look): the lost-node clock of
    a quiet node goes on from the last view, never restarts, and is never early; the old
    watcher counts from when the view last changed; a node that moved is not carried."""
    w = Watching(since=0.0)
    recs = {"a": _rec(0), "b": _rec(0), "c": _rec(0), "d": _rec(0)}
    _look(w, 0.0, {"a": 1, "b": 1, "c": 1, "d": 1}, recs, n=4)
    _look(w, 1.0, {"a": 2, "b": 2, "c": 2, "d": 2}, recs, n=4)  # c's last beat, seen at 1
    last = _look(w, 6.0, {"a": 7, "b": 7, "c": 2, "d": 2}, recs, n=4)
    assert last["quiet"] == {"c": 5.0, "d": 5.0} and last["quiet_beats"] == {"c": 2, "d": 2}
    # b read that view at 6.5, saw it change last at 6.5, and takes the watch at 20: "a"
    # (the old watcher) is silent, c still is, d beat in between.
    nw = resume(last, 6.5, 20.0, {"a": 7, "b": 21, "c": 2, "d": 3}, old_watcher_since=6.5)
    v = judge(nw, 20.0, {"a": 7, "b": 21, "c": 2, "d": 3}, recs, nnodes=4, stale_s=10.0,
              quiet_s=1.0, watcher="b")  # fmt: skip
    assert v["down"] == ["a", "c"]
    # c: 5 s silent at the read (6.5), 13.5 s since; not restarted at 20, and never more
    # than its true silence (its last beat was seen at 1: 19 s).
    assert v["incomplete_for"] == 18.5 <= 20.0 - 1.0
    assert "d" not in v["quiet"] and "d" not in v["down"]  # it moved: counted afresh
    # A view that was incomplete already: its count goes on too.
    again = resume(v, 21.0, 30.0, {"a": 7, "b": 30, "c": 2, "d": 12}, old_watcher_since=None)
    assert again.complete_at == 21.0 - 18.5


def _simulate(tmp_path: Path, nodes: int, scenarios: str) -> list[dict[str, Any]]:
    out = tmp_path / "rows.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_scale", "--nodes", str(nodes), "--scenarios",
         scenarios, "--files", "", "--interval", "0.5", "--node-timeout", "5",
         "--store-timeout", "5", "--json", str(out)],  # the supervisors' own timeout
        cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return list(json.loads(out.read_text()))


def test_many_supervisors_agree_end_together_and_name_a_lost_node_or_store(
    tmp_path: Path,
) -> None:
    """48 supervisors (threads in three processes) against a real TCPStore: after one node's
    crash all agree on attempt 1; one node's end (74) reaches every node; a node that stops
    beating is named by every node within node_timeout_s plus a few intervals (measured:
    one to two); the store's process killed, or stopped (its calls never return), is named
    by every node as well, and nothing hangs."""
    rows = {r["scenario"]: r for r in _simulate(tmp_path, 48, "crash,lost,store,stopped")}
    crash, lost = rows["crash"], rows["lost"]
    assert crash["all_agreed_0"] and crash["all_agreed_1"] and crash["same_end"], crash
    # node_timeout_s (5) after the last beat, never before, and at most one interval (0.5 s:
    # the watcher's look, then each node's read of the view, half an interval each) after,
    # plus a second for a loaded machine's scheduling.
    bound = 5 + 0.5 + 1.0
    assert lost["all_named"] and 5.0 <= lost["detect_min_s"] <= lost["detect_s"] <= bound, lost
    assert "n0047" in lost["example"]
    for store in (rows["store"], rows["stopped"]):
        assert store["all_named"] and store["detect_s"] <= bound, store
        assert "tcp://127.0.0.1:" in store["example"]
    # O(1) per node: three round trips an interval (a beat, two reads of the view), the
    # watcher's few and each change's one, averaged over the nodes.
    assert crash["ops_per_node_per_interval"] < 4.0, crash
    assert lost["ops_per_node_per_interval"] < 4.0, lost


def test_the_store_hosts_loss_ends_the_other_node_with_77(tmp_path: Path) -> None:
    """Two real supervisors (tests/test_nodes.py's setup) through the default store: the
    node whose supervisor serves it is lost (its process group SIGKILLed: supervisor,
    launcher, rank); the other carries on through a store of its own and exits 77 after
    node_timeout_s, never hangs."""
    from test_nodes import BASE, FAST, finish, start_nodes

    d = tmp_path / "run"
    policy = {**BASE, "supervisor": {**FAST, "node_timeout_s": 8.0}}
    procs = start_nodes(d, policy, "--steps", "100000")
    try:
        deadline = time.monotonic() + 180
        server = None
        while server is None:  # bounded poll: who serves the store, once training
            assert time.monotonic() < deadline, "no node serves the store"
            sups = [json.loads(p.read_text()) for p in (d / "supervisors").glob("*.json")]
            server = next((s for s in sups if s.get("serves_store")), None)
            if server is None or not (d / "heartbeats").exists():
                server = None
                time.sleep(0.5)
        victim = procs[int(str(server["node"])[1:])]
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        other = procs[1 - procs.index(victim)]
        (r,) = finish([other], timeout=120)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert r.returncode == EXIT_NODE_LOST, r.stdout[-3000:]
    assert took < 8.0 + 30.0, took  # node_timeout_s, the launcher's own end, the timeout
    # On one host the store's address is this node's too: it serves a new store in its place
    # (on a cluster, a node whose address it is: the lost one, back) and waits there for the
    # lost node like any other (the store's loss seen from another host is named as such:
    # the simulation above, "store" and "stopped").
    (lost,) = kinds(d, "node_lost")
    survivor = json.loads((d / "supervisors" / f"{lost['details']['node']}.json").read_text())
    assert survivor["serves_store"] is True and survivor["node"] != server["node"], survivor
    assert "1 of 2 nodes have a live supervisor" in lost["details"]["why"], lost
