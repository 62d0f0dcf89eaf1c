"""The snapshot ring in node shared memory (snapshot.shared_memory): a restart under the
supervisor resumes from the node's newest valid slot, not from the durable tier; a slot
whose bytes changed after sealing is refused; nothing of the run is left in /dev/shm."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_supervisor import BASE, launch_cmd, torchrun

from conftest import (
    DS_EXAMPLE,
    EXAMPLE,
    REPO,
    assert_bitwise_equal,
    final_states,
    free_port,
    kinds,
    run,
)
from orchestrator.heartbeat import read_heartbeats
from orchestrator.protocol import local_tier_key

pytestmark = pytest.mark.timeout(400)

SHM = {
    **BASE,
    "snapshot": {"every_steps": 10, "shared_memory": True},
    "persist": {"every_steps": 100},
}


ENGINES = {  # script and arguments of each engine's example run
    "ddp": (EXAMPLE, []),
    "fsdp2": (EXAMPLE, ["--fsdp"]),
    "zero2": (DS_EXAMPLE, ["--zero-stage", "2"]),
}


def launched(d: Path, policy: dict[str, Any], engine: str, steps: int = 70) -> None:
    """The engine's example for ``steps`` under the supervisor, 2 ranks; it must end well
    and leave nothing in /dev/shm."""
    script, args = ENGINES[engine]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args,
           "--steps", str(steps), "--save-final", str(d / "final")]  # fmt: skip
    r = run(launch_cmd(d, policy, *cmd), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not glob.glob(f"/dev/shm/orchestrator-{local_tier_key(str(d))}*"), "shm left behind"


class CleanRuns(dict[str, Path]):
    """Uninterrupted runs, one per engine, made when a test first needs one."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, engine: str) -> Path:
        launched(self.base / engine, SHM, engine)
        self[engine] = self.base / engine
        return self[engine]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> CleanRuns:
    return CleanRuns(tmp_path_factory.mktemp("shm-clean"))


@pytest.mark.parametrize(
    "engine,corrupt",
    [
        # The plain resumes: their corrupt-slot cells resume from the ring too (from the
        # older slot), bit for bit, with the same copy checks. In the full matrix only.
        pytest.param("ddp", False, marks=pytest.mark.matrix),
        ("ddp", True),  # the flip in the node part
        pytest.param("fsdp2", False, marks=pytest.mark.matrix),
        ("fsdp2", True),  # the flip in a rank's own file
        ("zero2", False),
        # ZeRO-2's own files flip as FSDP2's do (fsdp2-corrupt-slot); its resume from the
        # ring is the zero2 cell. In the full matrix only (11 s of CI).
        pytest.param("zero2", True, marks=pytest.mark.matrix),
    ],
    ids=["ddp", "ddp-corrupt-slot", "fsdp2", "fsdp2-corrupt-slot", "zero2", "zero2-corrupt-slot"],
)
def test_a_crash_resumes_from_the_node_slot_bit_for_bit(
    tmp_path: Path, clean: CleanRuns, engine: str, corrupt: bool
) -> None:
    """persist every 100, snapshot every 10, a crash at 57: the next attempt resumes from
    the slot of step 50 (tier shm; nothing durable is that new), and ends bit for bit where
    an uninterrupted run does. With the newest slot's bytes flipped after it was sealed, that
    slot is refused (checksum) and the one of step 40 is used, still bit for bit."""
    if engine == "zero2":
        pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs it")
    d = tmp_path / "run"
    faults: list[dict[str, Any]] = [{"kind": "crash", "step": 57, "rank": 1}]
    if corrupt:
        faults.append({"kind": "corrupt_shm", "step": 55, "rank": 0})
    launched(d, {**SHM, "faults": faults}, engine)
    (resume,) = kinds(d, "resume")
    assert resume["attempt"] == 1 and resume["details"]["tier"] == "shm"
    assert resume["details"]["snapshot_step"] == (40 if corrupt else 50)
    refused = resume["details"]["refused"]
    if corrupt:
        assert any("step 50" in r and "checksum" in r and r.startswith("rank 0") for r in refused)
    else:
        assert refused == []
    for a, b in zip(final_states(clean[engine]), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
    # DDP's replicated state is kept once per node: each of the 2 ranks copies half of it
    # (plus its own RNG); sharded engines copy their whole part.
    for e in kinds(d, "snapshot"):
        half = e["details"]["copied_bytes"] / e["details"]["bytes"]
        assert half < 0.55 if engine == "ddp" else half == 1.0, e


@pytest.mark.parametrize("when", ["training", "between_attempts"])
def test_a_sigkilled_supervisor_leaves_nothing_in_shared_memory(tmp_path: Path, when: str) -> None:
    """SIGKILL of the supervisor while its ranks train (they end through their lifeline and
    remove the node's ring), or in its backoff after a crash, when no rank is left to do it
    (its janitor does); either way nothing of the run stays in /dev/shm, janitor included."""
    d = tmp_path / "run"
    policy: dict[str, Any] = SHM
    if when == "between_attempts":  # a crash at 25, then a minute's backoff to kill it in
        backoff = {"backoff_s": 60.0, "backoff_max_s": 60.0}
        policy = {**SHM, "supervisor": {**SHM["supervisor"], **backoff},
                  "faults": [{"kind": "crash", "step": 25, "rank": 1}]}  # fmt: skip
    proc = subprocess.Popen(
        launch_cmd(d, policy, *torchrun("--steps", "100000")), cwd=REPO, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    pattern = f"/dev/shm/orchestrator-{local_tier_key(str(d))}*"
    janitor = f"launch.janitor /dev/shm/orchestrator-{local_tier_key(str(d))}"

    def ready() -> bool:
        if when == "between_attempts":
            return bool(kinds(d, "restart"))
        return any(b["step"] >= 25 for b in read_heartbeats(str(d)))

    try:
        deadline = time.monotonic() + 120
        while not (glob.glob(pattern) and ready()):
            assert time.monotonic() < deadline, f"no shared-memory ring {when}"
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.2)  # bounded poll
        assert subprocess.run(["pgrep", "-f", janitor]).returncode == 0, "no janitor"
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while glob.glob(pattern) or subprocess.run(["pgrep", "-f", janitor]).returncode == 0:
            assert time.monotonic() < deadline, "the ring or its janitor outlived the supervisor"
            time.sleep(0.1)  # bounded poll
    finally:
        with contextlib.suppress(ProcessLookupError):  # the whole group may be gone
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize(("engine", "end"), [("ddp", "crash_loop"), ("zero2", "restarts")])
def test_the_newest_slot_is_flushed_when_the_job_ends_and_the_next_job_resumes(
    tmp_path: Path, clean: CleanRuns, engine: str, end: str
) -> None:
    """The job ends for good: a crash loop (the resumed attempt 1 crashes again at 51, short
    of 57, and crash_loop_attempts is 1: exit 74), or no restart allowed (max_restarts: 0:
    the crash at 57 ends it with 75). Before the ring goes, the supervisor flushes its
    newest slot (step 50) to the durable tier (for ZeRO-2 with DeepSpeed's own files, as its
    writers would); the next job (the same command, a new supervisor) resumes from it and
    ends bit for bit."""
    from orchestrator.errors import EXIT_CRASH_LOOP, EXIT_RESTARTS_EXHAUSTED

    if engine == "zero2":
        pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs it")
    d = tmp_path / "run"
    crashes = [{"kind": "crash", "step": 57, "rank": 1}]
    if end == "crash_loop":
        stop, code = {"crash_loop_attempts": 1}, EXIT_CRASH_LOOP
        crashes.append({"kind": "crash", "step": 51, "rank": 0, "attempt": 1})
    else:
        stop, code = {"max_restarts": 0}, EXIT_RESTARTS_EXHAUSTED
    once = {**SHM, "supervisor": {**SHM["supervisor"], **stop}, "faults": crashes}
    script, args = ENGINES[engine]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args,
           "--steps", "70", "--save-final", str(d / "final")]  # fmt: skip
    r = run(launch_cmd(d, once, *cmd), timeout=300)
    assert r.returncode == code, r.stdout[-3000:]
    (flushed,) = kinds(d, "flush")
    assert flushed["details"]["flushed"] is True and flushed["details"]["step"] == 50
    assert not glob.glob(f"/dev/shm/orchestrator-{local_tier_key(str(d))}*")
    launched(d, SHM, engine)  # the fault fired already (journaled): a clean second job
    resumes = kinds(d, "resume")
    looped = [("shm", 50)] if end == "crash_loop" else []  # attempt 1, from the ring
    assert [(e["details"]["tier"], e["details"]["snapshot_step"]) for e in resumes] == [
        *looped,
        ("remote", 50),
    ]
    for a, b in zip(final_states(clean[engine]), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_a_replaced_node_restores_from_its_buddys_copy_bit_for_bit(tmp_path: Path) -> None:
    """Two simulated nodes with snapshot.replicate: buddy (each its own ring folder): node
    1's supervisor is SIGKILLed (its workers take its ring with them); a new node-1
    supervisor fetches node 1's copy from node 0 before its attempt starts, both nodes
    resume from shared memory (no durable snapshot is that new), and the job ends bit for
    bit where an uninterrupted one does; nothing is left in /dev/shm. (Without buddy copies
    the same replacement resumes from the durable tier: tests/test_nodes.py, full matrix.)"""
    from test_nodes import finish, start_nodes

    policy = {
        **SHM,
        "snapshot": {"every_steps": 10, "keep": 4, "shared_memory": True, "replicate": "buddy"},
        # no durable snapshot newer than the buddy's copy, wherever the kill lands
        "persist": {"every_steps": 1000},
        "supervisor": {**SHM["supervisor"], "heartbeat_interval_s": 0.5},
    }
    # Long enough that node 1 is killed mid-run: on a quiet machine 70 steps took 0.8 s and
    # ended before the first copy of step 20 reached node 0 (CI: no buddy_restore at all).
    steps = ("--steps", "400")
    clean = tmp_path / "clean"
    for r in finish(start_nodes(clean, policy, *steps)):
        assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    procs = start_nodes(d, policy, *steps)
    deadline = time.monotonic() + 120
    while not any(
        e["details"].get("to") == "n0" and e["step"] >= 20 for e in kinds(d, "replicated")
    ):  # bounded poll: node 1's ring has a copy on node 0
        assert time.monotonic() < deadline, "node 1's ring was never copied to node 0"
        assert all(p.poll() is None for p in procs), "a supervisor ended early"
        time.sleep(0.2)
    node1 = [b["pid"] for b in read_heartbeats(str(d)) if b["node"] == "n1"]
    procs[1].kill()  # SIGKILL: its workers remove its ring as they die (or its janitor does)
    procs[1].wait(timeout=30)
    ring1 = f"/dev/shm/orchestrator-{local_tier_key(str(d))}-n1"
    deadline = time.monotonic() + 10
    while os.path.exists(ring1) or any(Path(f"/proc/{pid}").exists() for pid in node1):
        assert time.monotonic() < deadline, "node 1's workers or ring outlived its supervisor"
        time.sleep(0.1)  # bounded poll
    again = subprocess.Popen(
        procs[1].args, cwd=REPO, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "ORCHESTRATOR_NODE": "n1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    for r in finish([procs[0], again]):
        assert r.returncode == 0, r.stdout[-3000:]
    (restored,) = kinds(d, "buddy_restore")
    assert restored["details"]["from"] == "n0" and restored["details"]["bytes"] > 0
    (resume,) = kinds(d, "resume")
    assert resume["details"]["tier"] == "shm", resume
    assert resume["details"]["snapshot_step"] >= 20
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
    assert not glob.glob(f"/dev/shm/orchestrator-{local_tier_key(str(d))}*"), "shm left behind"


def test_a_job_on_two_nodes_flushes_one_snapshot_from_both_rings(tmp_path: Path) -> None:
    """Two simulated nodes, no restart allowed: a crash at 57 on node 1 ends the job on
    both. Each node's helper writes its rank's part of the newest step both rings hold
    (50); node 0's commits it; the same commands then resume from it, bit for bit."""
    from test_nodes import finish, start_nodes

    from orchestrator.errors import EXIT_RESTARTS_EXHAUSTED

    policy = {**SHM, "supervisor": {**SHM["supervisor"], "heartbeat_interval_s": 0.5}}
    clean = tmp_path / "clean"
    for r in finish(start_nodes(clean, policy, "--steps", "70")):
        assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    once = {**policy, "supervisor": {**policy["supervisor"], "max_restarts": 0},
            "faults": [{"kind": "crash", "step": 57, "rank": 1}]}  # fmt: skip
    for r in finish(start_nodes(d, once, "--steps", "70")):
        assert r.returncode == EXIT_RESTARTS_EXHAUSTED, r.stdout[-3000:]
    flushes = {e["details"]["node"]: e["details"] for e in kinds(d, "flush")}
    assert {n: (f["flushed"], f.get("step"), f.get("ranks")) for n, f in flushes.items()} == {
        "n0": (True, 50, [0]),
        "n1": (True, 50, [1]),
    }
    assert not glob.glob(f"/dev/shm/orchestrator-{local_tier_key(str(d))}*")
    for r in finish(start_nodes(d, policy, "--steps", "70")):
        assert r.returncode == 0, r.stdout[-3000:]
    resumes = {(e["details"]["tier"], e["details"]["snapshot_step"]) for e in kinds(d, "resume")}
    assert resumes == {("remote", 50)}
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


@pytest.mark.parametrize("taken_over", [False, True])
def test_the_janitor_leaves_a_ring_a_new_supervisor_owns(tmp_path: Path, taken_over: bool) -> None:
    """The janitor of a dead supervisor removes the ring, unless a new supervisor of the
    node (alive, holding the node's lock) owns it already: a replacement started at once must
    not lose the ring it resumes from (the real janitor process, a real flock)."""
    from launch.janitor import Janitor
    from launch.lock import lock_path

    ring = tmp_path / "ring"
    (ring / "slot0").mkdir(parents=True)
    (ring / "slot0" / "rank0.json").write_text("{}")
    run_dir = str(tmp_path / "run")
    holder = None
    if taken_over:  # the new supervisor: another live process holding the node's lock
        code = ("import sys; from launch.lock import SupervisorLock; "
                f"SupervisorLock({run_dir!r}, 'n0').acquire(); print('held', flush=True); "
                "sys.stdin.read()")  # fmt: skip
        holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    try:
        janitor = Janitor(str(ring), lock_path(run_dir, "n0"))  # this process: its supervisor
        janitor.close()  # as if its supervisor ended: end of file on the janitor's pipe
    finally:
        if holder is not None:
            holder.communicate("", timeout=30)
    assert ring.exists() == taken_over
