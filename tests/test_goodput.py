"""Goodput (issue 20): the ledger against losses the test injects and times itself, the
Prometheus endpoint scraped over HTTP, alerts, and automatic intervals end to end.

The test's own measurements come from its clock, /proc and the ranks' heartbeat files,
never from the ledger's arithmetic: a crash from the moment the killed rank's process is
gone to the moment a rank of the next attempt writes its first beat; a hang from the hung
rank's last progress to the moment its attempt's processes (the ranks and their torchrun)
are gone; a preemption from the SIGTERM the test sends to the moment they are gone; a
rollback's thrown away work from the time the same steps take again after it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from test_supervisor import launch_cmd

from conftest import EXAMPLE, free_port, kinds, run, spawn, wait
from orchestrator.goodput import KINDS, run_ledger
from orchestrator.heartbeat import progress_time, read_heartbeats
from orchestrator.journal import read_metrics

pytestmark = pytest.mark.timeout(600)

MODEL = ["--d-model", "256", "--layers", "6"]  # steps long enough to time a rollback's waste
SUP = {"backoff_s": 0.5, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.25,
       "hang_timeout_s": 4.0, "grace_s": 30.0}  # fmt: skip


def torchrun(run_dir: Path, steps: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
            *MODEL, "--steps", str(steps), "--save-final", str(run_dir / "final")]  # fmt: skip


class Watch:
    """What the test sees of a run from outside, on its own clock."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.first_beat: dict[int, float] = {}  # attempt -> when a rank first beat in it
        self.last_move: dict[tuple[int, int], tuple[float, float]] = {}  # (attempt, rank) ->
        #   (the beat's progress_time, when the test saw it change)
        self.pids: dict[int, set[int]] = {}  # attempt -> its workers' and launcher's pids
        self.gone: dict[int, float] = {}  # pid -> when the test saw it gone
        # The longest time between two looks: what the test sees is that late at worst
        # (a loaded machine stretches it from 20 ms to hundreds).
        self.resolution = 0.0
        self._looked: float | None = None

    def poll(self) -> None:
        now = time.time()
        if self._looked is not None:
            self.resolution = max(self.resolution, now - self._looked)
        self._looked = now
        for b in read_heartbeats(str(self.run_dir)):
            a, r = int(b["attempt"]), int(b["rank"])
            self.first_beat.setdefault(a, now)
            pids = self.pids.setdefault(a, set())
            if int(b["pid"]) not in pids:  # the rank and its launcher (torchrun)
                pids.add(int(b["pid"]))
                parent = _parent(int(b["pid"]))
                if parent is not None:
                    pids.add(parent)
            moved = progress_time(b)
            if self.last_move.get((a, r), (None,))[0] != moved:
                self.last_move[(a, r)] = (moved, now)
        for pids in self.pids.values():
            for pid in pids:
                if pid not in self.gone and _dead(pid):
                    self.gone[pid] = now

    def until(self, what: str, done: Any, proc: Any, limit_s: float = 180) -> None:
        deadline = time.monotonic() + limit_s
        while not done():
            self.poll()
            assert proc.poll() is None or done(), f"the supervisor ended before {what}"
            assert time.monotonic() < deadline, f"no {what} within {limit_s} s"
            time.sleep(0.02)  # bounded by the deadline
        self._looked = None  # the time until the next watch is not a gap between looks

    def step(self, attempt: int) -> int:
        beats = [b for b in read_heartbeats(str(self.run_dir)) if b["attempt"] == attempt]
        return max((int(b["step"]) for b in beats), default=-1)

    def all_gone(self, attempt: int) -> float | None:
        pids = self.pids.get(attempt, set())
        if not pids or any(p not in self.gone for p in pids):
            return None
        return max(self.gone[p] for p in pids)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _dead(pid: int) -> bool:
    """Gone, or a zombie (dead, its exit status not yet collected by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def close(measured: float, ledger_s: float, what: str, resolution: float = 0.0) -> None:
    """Within 10%, plus what the test's own measurement may be off: two looks' worth of
    its longest gap between looks (each end of the interval is seen that late at worst)."""
    assert abs(ledger_s - measured) <= 0.10 * measured + 2 * resolution, (
        f"{what}: the ledger says {ledger_s:.3f} s, the test measured {measured:.3f} s "
        f"(the test looked every {resolution:.3f} s at worst)"
    )


def test_the_ledger_attributes_each_injected_loss(tmp_path: Path) -> None:
    """A NaN at step 19 (rollback to 10), a crash at 35, a hang at 55 (the next attempt),
    a preemption by the test at 75 and the same command again to 100: each loss lands in
    its own kind within 10% of the test's measurement, and the parts add up to the wall."""
    d = tmp_path / "run"
    policy = {
        "adjust": {"lr_factor": 1.0},
        "snapshot": {"every_steps": 10},
        "persist": {"every_steps": 20},
        "quarantine": {"isolate": False},  # the rollback goes straight to the snapshot
        "supervisor": SUP,
        "faults": [
            {"kind": "nan_grad", "step": 19, "rank": 1},
            {"kind": "crash", "step": 35, "rank": 1},
            {"kind": "hang", "step": 55, "rank": 0},
            # The preemption's durable snapshot takes a while: a preemption long enough to
            # time to 10%. Only from step 70: a slow write in flight beside steps 10-19 would
            # slow them, which the ledger counts as persist, not replayed (CI saw it).
            {"kind": "slow_storage", "op": "write", "seconds": 3.0, "rank": 0, "from_step": 70},
        ],
    }
    cmd = launch_cmd(d, policy, *torchrun(d, 100))
    watch = Watch(d)
    t_start = time.time()
    proc = spawn(cmd)
    # The crash: rank 1's process of attempt 0 gone; a rank of attempt 1 beating.
    watch.until("attempt 1", lambda: 1 in watch.first_beat, proc)
    # The hang: attempt 2 begins once attempt 1's processes are gone.
    watch.until("attempt 2", lambda: 2 in watch.first_beat, proc)
    watch.until("step 75", lambda: watch.step(2) >= 75, proc)
    t_sig = time.time()
    os.killpg(proc.pid, 0)  # still there
    proc.send_signal(signal.SIGTERM)
    watch.until("attempt 2's end", lambda: watch.all_gone(2) is not None, proc, 120)
    r = wait(proc, 120)
    assert r.returncode == 73, r.stdout[-3000:]
    t_first_end = time.time()
    proc = spawn(cmd)  # the same command again
    watch.until("the second job's first beat", lambda: 3 in watch.first_beat, proc)
    r = wait(proc, 240)
    assert r.returncode == 0, r.stdout[-3000:]
    t_end = time.time()

    led = run_ledger(str(d))
    parts, by = led.parts, led.by_attempt
    assert set(parts) == set(KINDS)
    assert abs(sum(parts.values()) - led.wall_s) < 1e-6 * led.wall_s
    # The wall: both jobs' supervisors, from their first attempt to their exit.
    close((t_first_end - t_start) + (t_end - t_first_end), led.wall_s, "wall")

    # The crash: from the killed rank's process gone to attempt 1's first completed step.
    crashed = min(watch.gone[p] for p in watch.pids[0] if p in watch.gone)
    res = watch.resolution
    close(watch.first_beat[1] - crashed, by[("restart", 0)] + by[("restart", 1)], "restart", res)
    # The hang: rank 0's last progress in attempt 1 to its attempt's processes gone.
    hung_at = watch.last_move[(1, 0)][0]
    close(watch.all_gone(1) - hung_at, by[("hang", 1)], "hang", res)  # type: ignore[operator]
    # The preemption: the SIGTERM to attempt 2's processes gone.
    close(watch.all_gone(2) - t_sig, by[("preemption", 2)], "preemption", res)  # type: ignore[operator]
    # The rollback: steps 10-18 and the bad step 19 were done, then 10-18 again after it.
    (rb,) = kinds(d, "rollback")
    assert (rb["details"]["from_step"], rb["details"]["to_step"]) == (19, 10)
    (rec,) = kinds(d, "recovered")
    metrics = [m for m in read_metrics(str(d)) if m["attempt"] == 0 and 10 <= m["step"] <= 18]
    # The work thrown away, as it was done: from the snapshot of step 10 to the bad step's
    # incident, less the checks of the steps between (the ledger counts those as checks).
    (snap10,) = [e for e in kinds(d, "snapshot") if e["attempt"] == 0 and e["step"] == 10
                 and e["time"] < rec["time"]]  # fmt: skip
    first = [m for m in metrics if m["time"] < rec["time"]]
    began = float(rec["details"]["incident"]["started_at"])
    thrown = began - float(snap10["time"]) - sum(m["check_s"] for m in first)
    close(thrown, by[("replayed", 0)], "replayed")
    # And the cost of doing it again, roughly: steps 10-18 a second time, less their checks;
    # the first time the bad step's own work came on top (one step more). Step times vary
    # from pass to pass (a durable write in flight beside one of them), hence 25%.
    redone = [m for m in metrics if m["time"] > rec["time"]]
    redo = float(redone[-1]["time"]) - float(rec["time"]) - sum(m["check_s"] for m in redone)
    assert abs(redo * 10 / 9 - by[("replayed", 0)]) <= 0.25 * redo * 10 / 9, (redo, by)
    assert by[("incident", 0)] > 0 and parts["lost"] > 0 and parts["productive"] > 0
    # And the figure operators watch.
    status = run([sys.executable, "-m", "launch.cli", "status", str(d)], timeout=60)
    assert f"goodput {led.goodput:.1%}" in status.stdout, status.stdout


def scrape(url: str) -> dict[str, float]:
    """The endpoint's samples: 'name{labels}' -> value."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_prometheus_endpoint_and_alerts(tmp_path: Path) -> None:
    """The supervisor's endpoint, scraped over HTTP while the run trains and after an
    incident and a hang: the counters move; the hang runs alerts.command with the event as
    JSON on stdin."""
    pytest.importorskip("prometheus_client", reason="pip install -e '.[dev]' installs it")
    d = tmp_path / "run"
    got = tmp_path / "alerts.jsonl"
    alert = [sys.executable, "-c",
             f"import sys; open({str(got)!r}, 'a').write(sys.stdin.read() + '\\n')"]  # fmt: skip
    policy = {
        "supervisor": SUP,
        # The private ring: its snapshots' age is the tier "memory" read below (the ring in
        # shared memory, the default where /dev/shm has room, is the tier "shm").
        "snapshot": {"shared_memory": False},
        "persist": {"every_steps": 20},
        "export": {"prometheus_port": 0, "prometheus_addr": "127.0.0.1"},
        "alerts": {"command": alert},
        "faults": [
            {"kind": "nan_grad", "step": 30, "rank": 1},
            {"kind": "hang", "step": 60, "rank": 0},
        ],
    }
    cmd = launch_cmd(d, policy, *torchrun(d, 90)[:-2])  # no --save-final needed
    proc = spawn(cmd)
    watch = Watch(d)
    watch.until("the exporter", lambda: bool(kinds(d, "exporter")), proc, 60)
    (ex,) = kinds(d, "exporter")
    url = f"http://127.0.0.1:{ex['details']['port']}/metrics"
    watch.until("step 10", lambda: watch.step(0) >= 10, proc)
    before = scrape(url)
    assert before['orchestrator_incidents_total{node="' + _node() + '"}'] == 0
    watch.until("the incident", lambda: bool(kinds(d, "recovered")), proc)
    watch.until("attempt 1", lambda: 1 in watch.first_beat, proc)
    watch.until("attempt 1's progress", lambda: watch.step(1) >= 40, proc)
    after = scrape(url)
    r = wait(proc, 240)
    assert r.returncode == 0, r.stdout[-3000:]
    n = _node()

    def of(samples: dict[str, float], name: str, **labels: str) -> float:
        label = ",".join(f'{k}="{v}"' for k, v in sorted({"node": n, **labels}.items()))
        return samples[f"orchestrator_{name}{{{label}}}"]

    assert of(after, "incidents_total") == 1 and of(after, "rollbacks_total") == 1
    assert of(after, "hangs_total") == 1 and of(after, "restarts_total") == 1
    assert of(after, "attempt") == 1 and of(before, "attempt") == 0
    assert of(before, "step") >= 10 and of(after, "step") >= 40  # attempt 1 resumed at 40
    assert 0 < of(after, "goodput") <= 1
    assert of(after, "time_seconds", kind="hang") > 0
    assert of(before, "snapshot_age_seconds", tier="memory") < 60
    alerts = [json.loads(line) for line in got.read_text().splitlines() if line.strip()]
    assert [a["alert"] for a in alerts] == ["hang"]
    assert alerts[0]["event"]["kind"] == "hang" and alerts[0]["event"]["details"]["stalled_ranks"]
    (sent,) = kinds(d, "alert")
    assert sent["details"]["returncode"] == 0


def _node() -> str:
    import socket

    return os.environ.get("ORCHESTRATOR_NODE") or socket.gethostname()


def test_automatic_intervals_run_and_say_why(tmp_path: Path) -> None:
    """every_steps: auto on both tiers: the run completes, the Guard journals each change
    of interval with what it was chosen from, the durable one a multiple of the other."""
    d = tmp_path / "run"
    policy = {
        "snapshot": {"every_steps": "auto"},
        "persist": {"every_steps": "auto"},
        "tune": {"every_steps": 20, "initial_snapshot_steps": 5, "initial_persist_steps": 10,
                 # Incidents every few seconds and restarts every minute (priors that
                 # weigh an hour): intervals of a few steps, away from the initial ones.
                 "prior_incident_mtbf_s": 3.0, "prior_restart_mtbf_s": 60.0},
        "supervisor": SUP,
    }  # fmt: skip
    r = run(launch_cmd(d, policy, *torchrun(d, 100)[:-2]), timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    changes = kinds(d, "interval")
    assert changes, "no interval was chosen"
    for c in changes:
        det = c["details"]
        assert det["tier"] in ("snapshot", "persist") and det["new"] != det["old"]
        for key in ("cost_s", "mtbf_s", "step_s", "optimum_s", "incidents", "trained_s"):
            assert key in det, det
    snap = [c["details"]["new"] for c in changes if c["details"]["tier"] == "snapshot"]
    assert snap and any(c["details"]["tier"] == "persist" for c in changes), changes
    # Every durable interval chosen is a multiple of the ring's interval in force then
    # (a tuning journals the ring's change first).
    from orchestrator.policy import parse_policy
    from orchestrator.tuning import resolve_auto

    ring = resolve_auto(parse_policy(policy)).snapshot.every_steps
    for c in changes:
        if c["details"]["tier"] == "snapshot":
            ring = c["details"]["new"]
        else:
            assert c["details"]["new"] % ring == 0, (c["details"], ring)
    # The snapshots follow the chosen interval.
    last = changes[-1]
    later = [e["step"] for e in kinds(d, "snapshot") if e["time"] > last["time"]]
    every = snap[-1]
    assert later and all(s % every == 0 for s in later), (later, every)


def test_tensorboard_scalars(tmp_path: Path) -> None:
    """export.tensorboard_dir: rank 0's metrics rows as TensorBoard scalars, read back with
    TensorBoard's own reader."""
    pytest.importorskip("tensorboard", reason="pip install -e '.[dev]' installs it")
    from inproc import train as train_inproc
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    train_inproc(tmp_path / "run", {"export": {"tensorboard_dir": str(tb)}}, steps=12)
    acc = EventAccumulator(str(tb))
    acc.Reload()
    loss = acc.Scalars("loss")
    assert [s.step for s in loss] == list(range(12))
    rows = read_metrics(str(tmp_path / "run"))
    assert [round(s.value, 4) for s in loss] == [round(r["loss"], 4) for r in rows]
    assert {"grad_norm", "lr"} <= set(acc.Tags()["scalars"])


def _ev(t: float, kind: str, attempt: int, step: int = 0, rank: int = 0, **details: Any) -> dict:
    return {"time": t, "kind": kind, "attempt": attempt, "step": step, "rank": rank,
            "details": details}  # fmt: skip


def test_a_resume_from_before_a_rollback_counts_the_replayed_work_once() -> None:
    """A hand-built journal (no training): attempt 0 rolls back from 25 to 10 (its work
    since step 10's snapshot replayed), then crashes; attempt 1 resumes from step 10, so
    everything since step 10's capture is lost, the replayed span inside it included. Each
    second counts once: the parts sum to the wall, none negative. Rows every 5 steps
    (metrics.every_steps: 5) carry the checks and write counts of all 5 steps."""
    events = [
        _ev(0.0, "attempt_start", 0, rank=-1),
        _ev(1.0, "first_step", 0),
        _ev(2.0, "snapshot", 0, step=10, stall_ms=0.0),
        _ev(3.0, "snapshot", 0, step=20, stall_ms=0.0),
        _ev(3.6, "rollback", 0, step=25, to_step=10),
        _ev(4.0, "recovered", 0, step=10, incident={"started_at": 3.5}),
        _ev(8.0, "attempt_end", 0, rank=-1, outcome="crash", ended_at=8.0, progress_time=7.5),
        _ev(9.0, "attempt_start", 1, rank=-1),
        _ev(9.5, "resume", 1, step=10, snapshot_step=10),
        _ev(10.0, "first_step", 1),
        _ev(15.0, "attempt_end", 1, rank=-1, outcome="ok", ended_at=15.0),
    ]
    rows = [
        {"time": 1.0 + i, "step": 5 * (i + 1), "attempt": 0, "step_s": 0.2, "check_s": 0.05,
         "writing": 5 if i == 2 else None} for i in range(3)
    ] + [
        {"time": 10.0 + i, "step": 10 + 5 * i, "attempt": 1, "step_s": 0.2, "check_s": 0.05}
        for i in range(5)
    ]  # fmt: skip
    from orchestrator.goodput import ledger

    led = ledger(events, rows)
    assert led.wall_s == pytest.approx(15.0)
    assert sum(led.parts.values()) == pytest.approx(led.wall_s)
    assert all(v >= 0 for v in led.parts.values()), led.parts
    by = led.by_attempt
    assert by[("replayed", 0)] == pytest.approx(1.5 - 0.1)  # 2.0 to 3.5, less 2 rows' checks
    assert by[("incident", 0)] == pytest.approx(0.5)
    # 2.0 to 7.5 is lost, less the replayed span, the incident and the checks (the rows at
    # 2, 3 s; the one at 1 s came before) already counted as what they are
    inside = by[("replayed", 0)] + by[("incident", 0)] + by[("check", 0)] - 0.05
    assert by[("lost", 0)] + inside == pytest.approx(5.5)
