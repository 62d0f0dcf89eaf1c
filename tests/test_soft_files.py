"""What goes wrong without a NaN (issue 28): the run directory's own files failing, a
ledger or journal that does not parse, a preemption whose snapshot cannot be written, the
wall clock stepping under the supervisor, a rank frozen so that it cannot give its stack.

Real components throughout: a real tmpfs filled to ENOSPC (mounted by the test, which runs
as root; skipped where mounting is not permitted), real supervisors and torchrun workers,
real SIGSTOP. The wall clock is stepped in every process by a test-only ``sitecustomize``
(tests/clockshim/) on the children's PYTHONPATH; the host's clock is left alone.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_supervisor import launch_cmd, leftovers

from conftest import (
    EXAMPLE,
    REPO,
    assert_bitwise_equal,
    final_states,
    free_port,
    run,
    spawn,
    wait,
)
from launch.hangs import collect
from launch.procs import proc_state
from launch.progress import Stalls
from orchestrator.errors import EXIT_GAVE_UP, EXIT_STOPPED, LedgerError
from orchestrator.heartbeat import Heartbeat, read_heartbeats
from orchestrator.journal import (
    ENV_STRICT_EVENTS,
    EVENT_JOURNAL_FAILED,
    Journal,
    load_journal,
    read_metrics,
)
from orchestrator.metrics import Metrics
from orchestrator.policy_sections import MetricsPolicy
from orchestrator.protocol import LEDGER_NAME, clock_id
from orchestrator.quarantine import Ledger
from orchestrator.rundir import write_record

pytestmark = pytest.mark.timeout(300)

FAST = {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5}
# What the clean_run fixture trains with: a run with faults must equal it bit for bit.
SAME = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}}


# --- helpers ------------------------------------------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str, int], Path]]:
    """``tmpfs(name, bytes)``: a fresh tmpfs of that size mounted at ``tmp_path/name``."""
    mounted: list[Path] = []

    def mount(name: str, size: int) -> Path:
        where = tmp_path / name
        where.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:  # lazily: a killed worker's files may still be open
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path) -> Path:
    """Fill the file system of ``folder`` to ENOSPC; returns the file to delete to free it."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
    return filler


def until(what: str, done: Callable[[], bool], proc: subprocess.Popen[str], limit_s: float = 120):
    """Poll ``done`` (bounded) while the supervisor runs."""
    deadline = time.monotonic() + limit_s
    while not done():
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(
                f"the supervisor ended (exit {proc.returncode}) before {what}:\n{out[-3000:]}"
            )
        assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
        time.sleep(0.05)


def step_of(run_dir: Path) -> int:
    return max((int(b["step"]) for b in read_heartbeats(str(run_dir))), default=-1)


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The journal's events (damaged lines, which a full disk may leave, are skipped)."""
    evs, _ = load_journal(str(run_dir))
    return [e for e in evs if kind is None or e["kind"] == kind]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
            *args]  # fmt: skip


def snapshot_bytes(run_dir: Path) -> int:
    """The size of one durable snapshot of the example (the newest of a clean run)."""
    newest = sorted((run_dir / "snapshots").glob("step_*"))[-1]
    return sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())


# --- the run directory's own files --------------------------------------------------------------
def test_journal_metrics_and_heartbeat_go_on_when_the_disk_is_full(
    tmpfs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full tmpfs none of them raises; the heartbeat is still written (in place), the
    journal's events and the metrics rows wait in memory and land, each once and in
    order, when space comes back; the first failure of each is said (journal_failed,
    the metrics' on_error)."""
    monkeypatch.setenv(ENV_STRICT_EVENTS, "0")  # kinds of its own: the file, not the protocol
    run_dir = tmpfs("rd", 1 << 20) / "run"
    journal = Journal(str(run_dir), rank=0, attempt=0)
    said: list[OSError] = []
    metrics = Metrics(MetricsPolicy(flush_every=1), str(run_dir), 0, True, on_error=said.append)
    beat = Heartbeat(str(run_dir), rank=0, attempt=0, interval_s=60.0)
    journal.write("before", 0, {})
    metrics.record(0, loss=1.0)
    beat.beat(0, force=True)
    filler = fill(run_dir.parent)
    for step in range(1, 200):  # more than the files' last pages can take
        journal.write("while_full", step, {"pad": "x" * 100})
        metrics.record(step, loss=1.0)
    beat.beat(199, phase="check", force=True)  # in place: the blocks it already holds
    assert json.loads(Path(beat.path).read_text())["step"] == 199 and beat.failures == 0
    with pytest.raises(OSError):  # a record never written before has no blocks to reuse
        write_record(str(run_dir / "new.json"), "{}")
    assert not list(run_dir.glob("*.tmp"))  # a failed write leaves no temporary file
    assert len(said) == 1 and said[0].errno == errno.ENOSPC
    assert 0 < metrics.unwritten < 200  # run_end's metrics_unwritten if the run ended here
    filler.unlink()
    journal.write("after", 200, {})
    metrics.record(200, loss=1.0)
    journal.close()
    beat.close()
    evs = events(run_dir)
    kinds = [e["kind"] for e in evs]
    assert kinds.count("while_full") == 199 and kinds[0] == "before"
    assert [e["step"] for e in evs if e["kind"] == "while_full"] == list(range(1, 200))
    (failed,) = [e for e in evs if e["kind"] == EVENT_JOURNAL_FAILED]
    assert failed["details"]["lost"] == 0 and "28" in failed["details"]["error"]
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(201))
    assert metrics.unwritten == 0


def test_a_full_run_dir_does_not_stop_training(
    tmpfs: Any, tmp_path: Path, clean_run: Callable[[int], Path]
) -> None:
    """The run directory (journal, metrics, heartbeats, logs) on a tmpfs that fills up at
    step 10 and stays full to step 70 (the metrics file's last page takes ~25 more rows
    before its writes fail), the durable snapshots on another disk: training goes on to
    the end, bit for bit a clean run, with no hang verdict (the heartbeats keep beating)
    and exit 0; once space is back, every metrics row is there and the journal says what
    failed. Space comes back 50 steps before the end: rows still waiting when the run
    ends are lost (run_end's metrics_unwritten), and CI once saw a test that freed it 20
    steps before the end (a heartbeat interval late, under load) come too late."""
    clean = clean_run(120)
    d = tmpfs("rd", 16 << 20) / "run"
    policy = {**SAME, "persist": {"every_steps": 10, "url": str(tmp_path / "store")},
              "metrics": {"flush_every": 1},
              "supervisor": {**FAST, "hang_timeout_s": 5.0}}  # fmt: skip
    final = tmp_path / "final"
    proc = spawn(launch_cmd(d, policy, *torchrun("--steps", "120", "--save-final", str(final))))
    until("step 10", lambda: step_of(d) >= 10, proc)
    filler = fill(d.parent)
    full_at = step_of(d)
    # The heartbeats are written on the full disk, or this would never come.
    until("step 70 with the disk full", lambda: step_of(d) >= max(70, full_at + 50), proc)
    filler.unlink()
    r = wait(proc)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not events(d, "hang") and len(events(d, "attempt_start")) == 1
    (failed,) = [e for e in events(d, "write_failed") if e["details"]["file"] == "metrics"]
    assert "28" in failed["details"]["error"]
    assert [row["step"] for row in read_metrics(str(d))] == list(range(120))
    (end,) = [e for e in events(d, "run_end") if e["rank"] == 0]
    assert "metrics_unwritten" not in end["details"]
    (exit_,) = events(d, "supervisor_exit")
    assert exit_["details"]["exit_code"] == 0
    for a, b in zip(final_states(clean), [_load(p) for p in sorted(final.glob("rank*.pt"))],
                    strict=True):  # fmt: skip
        assert_bitwise_equal(a, b, "final")


def committed(store: Path) -> int:
    """The newest committed durable snapshot's step under ``store`` (-1: none)."""
    return max((int(p.parent.name.split("_")[1]) for p in store.glob("step_*/COMMITTED")),
               default=-1)  # fmt: skip


def test_a_run_dir_that_refuses_writes_pauses_hang_detection(tmp_path: Path) -> None:
    """The heartbeats' and supervisors' folders refuse writes (chattr +i: EPERM, as a
    read-only or failing file system refuses them; a full one is written in place) for
    longer than hang_timeout_s while training goes on: the supervisor, which cannot write
    its own file there either, pauses hang detection instead of killing ranks it cannot
    hear, resumes once writes work, and journals the pause; the run ends normally."""
    d = tmp_path / "run"
    policy = {**SAME, "supervisor": {**FAST, "hang_timeout_s": 4.0}}
    # Training outlasts the frozen window (100 steps did not, once, on CI).
    slower, steps = ["--d-model", "192", "--layers", "4"], 160
    proc = spawn(launch_cmd(d, policy, *torchrun("--steps", str(steps), *slower)))
    frozen = []
    try:
        until("step 10", lambda: step_of(d) >= 10 and committed(d / "snapshots") >= 10, proc)
        frozen = [*sorted((d / "heartbeats").iterdir()), d / "supervisors"]
        subprocess.run(["chattr", "+i", *map(str, frozen)], check=True)
        at, since = committed(d / "snapshots"), time.monotonic()
        # Training goes on, unheard, for longer than the hang timeout.
        until("training past the hang timeout, unheard",
              lambda: time.monotonic() - since > 6.0 and committed(d / "snapshots") > at,
              proc)  # fmt: skip
    finally:
        if frozen:
            subprocess.run(["chattr", "-i", *map(str, frozen)], check=True)
    r = wait(proc)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not events(d, "hang") and len(events(d, "attempt_start")) == 1
    (paused,) = events(d, "hang_detection_paused")
    (resumed,) = events(d, "hang_detection_resumed")
    assert "Operation not permitted" in paused["details"]["error"]
    # Paused for longer than hang_timeout_s: a verdict would have come without the pause.
    # (Not the test's own 6 s: the supervisor notices the refusal at its next write of its
    # file, up to a write interval and more on a loaded machine after the chattr: CI saw
    # 5.5 s.)
    hang_timeout_s = policy["supervisor"]["hang_timeout_s"]
    assert resumed["details"]["seconds"] > hang_timeout_s and resumed["time"] > paused["time"]
    assert {e["rank"] for e in events(d, "heartbeat_failed")} == {0, 1}
    assert [e["details"]["steps"] for e in events(d, "run_end") if e["rank"] == 0] == [steps]


def _load(path: Path) -> Any:
    import torch

    return torch.load(path, weights_only=True)


def test_a_report_that_cannot_be_written_is_not_bad_input(tmpfs: Any, tmp_path: Path) -> None:
    """`orchestrator report` into a full disk: exit 1 (the file system failed), never 2 (bad
    input); a run directory that is not there stays 2."""
    d = tmp_path / "run"
    Journal(str(d), rank=0, attempt=0).write("run_start", 0, {})
    out = tmpfs("out", 64 << 10)
    fill(out)
    cli = [sys.executable, "-m", "launch.cli", "report"]
    assert run([*cli, str(d), "--out", str(out)], timeout=120).returncode == 1
    assert run([*cli, str(tmp_path / "nope")], timeout=120).returncode == 2


# --- a ledger or journal that does not parse ----------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [b"\xff\xfe\x00 not text", b'{"sample": 4', b'{"oops": 1}'],
    ids=["binary", "torn", "key"],
)
def test_a_ledger_line_that_does_not_parse_names_file_and_line(tmp_path: Path, bad: bytes) -> None:
    path = tmp_path / LEDGER_NAME
    path.write_bytes(b'{"sample": 1}\n' + bad + b'\n{"sample": 2}\n')
    with pytest.raises(LedgerError) as caught:
        Ledger(str(path)).load()
    assert caught.value.line == 2 and caught.value.url == str(path)
    Ledger(str(path)).add([7], step=3, reason="x")  # adding keeps every line, the bad one too
    assert path.read_bytes().splitlines()[1] == bad


def test_a_binary_ledger_line_stops_the_job_at_once(tmp_path: Path) -> None:
    """One clear error and no restart: the workers journal gave_up (the file and line) and
    exit with the gave-up code, so the supervisor stops with 71 after one attempt instead
    of spending restarts on a ledger a restart cannot fix."""
    d = tmp_path / "run"
    d.mkdir()
    (d / LEDGER_NAME).write_bytes(b'{"sample": 1}\n\xff\xfe binary\n')
    r = run(launch_cmd(d, {"supervisor": FAST}, *torchrun("--steps", "20")), timeout=120)
    assert r.returncode == EXIT_GAVE_UP, r.stdout[-3000:]
    assert len(events(d, "attempt_start")) == 1 and not events(d, "restart")
    (gave_up,) = events(d, "gave_up")
    assert gave_up["details"]["reason"] == "ledger_unreadable"
    assert gave_up["details"]["line"] == 2
    assert gave_up["details"]["ledger"] == str(d / LEDGER_NAME)
    (exit_,) = events(d, "supervisor_exit")
    assert exit_["details"]["exit_code"] == EXIT_GAVE_UP
    assert "line 2" in exit_["details"]["reason"]  # the reason the workers gave, passed on


DAMAGED = [
    b'{"time": 5.0, "kind": "incident", "step": 3, "rank": 0, "attempt": 0, "details": null}',
    b"\xff\xfe\x00 binary",
    b"[1, 2]",
    b'{"kind": "restart", "step": 1, "rank": -1, "attempt": 0, "details": {}}',
    b'{"time": 6.0, "kind": "hang", "step": "x", "rank": -1, "attempt": 0, "details": {}}',
    b'{"time": 7.0, "kind": "rollb',
]


def test_damaged_journal_lines_are_skipped_by_status_report_and_launch(tmp_path: Path) -> None:
    d = tmp_path / "run"
    j = Journal(str(d), rank=0, attempt=0)
    j.write("run_start", 0, {"world_size": 1})
    j.close()
    with open(j.path, "ab") as f:
        f.write(b"\n".join(DAMAGED) + b"\n")
    evs, damaged = load_journal(str(d))
    assert [e["kind"] for e in evs] == ["run_start"]
    assert damaged == [f"journal/{Path(j.path).name}:{n}" for n in range(2, 2 + len(DAMAGED))]
    cli = [sys.executable, "-m", "launch.cli"]
    assert run([*cli, "status", str(d)], timeout=120).returncode == 0
    assert run([*cli, "report", str(d)], timeout=120).returncode == 0
    assert (d / "report.md").exists()
    r = run(launch_cmd(d, {"supervisor": FAST}, sys.executable, "-c", "pass"), timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    assert [e["details"]["exit_code"] for e in events(d, "supervisor_exit")] == [0]


# --- a preemption whose snapshot cannot be written ----------------------------------------------
def test_a_preemption_with_a_full_store_is_not_73(
    tmpfs: Any, tmp_path: Path, clean_run: Callable[[int], Path]
) -> None:
    """The durable store (a tmpfs with room for two snapshots and a half) takes the
    snapshots of steps 10 and 20, then fills. A preemption at step 35 cannot write its
    snapshot: exit 143, not 73 ("stopped after a durable snapshot"), and the preempted
    event says the newest durable snapshot and how many steps are lost. The same command
    resumes from step 20 and ends where a clean run does, bit for bit."""
    clean = clean_run(120)
    store = tmpfs("store", int(2.5 * snapshot_bytes(clean)))
    d = tmp_path / "run"
    final = tmp_path / "final"
    policy = {**SAME, "persist": {"every_steps": 10, "url": str(store), "keep": 10},
              "supervisor": {**FAST, "grace_s": 30.0},
              "faults": [{"kind": "preempt", "step": 35}]}  # fmt: skip
    cmd = launch_cmd(d, policy, *torchrun("--steps", "120", "--save-final", str(final)))
    r = run(cmd, timeout=180)
    assert r.returncode == EXIT_STOPPED, r.stdout[-3000:]
    assert [e["step"] for e in events(d, "persist")] == [10, 20]
    (pre,) = events(d, "preempted")
    assert pre["details"]["persisted"] is False and pre["details"]["durable_step"] == 20
    assert pre["details"]["steps_lost"] == pre["step"] - 20 > 0
    (exit_,) = events(d, "supervisor_exit")
    assert exit_["details"]["exit_code"] == EXIT_STOPPED
    r = run(cmd, timeout=180)  # requeued: the same command
    assert r.returncode == 0, r.stdout[-3000:]
    assert events(d, "resume")[0]["details"]["snapshot_step"] == 20
    for a, b in zip(final_states(clean), [_load(p) for p in sorted(final.glob("rank*.pt"))],
                    strict=True):  # fmt: skip
        assert_bitwise_equal(a, b, "final")


# --- hangs: the clock, and a frozen rank --------------------------------------------------------
def test_stalls_are_judged_on_the_monotonic_clock() -> None:
    """A beat on the supervisor's clock is aged by its monotonic progress, whatever its wall
    time says; a beat on another clock by when it was last seen to change; a gap in the
    supervisor's own looks (a pause) restarts every age."""
    me = clock_id()
    stalls = Stalls(me, pause_s=10.0)
    stalls.look(100.0)
    ours = {"rank": 0, "clock": me, "progress_mono": 97.0, "progress_time": 1e9 - 600}
    assert stalls.age(ours, 100.0) == 3.0  # the wall time 600 s behind changes nothing
    other = {"rank": 1, "clock": "another host", "progress_mono": 5.0, "step": 4}
    assert stalls.age(other, 100.0) == 0.0  # first seen now
    assert stalls.age(other, 104.0) == 4.0  # unchanged since
    assert stalls.age({**other, "step": 5, "progress_mono": 6.0}, 105.0) == 0.0
    stalls.look(104.0)
    assert stalls.look(160.0)  # 56 s without a look: the supervisor was paused
    assert stalls.age(ours, 160.0) == 0.0 and stalls.age(ours, 163.0) == 3.0
    assert stalls.elapsed(0.0, 163.0) == 3.0


def test_a_wall_clock_step_in_every_process_is_not_a_hang(tmp_path: Path) -> None:
    """+600 s on the wall clock of the supervisor, torchrun and both ranks at step 10
    (tests/clockshim steps time.time() in each): the ranks go on making progress and the
    supervisor, judging on the monotonic clock, never calls it a hang."""
    d = tmp_path / "run"
    step_file = tmp_path / "clock-step"
    env = {"ORCHESTRATOR_TEST_CLOCK_STEP_FILE": str(step_file),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "clockshim"),
                                          os.environ.get("PYTHONPATH", str(REPO))])}  # fmt: skip
    policy = {"supervisor": {**FAST, "hang_timeout_s": 5.0}}
    proc = spawn(launch_cmd(d, policy, *torchrun("--steps", "120")), env)
    until("step 10", lambda: step_of(d) >= 10, proc)
    step_file.write_text("600")
    r = wait(proc)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not events(d, "hang") and len(events(d, "attempt_start")) == 1
    (start,) = events(d, "attempt_start")
    (end,) = [e for e in events(d, "run_end") if e["rank"] == 0]
    assert end["details"]["steps"] == 120
    assert end["time"] - start["time"] > 600  # the workers' clocks did step


def test_a_frozen_rank_is_named_from_proc(tmp_path: Path) -> None:
    """collect(): a rank that gives no stack while another does is a culprit, with its /proc
    state (a real stopped process)."""
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while proc_state(frozen.pid) != "T":  # bounded: the stop takes effect
            assert time.monotonic() < deadline
            time.sleep(0.01)
        folder = tmp_path / "heartbeats" / "n1"
        folder.mkdir(parents=True)
        (folder / "rank0.stack").write_text(
            "Current thread 0x0000000000000001 (most recent call first):\n"
            '  File "/x/torch/distributed/distributed_c10d.py", line 9 in all_reduce\n'
        )
        beats = [{"rank": 0, "pid": os.getpid(), "thread": "0x0000000000000001", "host": "h"},
                 {"rank": 1, "pid": frozen.pid, "thread": "0x2", "host": "h"}]  # fmt: skip
        states = {os.getpid(): "S", frozen.pid: proc_state(frozen.pid)}
        _, named, seen = collect(str(tmp_path), 0, "n1", beats, lambda b: [0, 1], wait_s=0.5,
                                 state=states.get)  # fmt: skip
        assert seen == {0: "S", 1: "T"}
        (culprit,) = named
        assert (culprit["rank"], culprit["answered"], culprit["state"]) == (1, False, "T")
        assert culprit["pid"] == frozen.pid and culprit["frame"] is None
    finally:
        frozen.kill()
        frozen.wait()


def test_a_sigstopped_rank_is_named_as_the_hangs_culprit(tmp_path: Path) -> None:
    """A rank frozen by SIGSTOP cannot answer the stack request; its peer waits in the
    all-reduce. The hang event names the frozen rank as the culprit with its /proc state
    (T), and the supervisor restarts the job (stopped by the test once it has: recovery
    after a hang is tests/test_supervisor.py's)."""
    d = tmp_path / "run"
    policy = {**SAME, "supervisor": {**FAST, "hang_timeout_s": 3.0, "grace_s": 2.0}}
    proc = spawn(launch_cmd(d, policy, *torchrun("--steps", "1000")))
    try:
        until("step 10", lambda: step_of(d) >= 10, proc)
        (rank1,) = [b for b in read_heartbeats(str(d)) if b["rank"] == 1]
        os.kill(int(rank1["pid"]), signal.SIGSTOP)
        until("the restart after the hang", lambda: bool(events(d, "restart")), proc)
    finally:
        proc.send_signal(signal.SIGTERM)  # as a scheduler would
    r = wait(proc)
    assert r.returncode == EXIT_STOPPED, r.stdout[-3000:]
    (hang,) = events(d, "hang")
    (culprit,) = hang["details"]["culprits"]
    assert (culprit["rank"], culprit["answered"], culprit["state"]) == (1, False, "T")
    assert culprit["pid"] == rank1["pid"]
    assert hang["details"]["states"]["1"] == "T" and hang["details"]["states"]["0"] in "RS"
    assert [e["details"]["cause"] for e in events(d, "restart")] == ["hang"]
    assert leftovers(d) == []  # the frozen rank too: SIGKILL reaches a stopped process
