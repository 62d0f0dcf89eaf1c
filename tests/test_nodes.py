"""Two nodes on one machine: one supervisor per node (ORCHESTRATOR_NODE=n0, n1), torchrun
with a c10d rendezvous on 127.0.0.1, one rank per node. Black box, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import EXAMPLE, REPO, assert_bitwise_equal, final_states, free_port, kinds
from orchestrator.errors import EXIT_PREEMPTED
from orchestrator.heartbeat import read_heartbeats

pytestmark = pytest.mark.timeout(400)

FAST = {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5}
BASE = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}, "supervisor": FAST}


def start_nodes(run_dir: Path, policy: dict[str, Any], *args: str) -> list[subprocess.Popen[str]]:
    """Start both nodes' supervisors (node n0 and n1, one rank each, c10d rendezvous)."""
    path = run_dir.parent / f"{run_dir.name}-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    port = free_port()
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
               "--run-dir", str(run_dir), "--", sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", run_dir.name, str(EXAMPLE), *args,
               "--save-final", str(run_dir / "final")]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ORCHESTRATOR_NODE": f"n{node}"}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))  # fmt: skip
    return procs


def finish(procs: list[subprocess.Popen[str]]) -> list[subprocess.CompletedProcess[str]]:
    """Wait for both supervisors (killing what is left on a timeout)."""
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
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
    assert (d / "hangs" / "attempt-0" / "rank0.txt").exists()
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 50


@pytest.mark.matrix  # 25 s of CI; one node's preemption is in test_supervisor.py
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
    assert resume["attempt"] == 1 and resume["details"]["snapshot_step"] in (10, 20, 30)
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
