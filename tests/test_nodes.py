"""Two nodes on one machine: one supervisor per node (ORCHESTRATOR_NODE=n0, n1), torchrun
with a c10d rendezvous on 127.0.0.1, one rank per node. Black box, real signals."""

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
import yaml

from conftest import (
    EXAMPLE,
    REPO,
    assert_bitwise_equal,
    final_states,
    free_port,
    journal,
    kinds,
    run,
)
from launch.nodes import Peers, launcher_nodes
from launch.outcomes import next_attempt_number
from orchestrator.errors import EXIT_NODE_LOST, EXIT_PREEMPTED, EXIT_RESTARTS_EXHAUSTED
from orchestrator.heartbeat import read_heartbeats
from orchestrator.journal import Journal

pytestmark = pytest.mark.timeout(400)

FAST = {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5}
BASE = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}, "supervisor": FAST}


def start_nodes(
    run_dir: Path,
    policy: dict[str, Any],
    *args: str,
    nodes: tuple[int, ...] = (0, 1),
    policies: dict[int, dict[str, Any]] | None = None,
) -> list[subprocess.Popen[str]]:
    """Start the nodes' supervisors (n0 and n1 of a 2-node job, one rank each, c10d
    rendezvous, addresses 127.0.0.1 and .2); ``policies`` gives a node a policy of its own."""
    port = free_port()
    procs = []
    for node in nodes:
        own = (policies or {}).get(node)
        suffix = f"-n{node}" if own else ""
        path = run_dir.parent / f"{run_dir.name}-policy{suffix}.yaml"
        path.write_text(yaml.safe_dump(own or policy))
        cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
               "--run-dir", str(run_dir), "--", sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", run_dir.name,
               # Each node its own address, as on a cluster: c10d orders the nodes' ranks
               # by address (then pid), so they keep their ranks across restarts.
               "--local-addr", f"127.0.0.{node + 1}", str(EXAMPLE), *args,
               "--save-final", str(run_dir / "final")]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ORCHESTRATOR_NODE": f"n{node}"}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))  # fmt: skip
    return procs


def finish(
    procs: list[subprocess.Popen[str]], timeout: float = 300
) -> list[subprocess.CompletedProcess[str]]:
    """Wait for both supervisors (killing what is left on a timeout)."""
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return results


def two_nodes(run_dir: Path, policy: dict[str, Any], *args: str) -> list[Any]:
    return finish(start_nodes(run_dir, policy, *args))


def test_a_crash_on_one_node_restarts_both_bit_for_bit(tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    for r in two_nodes(clean, BASE, "--steps", "60"):
        assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    policy = {**BASE, "faults": [{"kind": "crash", "step": 50, "rank": 1}]}
    for r in two_nodes(d, policy, "--steps", "60"):
        assert r.returncode == 0, r.stdout[-3000:]
    starts = sorted((e["details"]["node"], e["attempt"]) for e in kinds(d, "attempt_start"))
    assert starts == [("n0", 0), ("n0", 1), ("n1", 0), ("n1", 1)]
    resumes = kinds(d, "resume")
    assert {e["attempt"] for e in resumes} == {1}
    assert resumes[0]["details"]["snapshot_step"] in (30, 40)
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
    # One journal file per node, and one merged view of them in status and report.
    assert sorted(p.name for p in (d / "journal").iterdir()) == ["n0.jsonl", "n1.jsonl"]
    times = [e["time"] for e in journal(d)]
    assert times == sorted(times)
    status = run([sys.executable, "-m", "launch.cli", "status", str(d)], timeout=60)
    assert status.returncode == 0, status.stdout
    for node in ("n0", "n1"):  # each node's supervisor, exited 0 after attempt 1
        (row,) = [ln.split() for ln in status.stdout.splitlines() if ln.split()[:1] == [node]]
        assert row[-3:-1] == ["exited", "0:"] and row[-4] == "1", status.stdout
    assert "restarts 1 " in status.stdout  # one job-wide restart, journaled by both nodes
    rep = run([sys.executable, "-m", "launch.cli", "report", str(d)], timeout=120)
    assert rep.returncode == 0, rep.stdout
    md = (d / "report.md").read_text()
    assert "| nodes | 2: n0, n1 |" in md and "| restarts | 1 |" in md
    rows = [
        ln for ln in md.splitlines() if ln.startswith("| 20") and "| restart |" in ln
    ]  # timeline
    assert sorted(r.split(" on ")[1].split(" ")[0].rstrip(")|") for r in rows) == ["n0", "n1"]


def test_a_hang_on_one_node_is_named_and_both_recover(tmp_path: Path) -> None:
    d = tmp_path / "run"
    sup = {**FAST, "hang_timeout_s": 6.0, "grace_s": 5}
    policy = {**BASE, "supervisor": sup, "faults": [{"kind": "hang", "step": 30, "rank": 0}]}
    for r in two_nodes(d, policy, "--steps", "50"):
        assert r.returncode == 0, r.stdout[-3000:]
    (fault,) = [e for e in kinds(d, "fault") if e["details"]["fault"]["kind"] == "hang"]
    # Each node's supervisor sees its own rank stall (the healthy one waits in a
    # collective); both read every rank's stack and name the same culprit: rank 0 (on
    # whichever node the rendezvous put it), at the fault's frame.
    hangs = kinds(d, "hang")
    assert sorted(e["details"]["node"] for e in hangs) == ["n0", "n1"]
    (home,) = [e["details"]["node"] for e in hangs if "0" in e["details"]["stalled_ranks"]]
    for e in hangs:
        (culprit,) = e["details"]["culprits"]
        assert (culprit["rank"], culprit["node"], culprit["phase"]) == (0, home, "backward")
        assert "process_faults" in culprit["frame"]
        assert e["time"] - fault["time"] <= 6.0 + 5
    for rank in (0, 1):  # every rank's stack, from both nodes
        assert (d / "hangs" / "attempt-0" / f"rank{rank}.txt").stat().st_size > 0
    assert "process_faults" in (d / "hangs" / "attempt-0" / "rank0.txt").read_text()
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 50


def test_preempting_both_nodes_snapshots_and_the_same_commands_resume(tmp_path: Path) -> None:
    d = tmp_path / "run"
    policy = {**BASE, "persist": {"every_steps": 1000}}  # only the preemption persists
    procs = start_nodes(d, policy, "--steps", "400")
    deadline = time.monotonic() + 120
    while not any(b["step"] >= 20 for b in read_heartbeats(str(d))):  # bounded poll
        assert time.monotonic() < deadline, "training never reached step 20"
        time.sleep(0.2)
    for p in procs:
        p.send_signal(signal.SIGTERM)  # to each supervisor, as Slurm does on preemption
    for r in finish(procs):
        assert r.returncode == EXIT_PREEMPTED, r.stdout[-3000:]
    (pre,) = kinds(d, "preempted")
    assert pre["details"]["persisted"] is True
    for r in two_nodes(d, policy, "--steps", "400"):
        assert r.returncode == 0, r.stdout[-3000:]
    (resume,) = kinds(d, "resume")
    assert resume["details"]["snapshot_step"] == pre["step"]
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 400


# covered by default: tests/test_shm.py's buddy test (the same SIGKILL of node 1's
# supervisor, its workers gone, a replacement joining, bit for bit, from shared memory) and
# test_a_crash_on_one_node_restarts_both_bit_for_bit (two nodes resuming from the durable tier)
@pytest.mark.matrix
def test_a_sigkilled_node_supervisor_is_replaced_and_the_job_finishes_bit_for_bit(
    tmp_path: Path,
) -> None:
    """SIGKILL node 1's supervisor: its workers end with it (within 5 s), node 0's attempt
    ends (its peer is gone) and its next attempt waits in the rendezvous; a new node-1
    supervisor started on the same run directory joins, and the job ends where an
    uninterrupted one does."""
    clean = tmp_path / "clean"
    for r in two_nodes(clean, BASE, "--steps", "60"):
        assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    procs = start_nodes(d, BASE, "--steps", "60")
    deadline = time.monotonic() + 120
    while not any(b["step"] >= 15 for b in read_heartbeats(str(d))):  # bounded poll
        assert time.monotonic() < deadline, "training never reached step 15"
        time.sleep(0.2)
    node1 = [b["pid"] for b in read_heartbeats(str(d)) if b["node"] == "n1"]
    procs[1].kill()  # SIGKILL: no cleanup of its own
    procs[1].wait(timeout=30)
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in node1):
        assert time.monotonic() < deadline, "node 1's workers outlived their supervisor"
        time.sleep(0.1)
    # The same command for node 1 again (as Slurm or a person would).
    path = d.parent / f"{d.name}-policy.yaml"
    again = subprocess.Popen(
        [*procs[1].args[:-2], *procs[1].args[-2:]], cwd=REPO, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "ORCHESTRATOR_NODE": "n1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    assert path.exists()
    for r in finish([procs[0], again]):
        assert r.returncode == 0, r.stdout[-3000:]
    (resume,) = kinds(d, "resume")
    committed = [e["step"] for e in kinds(d, "persist") if e["attempt"] == 0]
    assert resume["attempt"] == 1 and resume["details"]["snapshot_step"] == max(committed)
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_a_node_that_never_comes_ends_the_job_with_exit_77(tmp_path: Path) -> None:
    """Only node 0 of a 2-node job starts: its attempt waits in the rendezvous until
    supervisor.node_timeout_s, then the supervisor stops it and exits 77 naming the gap."""
    d = tmp_path / "run"
    policy = {**BASE, "supervisor": {**FAST, "node_timeout_s": 4.0}}
    t0 = time.monotonic()
    (r,) = finish(start_nodes(d, policy, "--steps", "20", nodes=(0,)))
    assert r.returncode == EXIT_NODE_LOST, r.stdout[-3000:]
    assert time.monotonic() - t0 < 60
    (lost,) = kinds(d, "node_lost")
    assert lost["details"]["nnodes"] == 2 and "never started" in lost["details"]["why"]
    (end,) = kinds(d, "supervisor_exit")
    assert end["details"]["exit_code"] == EXIT_NODE_LOST
    assert json.loads((d / "supervisors" / "n0.json").read_text())["state"] == "exited"


@pytest.mark.matrix  # on real separate networks: tests/test_hosts.py (where netns can be made)
def test_a_requeue_after_a_lost_node_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Node 1's supervisor and ranks SIGKILLed and left dead: node 0 ends 77 without
    starting an attempt alone (the nodes never agreed on one). Both started again with the
    same commands (a requeue) agree on one attempt id, though their journals' counts differ,
    and the job finishes bit for bit where an uninterrupted one does (issue 29: the counts
    stayed one apart and every restart was refused until a crash loop)."""
    clean = tmp_path / "clean"
    for r in two_nodes(clean, BASE, "--steps", "40"):
        assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    policy = {**BASE, "supervisor": {**FAST, "node_timeout_s": 4.0}}
    procs = start_nodes(d, policy, "--steps", "40")
    deadline = time.monotonic() + 120
    while not any(e["step"] >= 20 for e in kinds(d, "persist")):  # bounded poll
        assert time.monotonic() < deadline, "no durable snapshot of step 20"
        assert procs[0].poll() is None, procs[0].communicate()[0][-3000:]
        time.sleep(0.2)
    os.killpg(procs[1].pid, signal.SIGKILL)  # the supervisor and everything it started
    (r0,) = finish([procs[0]])
    assert r0.returncode == EXIT_NODE_LOST, r0.stdout[-3000:]
    assert not [e for e in kinds(d, "attempt_start") if e["attempt"] > 0]
    for r in finish(start_nodes(d, policy, "--steps", "40")):
        assert r.returncode == 0, r.stdout[-3000:]
    starts = {(e["details"]["node"], e["attempt"]) for e in kinds(d, "attempt_start")}
    assert starts == {("n0", 0), ("n1", 0), ("n0", 1), ("n1", 1)}, starts
    assert not [e for e in kinds(d, "attempt_end") if e["attempt"] == 1
                and e["details"]["outcome"] != "ok"]  # fmt: skip
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_a_finished_nodes_launcher_never_waits_for_a_peer_that_does_not_come(
    tmp_path: Path,
) -> None:
    """torchrun's exit barrier waits up to 300 s for every launcher of its rendezvous round
    (issue 29: a replaced node's launcher, in another round, never came). Node 1's torchrun
    is stopped (SIGSTOP) mid-run, so it never reaches the barrier while its rank trains on
    to the end: its supervisor ends the lingering launcher once the run finished
    (launcher_lingered) and both exit 0, well before the barrier's 300 s. Node 0's launcher
    waits in the barrier for node 1's and lingers too, unless the stop came late, after
    node 1's launcher had reached the barrier: then node 0's is let through and ends on its
    own (CI saw it once, polling late under load; 60 steps make it rare)."""
    from launch.procs import descendants

    d = tmp_path / "run"
    linger_s = 5.0  # supervisor.linger_s; 30 s by default
    policy = {**BASE, "supervisor": {**FAST, "linger_s": linger_s}}
    procs = start_nodes(d, policy, "--steps", "60")
    deadline = time.monotonic() + 120
    while not any(b["step"] >= 5 for b in read_heartbeats(str(d))):  # bounded poll
        assert time.monotonic() < deadline, "training never reached step 5"
        time.sleep(0.2)
    (agent,) = [p for p in descendants(procs[1].pid)
                if b"torch.distributed.run" in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
    os.kill(agent, signal.SIGSTOP)
    t0 = time.monotonic()
    results = finish(procs)
    assert [r.returncode for r in results] == [0, 0], [r.stdout[-2000:] for r in results]
    assert time.monotonic() - t0 < linger_s + 120  # not the barrier's 300 s
    lingered = {e["details"]["node"] for e in kinds(d, "launcher_lingered")}
    assert "n1" in lingered and lingered <= {"n0", "n1"}, kinds(d, "launcher_lingered")
    assert {e["details"]["outcome"] for e in kinds(d, "attempt_end")} == {"ok"}


def test_a_node_that_stops_for_good_stops_the_others(tmp_path: Path) -> None:
    """Node 1's supervisor may not restart (max_restarts: 0); after a crash it stops for
    good, and node 0, instead of waiting for it in the next rendezvous, stops too with its
    exit code (not 77 after node_timeout_s)."""
    d = tmp_path / "run"
    policy = {**BASE, "faults": [{"kind": "crash", "step": 12, "rank": 0}]}
    n1 = {**policy, "supervisor": {**FAST, "max_restarts": 0}}
    results = finish(start_nodes(d, policy, "--steps", "40", policies={1: n1}))
    assert [r.returncode for r in results] == [EXIT_RESTARTS_EXHAUSTED] * 2, [
        r.stdout[-2000:] for r in results
    ]
    exits = {e["details"]["node"]: e["details"] for e in kinds(d, "supervisor_exit")}
    assert "n1" in exits["n0"]["reason"] and exits["n1"]["exit_code"] == EXIT_RESTARTS_EXHAUSTED
    assert kinds(d, "node_lost") == []


def test_the_launcher_command_gives_the_node_count() -> None:
    torchrun = ["torchrun", "--nproc-per-node", "8", "train.py"]
    assert launcher_nodes(["torchrun", "--nnodes", "4", *torchrun[1:]], {}) == 4
    assert launcher_nodes(["torchrun", "--nnodes=2:4", *torchrun[1:]], {}) == 2  # elastic: min
    assert launcher_nodes(["deepspeed", "--num_nodes", "3", "train.py"], {}) == 3
    assert launcher_nodes(torchrun, {"SLURM_NNODES": "16"}) == 16  # one supervisor per srun task
    assert launcher_nodes(torchrun, {}) == 1


def test_a_node_back_late_joins_the_attempt_the_others_are_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempt ids from every node's journal: a node resumes one past its own attempts, or
    joins the attempt another node has started, whichever is higher."""
    d = str(tmp_path)

    def start(node: str, attempt: int) -> None:
        monkeypatch.setenv("ORCHESTRATOR_NODE", node)  # Journal writes this node's file
        j = Journal(d, -1, attempt)
        j.write("attempt_start", 0, {"node": node})
        j.close()

    start("n0", 0)
    start("n1", 0)
    for a in (1, 2, 3):  # node 1 is gone; node 0 keeps restarting
        start("n0", a)
    assert sorted(p.name for p in (tmp_path / "journal").iterdir()) == ["n0.jsonl", "n1.jsonl"]
    assert next_attempt_number(d, "n1") == 3  # joins node 0's attempt 3
    assert next_attempt_number(d, "n0") == 4
    assert next_attempt_number(d, "n2") == 3  # a node never seen before too


def test_peers_judge_liveness_by_change_not_by_clock(tmp_path: Path) -> None:
    d = str(tmp_path)
    n0 = Peers(d, "n0", nnodes=2, interval_s=0.1)
    n0.stale_s, n0.poll_s = 0.5, 0.0
    n1 = Peers(d, "n1", nnodes=2, interval_s=0.1)
    n1.start()
    n0.start()
    assert n0.lost(timeout_s=0.3) is None and n0.ended() is None
    n1._stop.set()  # node 1's supervisor freezes: its file stops changing
    n1._thread.join()  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while (why := n0.lost(timeout_s=0.3)) is None:  # bounded poll
        assert time.monotonic() < deadline, "a frozen peer was never judged lost"
        time.sleep(0.05)
    assert "n1 (host" in why and "node_timeout_s=0.3" in why
    n1.exited(74, "crash loop")
    ended = n0.ended()
    assert ended is not None and (ended.node, ended.exit_code) == ("n1", 74)
    # A supervisor started later on the same run directory ignores that earlier exit.
    again = Peers(d, "n0", nnodes=2, interval_s=0.1)
    again.start()
    assert again.ended() is None
    for p in (n0, again):
        p.exited(0, "test over")


def test_a_node_still_in_an_attempt_another_left_is_told_so(tmp_path: Path) -> None:
    """A node whose peer proposes or runs a later attempt learns it (then ends its own: the
    peer's ranks are gone); a peer at the same or an earlier attempt, or a frozen one, does
    not count."""
    from launch.nodes import AGREEING, IN_ATTEMPT

    d = str(tmp_path)
    n0, n1 = (Peers(d, n, nnodes=2, interval_s=0.1) for n in ("n0", "n1"))
    n0.stale_s, n0.poll_s = 0.5, 0.0
    n1.start()
    n0.start()
    n0.at(1, IN_ATTEMPT)
    n1.at(1, IN_ATTEMPT)
    assert n0.ahead(1) is None
    n1.at(0, AGREEING)
    assert n0.ahead(1) is None
    n1.at(2, AGREEING)
    assert n0.ahead(1) == f"n1 (host {n1._mine['host']}) is at attempt 2"
    n1._stop.set()  # frozen: not alive once stale, so no longer ahead of anyone
    n1._thread.join()  # type: ignore[union-attr]
    deadline = time.monotonic() + 10
    while n0.ahead(1) is not None:  # bounded poll
        assert time.monotonic() < deadline, "a frozen peer still counted"
        time.sleep(0.05)
    n0.exited(0, "test over")


@pytest.mark.parametrize("seed", range(40))
def test_the_nodes_agree_on_one_attempt_from_any_counts(seed: int) -> None:
    """launch/nodes.py agree(), played out: three nodes with any own attempt counts (a
    requeue after a lost node leaves them apart), each looking at the others' files at
    random moments, some still in an old attempt (they leave it once a later one is
    proposed, as the supervisor does): every node starts the same attempt, none before
    all are at it, and it is the highest any of them proposed."""
    import random

    from launch.nodes import agree

    rnd = random.Random(seed)
    nodes = ["n0", "n1", "n2"]
    files = {n: {"attempt": rnd.randint(0, 6), "running": rnd.random() < 0.3} for n in nodes}
    highest = max(f["attempt"] for f in files.values())
    # In an attempt: the others join it if it is the highest, else it leaves it.
    started = {n: f["attempt"] for n, f in files.items() if f["running"]}
    for _ in range(1000):
        if len(started) == len(nodes) and len(set(started.values())) == 1:
            break
        n = rnd.choice(nodes)
        mine = files[n]
        others = {m: f for m, f in files.items() if m != n}
        if mine["running"]:  # in an attempt: leave it when another is at a later one
            if any(f["attempt"] > mine["attempt"] for f in others.values()):
                mine.update(running=False, attempt=mine["attempt"] + 1)
                del started[n]
            continue
        attempt, start = agree(mine["attempt"], others, len(nodes))
        mine["attempt"] = attempt
        if start:
            started[n] = attempt
            mine["running"] = True  # in it now, never to leave (nobody proposes later)
            assert all(f["attempt"] == attempt for f in files.values())
    assert len(started) == len(nodes), (seed, files, started)
    assert len(set(started.values())) == 1, (seed, files, started)
    assert started["n0"] in (highest, highest + 1)


AGREE = """
import os, torch.distributed as dist
from orchestrator.comm import Comm
from orchestrator.startup import agree_attempt
dist.init_process_group("gloo")
os.environ["ORCHESTRATOR_ATTEMPT"] = os.environ["RANK"] if os.environ["SPLIT"] == "1" else "5"
try:
    said = f"agreed {agree_attempt(Comm(None))}"
except Exception as err:
    said = f"refused {type(err).__name__} {err}"
with open(os.path.join(os.environ["OUT"], "rank" + os.environ["RANK"]), "w") as f:
    f.write(said)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("split", ["0", "1"])
def test_ranks_under_different_attempt_ids_refuse_to_start(tmp_path: Path, split: str) -> None:
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script)]  # fmt: skip
    r = run(cmd, env={"SPLIT": split, "OUT": str(tmp_path)}, timeout=120)
    assert r.returncode == 0, r.stdout
    said = [(tmp_path / f"rank{k}").read_text() for k in (0, 1)]
    if split == "0":
        assert said == ["agreed 5"] * 2
    else:
        for s in said:  # every rank refuses, naming each rank's id
            assert s.startswith("refused OrchestratorError") and "{0: 0, 1: 1}" in s, s


def test_the_launcher_command_gives_the_rendezvous_endpoint() -> None:
    from launch.endpoint import Endpoint, launcher_endpoint

    run = ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
    assert launcher_endpoint([*run, "--rdzv-endpoint", "node7:29999", "t.py"], {}) == Endpoint(
        "node7", 29999
    )
    assert launcher_endpoint([*run, "--rdzv_endpoint=node7", "t.py"], {}) == Endpoint(
        "node7", 29400
    )
    assert launcher_endpoint([*run, "--rdzv-endpoint", "[fe80::1]:5", "t.py"], {}) == Endpoint(
        "fe80::1", 5
    )
    assert launcher_endpoint([*run, "--master-addr", "h0", "--master-port", "7", "t.py"], {}) == (
        Endpoint("h0", 7)
    )
    assert launcher_endpoint(["deepspeed", "--master_addr=h1", "t.py"], {}) == Endpoint("h1", 29500)
    assert launcher_endpoint(["python", "t.py"], {"MASTER_ADDR": "h2", "MASTER_PORT": "9"}) == (
        Endpoint("h2", 9)
    )
    assert launcher_endpoint(["torchrun", "--standalone", "t.py"], {"MASTER_ADDR": "x"}) is None
    assert launcher_endpoint(["python", "t.py"], {}) is None


def test_an_endpoint_answers_when_it_accepts_or_refuses() -> None:
    """A host that refuses (its launcher not up yet) answers; one that does not resolve does
    not. (A cut network, which times out, is tests/test_hosts.py's.)"""
    import socket

    from launch.endpoint import Endpoint, is_local, route_addr, unreachable

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        assert unreachable(Endpoint("127.0.0.1", port)) is None
    assert unreachable(Endpoint("127.0.0.1", port)) is None  # refused: the host is there
    why = unreachable(Endpoint("no-such-host.invalid", 1))
    assert why is not None and "does not resolve" in why
    assert is_local("127.0.0.1") and not is_local("192.0.2.1")  # TEST-NET-1: never ours
    assert route_addr("127.0.0.1") == "127.0.0.1"
