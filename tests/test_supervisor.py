"""Black-box tests of `orchestrator launch`: the CLI in a subprocess (own session, killed on
timeout), real torchrun workers, real signals. Assertions on state and journal events."""

from __future__ import annotations

import os
import signal
import socket
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
    kinds,
    preempt_at,
    run,
)
from orchestrator.errors import EXIT_CRASH_LOOP, EXIT_LOCKED, EXIT_PREEMPTED
from orchestrator.heartbeat import read_heartbeats

pytestmark = pytest.mark.timeout(300)

FAST = {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5}
BASE = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}, "supervisor": FAST}


def launch_cmd(run_dir: Path, policy: dict[str, Any], *cmd: str) -> list[str]:
    path = run_dir.parent / f"{run_dir.name}-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
            "--run-dir", str(run_dir), "--", *cmd]  # fmt: skip


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
            *args]  # fmt: skip


# covered by default: tests/test_drill.py (the crash cell, bit for bit, its restart step
# and logs) and tests/test_nodes.py
@pytest.mark.matrix
def test_crash_is_restarted_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    clean = tmp_path / "clean"
    r = run(
        launch_cmd(clean, BASE, *torchrun("--steps", "60", "--save-final", str(clean / "final")))
    )
    assert r.returncode == 0, r.stdout[-3000:]
    d = tmp_path / "run"
    policy = {**BASE, "faults": [{"kind": "crash", "step": 50, "rank": 0}]}
    r = run(launch_cmd(d, policy, *torchrun("--steps", "60", "--save-final", str(d / "final"))))
    assert r.returncode == 0, r.stdout[-3000:]
    (restart,) = kinds(d, "restart")
    assert restart["details"]["cause"] == "crash" and restart["attempt"] == 0
    # The step the crash happened at, not the last heartbeat's (an interval older).
    assert restart["step"] == 50
    (end,) = [e for e in kinds(d, "attempt_end") if e["attempt"] == 0]
    assert end["details"]["best_step"] == 50
    (resume,) = kinds(d, "resume")
    assert resume["attempt"] == 1 and resume["details"]["snapshot_step"] in (30, 40)
    assert (d / "attempts" / "0" / "output.log").exists()
    assert (d / "attempts" / "1" / "output.log").exists()
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


# covered by default: tests/test_nodes.py's hang (rank, host, phase, every rank's stack,
# the culprit's frame) and the drill's hang cell
@pytest.mark.matrix
def test_hang_is_detected_and_restarted(tmp_path: Path) -> None:
    d = tmp_path / "run"
    hang_timeout = 6.0
    policy = {
        **BASE,
        "supervisor": {**FAST, "hang_timeout_s": hang_timeout, "grace_s": 5},
        "faults": [{"kind": "hang", "step": 30, "rank": 1}],
    }
    r = run(launch_cmd(d, policy, *torchrun("--steps", "50")))
    assert r.returncode == 0, r.stdout[-3000:]
    (fault,) = [e for e in kinds(d, "fault") if e["details"]["fault"]["kind"] == "hang"]
    (hang,) = kinds(d, "hang")
    # Rank 1 stopped first (its peer moved on to the check and waits there): it is stalled
    # and it alone is the suspect, whatever the heartbeat writers' phase.
    assert 1 in {int(k) for k in hang["details"]["stalled_ranks"]}
    assert hang["details"]["phases"] == {"0": "check", "1": "backward"}
    assert hang["details"]["suspects"] == [1]
    # Both ranks' stacks were taken before the kill; the culprit is the rank outside the
    # collective its peer waits in, at the fault's frame.
    folder = d / "hangs" / "attempt-0"
    assert hang["details"]["stacks"] == str(folder)
    stacks = {p.name: p.read_text() for p in folder.iterdir()}
    assert set(stacks) == {"rank0.txt", "rank1.txt"}
    assert "distributed_c10d.py" in stacks["rank0.txt"]  # waiting in the all-reduce
    (culprit,) = hang["details"]["culprits"]
    assert culprit["rank"] == 1 and culprit["host"] == socket.gethostname()
    assert "faults/injector.py" in culprit["frame"] and "process_faults" in culprit["frame"]
    assert hang["time"] - fault["time"] <= hang_timeout + 5
    assert kinds(d, "restart")[0]["details"]["cause"] == "hang"
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 50
    assert leftovers(d) == []  # torchrun's workers live in their own sessions: none orphaned


def leftovers(run_dir: Path) -> list[int]:
    """Processes still running with this run directory in their environment."""
    needle = f"ORCHESTRATOR_RUN_DIR={run_dir}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(pid))
    return found


def test_no_heartbeat_within_start_timeout_is_a_hang(tmp_path: Path) -> None:
    d = tmp_path / "run"
    sup = {**FAST, "start_timeout_s": 2.0, "grace_s": 2.0, "crash_loop_attempts": 2}
    r = run(launch_cmd(d, {"supervisor": sup}, sys.executable, "-c", "import time; time.sleep(60)"))
    assert r.returncode == EXIT_CRASH_LOOP
    hangs = kinds(d, "hang")
    assert len(hangs) == 2 and hangs[0]["details"]["stalled_ranks"] == {}
    assert [e["details"]["cause"] for e in kinds(d, "restart")] == ["hang"]
    assert leftovers(d) == []


def test_crash_loop_stops_early(tmp_path: Path) -> None:
    d = tmp_path / "run"
    policy = {"supervisor": {**FAST, "max_restarts": 50, "crash_loop_attempts": 3}}
    r = run(launch_cmd(d, policy, sys.executable, "-c", "import sys; sys.exit(3)"))
    assert r.returncode == EXIT_CRASH_LOOP
    ends = kinds(d, "attempt_end")
    assert [e["details"]["returncode"] for e in ends] == [3, 3, 3]  # not 51 attempts
    (exit_,) = kinds(d, "supervisor_exit")
    assert exit_["details"]["exit_code"] == EXIT_CRASH_LOOP
    assert "crash loop" in exit_["details"]["reason"]


# covered by default: the drill's preempt cell (exit 73, the same command resumes bit
# for bit) and tests/test_nodes.py's preemption
@pytest.mark.matrix
def test_sigterm_preempts_with_snapshot_and_the_same_command_resumes(tmp_path: Path) -> None:
    d = tmp_path / "run"
    policy = {**BASE, "persist": {"every_steps": 1000}}  # only the preemption persists
    code, out = preempt_at(launch_cmd(d, policy, *torchrun("--steps", "400")), d, 20)
    assert code == EXIT_PREEMPTED, out[-3000:]
    (pre,) = kinds(d, "preempted")
    assert pre["details"]["persisted"] is True
    assert [e["step"] for e in kinds(d, "persist")] == [pre["step"]]
    r = run(launch_cmd(d, policy, *torchrun("--steps", "400")), timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "resume")[0]["details"]["snapshot_step"] == pre["step"]
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 400


def test_script_without_the_library_gets_crash_restarts(tmp_path: Path) -> None:
    d = tmp_path / "run"
    marker = tmp_path / "crashed-once"
    script = (
        "import os, sys\n"
        f"m = {str(marker)!r}\n"
        "if not os.path.exists(m):\n"
        "    open(m, 'w').close(); print('crashing', flush=True); os.abort()\n"
        "print('second attempt ok', os.environ['ORCHESTRATOR_ATTEMPT'])\n"
    )
    r = run(launch_cmd(d, {"supervisor": FAST}, sys.executable, "-c", script))
    assert r.returncode == 0, r.stdout[-3000:]
    (restart,) = kinds(d, "restart")
    assert restart["details"]["cause"] == "crash" and restart["details"]["returncode"] < 0
    assert "second attempt ok 1" in (d / "attempts" / "1" / "output.log").read_text()


def test_launch_half_runs_without_torch(tmp_path: Path) -> None:
    """`orchestrator launch --help`, `validate` and a whole supervised run of a plain script
    work in a process where importing torch fails: the supervisor never imports it."""
    no_torch = (
        "import sys; sys.modules['torch'] = None  # any `import torch` now raises\n"
        "from launch.cli import main; code = main(sys.argv[1:])\n"
        "assert sys.modules['torch'] is None; sys.exit(code)\n"
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return run([sys.executable, "-c", no_torch, *args], timeout=60)

    r = cli("launch", "--help")
    assert r.returncode == 0 and "--run-dir" in r.stdout, r.stdout
    r = cli("validate", str(REPO / "configs" / "default.yaml"))
    assert r.returncode == 0, r.stdout
    d = tmp_path / "run"
    r = cli("launch", "--run-dir", str(d), "--", sys.executable, "-c", "print('trained')")
    assert r.returncode == 0, r.stdout
    (end,) = kinds(d, "supervisor_exit")
    assert end["details"]["exit_code"] == 0


TINY = """
import sys, torch
sys.path.insert(0, {tests!r})
from inproc import Regression
from orchestrator import Guard, load_policy
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with Guard(load_policy(), model=model, optimizer=opt) as guard:
    for x, y in guard.batches(guard.dataloader(Regression(), batch_size=4), max_steps=6):
        guard.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
        guard.step()
"""


def test_fresh_starts_over_and_keeps_the_earlier_run(tmp_path: Path) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(TINY.format(tests=str(REPO / "tests")))
    d = tmp_path / "run"
    policy = {"persist": {"every_steps": 3}, "supervisor": FAST}
    cmd = launch_cmd(d, policy, sys.executable, str(script))
    assert run(cmd).returncode == 0
    assert run(cmd).returncode == 0  # the same command again: resumes, a finished run
    (resume,) = kinds(d, "resume")
    assert resume["details"]["snapshot_step"] == 6
    fresh = [*cmd[:4], "--fresh", *cmd[4:]]
    r = run(fresh)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not kinds(d, "resume")  # started over: no resume in the new journal
    (end,) = kinds(d, "run_end")
    assert end["details"]["steps"] == 6
    (archived,) = (d / "archive").iterdir()
    assert list((archived / "journal").glob("*.jsonl"))
    assert (archived / "snapshots" / "step_000000006" / "COMMITTED").exists()


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def _wait_for(what: str, ready: Any, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():  # bounded poll on state, not a blind sleep
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_second_supervisor_for_the_node_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "run"
    policy = {"supervisor": {**FAST, "start_timeout_s": None}}
    first = _start(launch_cmd(d, policy, sys.executable, "-c", "import time; time.sleep(120)"))
    try:
        lock = d / "supervisors" / f"{socket.gethostname()}.lock"
        _wait_for("the first supervisor's lock", lambda: lock.exists() and lock.read_text())
        t0 = time.monotonic()
        second = run(launch_cmd(d, policy, sys.executable, "-c", "print('never runs')"))
        assert second.returncode == EXIT_LOCKED and time.monotonic() - t0 < 30
        assert str(lock) in second.stdout and f"pid {first.pid}" in second.stdout
        assert "never runs" not in second.stdout
        assert [e["details"]["host"] for e in kinds(d, "attempt_start")] == [socket.gethostname()]
        # Another node of the same run directory has its own lock and its own attempts.
        other = run(launch_cmd(d, policy, sys.executable, "-c", "print('node b')"),
                    env={"ORCHESTRATOR_NODE": "b"})  # fmt: skip
        assert other.returncode == 0 and "node b" in other.stdout, other.stdout
        starts = {e["details"]["node"]: e["attempt"] for e in kinds(d, "attempt_start")}
        assert starts == {socket.gethostname(): 0, "b": 0}
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)


def test_nothing_outlives_a_sigkilled_supervisor(tmp_path: Path) -> None:
    """SIGKILL gives the supervisor no chance to clean up: torchrun dies by its parent-death
    signal, the ranks by watching the supervisor's pidfd. All gone within 5 s."""
    d = tmp_path / "run"
    proc = _start(launch_cmd(d, BASE, *torchrun("--steps", "100000")))
    try:
        _wait_for("training", lambda: any(b["step"] >= 3 for b in read_heartbeats(str(d))))
        under = leftovers(d)  # torchrun and both ranks
        assert len(under) >= 3
        proc.kill()  # SIGKILL, to the supervisor alone
        proc.wait(timeout=30)
        t0 = time.monotonic()
        _wait_for("every worker to end", lambda: not any(map(_alive, under)), timeout_s=5)
        assert time.monotonic() - t0 < 5
    finally:
        for pid in leftovers(d):
            os.kill(pid, signal.SIGKILL)
    lock = d / "supervisors" / f"{socket.gethostname()}.lock"
    again = run(launch_cmd(d, BASE, sys.executable, "-c", "print('next supervisor')"))
    assert again.returncode == 0, again.stdout  # the kernel released the dead one's lock
    assert lock.exists()


def test_a_command_that_cannot_start_stops_at_once(tmp_path: Path) -> None:
    """Not found, or not executable: one attempt, exit 78 with the reason, no backed-off
    retries ending in a crash-loop verdict."""
    from orchestrator.errors import EXIT_CANNOT_START

    not_exec = tmp_path / "train.sh"
    not_exec.write_text("#!/bin/sh\necho never\n")  # no execute bit
    no_interpreter = tmp_path / "train.py"
    no_interpreter.write_text("#!/no/such/python\nprint('never')\n")
    no_interpreter.chmod(0o755)  # executable, but its #! names nothing
    cases = [(tmp_path / "no-such-command", "on PATH?"), (not_exec, "executable?"),
             (no_interpreter, "its #! line")]  # fmt: skip
    for i, (cmd, hint) in enumerate(cases):
        d = tmp_path / f"run-{i}"
        # A backoff of 300 s: a restart would blow the timeout (the journal says none came).
        sup = {**FAST, "backoff_s": 300.0, "backoff_max_s": 300.0}
        r = run(launch_cmd(d, {"supervisor": sup}, str(cmd)), timeout=60)
        assert r.returncode == EXIT_CANNOT_START, r.stdout[-3000:]
        assert len(kinds(d, "attempt_start")) == 1 and not kinds(d, "restart")
        (end,) = kinds(d, "supervisor_exit")
        assert end["details"]["exit_code"] == EXIT_CANNOT_START
        assert str(cmd) in end["details"]["reason"] and hint in end["details"]["reason"]


CHAINED = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
from inproc import Regression
from orchestrator import Guard, load_policy
def mine(signum, frame):
    open({marker!r}, "a").write(f"{{signal.Signals(signum).name}}\\n")
signal.signal(signal.SIGTERM, mine)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with Guard(load_policy(), model=model, optimizer=opt) as guard:
    for x, y in guard.batches(guard.dataloader(Regression(), batch_size=4), max_steps=50):
        guard.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
        guard.step()
        if guard.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
"""


def test_the_scripts_own_signal_handler_still_runs(tmp_path: Path) -> None:
    """A script's SIGTERM handler installed before the Guard is chained: the Guard stops
    the run with a durable snapshot (exit 73) and the script's handler runs too."""
    from orchestrator.errors import EXIT_PREEMPTED

    marker = tmp_path / "handled"
    script = tmp_path / "chained.py"
    script.write_text(CHAINED.format(tests=str(REPO / "tests"), marker=str(marker)))
    d = tmp_path / "run"
    r = run([sys.executable, str(script)], env={"ORCHESTRATOR_RUN_DIR": str(d)}, timeout=120)
    assert r.returncode == EXIT_PREEMPTED, r.stdout[-3000:]
    assert marker.read_text() == "SIGTERM\n"
    (pre,) = kinds(d, "preempted")
    assert pre["step"] == 6 and pre["details"]["persisted"] is True


def test_a_finished_run_whose_process_then_fails_is_not_restarted(tmp_path: Path) -> None:
    """The workers journaled a finished end, then the process exited non-zero (a teardown
    that crashed, a stop request that came as it finished): the job is done, exit 0, no
    restart to find nothing left to train."""
    script = tmp_path / "tiny.py"
    script.write_text(TINY.format(tests=str(REPO / "tests")) + "sys.exit(3)\n")
    d = tmp_path / "run"
    r = run(launch_cmd(d, {"supervisor": FAST}, sys.executable, str(script)), timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    (end,) = kinds(d, "attempt_end")
    assert (end["details"]["returncode"], end["details"]["outcome"]) == (3, "ok")
    assert not kinds(d, "restart")
