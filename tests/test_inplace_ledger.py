"""In-place recoveries (issue 33) in the goodput ledger, `orchestrator report` and the
Prometheus exporter: their own kind (``inplace``: fault to the first step after), the
steps redone counted as ``lost``, none of it a restart. A hand-built journal for exact
numbers, and one real run under the node agent (rank 1 SIGKILLed at step 27)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import EXAMPLE, kinds, run
from launch.exporter import Exporter
from launch.outcomes import inplace_steps
from launch.report import load, totals
from launch.status import render
from orchestrator.goodput import KINDS, ledger, run_ledger
from orchestrator.goodput_inplace import recoveries, summary
from orchestrator.journal import read_events

pytestmark = pytest.mark.timeout(120)


def _ev(t: float, kind: str, step: int = 0, by: int = 0, **details: Any) -> dict[str, Any]:
    return {"time": t, "kind": kind, "attempt": 0, "step": step, "rank": by,
            "details": details}  # fmt: skip


def _write(run_dir: Path, events: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    (run_dir / "journal").mkdir(parents=True)
    (run_dir / "journal" / "vm.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _metrics(exporter: Exporter) -> dict[str, float]:
    out = {}
    for family in exporter.collect():
        for s in family.samples:
            out[s.name + "".join(f"|{v}" for k, v in s.labels.items() if k == "kind")] = s.value
    return out


def test_the_ledger_report_and_exporter_count_an_in_place_recovery(tmp_path: Path) -> None:
    """Attempt 0: steps from 1 s, snapshot of step 20 captured at 3 s, rank 1 dies at
    3.8 s, the ranks resume from step 20 and commit the next step at 6 s: 2.2 s in place,
    3.0 to 3.8 s redone (lost, less the checks of the rows inside it), no restart."""
    run_dir = tmp_path / "run"
    times = {"fault": 3.8, "detect": 3.9, "leave": 4.0, "reform": 5.0, "heal": 5.5,
             "first_step": 6.0}  # fmt: skip
    events = [
        _ev(0.0, "attempt_start", by=-1, node="vm"),
        _ev(1.0, "first_step"),
        _ev(3.0, "snapshot", step=20, stall_ms=0.0),
        _ev(3.5, "snapshot", step=25, stall_ms=0.0),
        _ev(5.6, "rank_replaced", by=-1, rank=1, cause="signal", generation=1),
        _ev(
            6.0,
            "inplace_recovery",
            step=20,
            generation=1,
            replaced=[1],
            cause="signal",
            times=times,
        ),
        _ev(8.0, "attempt_end", step=40, by=-1, outcome="ok", ended_at=8.0, node="vm"),
        _ev(8.0, "supervisor_exit", step=40, by=-1, exit_code=0, reason="finished", node="vm"),
    ]
    rows = [{"time": 1.0 + 0.5 * i, "step": 5 * i, "attempt": 0, "step_s": 0.1, "check_s": 0.01}
            for i in range(14)]  # fmt: skip
    _write(run_dir, events, rows)
    led = run_ledger(str(run_dir))
    assert led.wall_s == pytest.approx(8.0)
    assert sum(led.parts.values()) == pytest.approx(led.wall_s)
    assert all(v >= 0 for v in led.parts.values()), led.parts
    assert led.parts["inplace"] == pytest.approx(2.2)
    assert led.parts["restart"] == 0.0
    # 3.0 to 3.8 s redone: less the checks of the rows at 3.0 and 3.5 s inside it
    assert led.parts["lost"] == pytest.approx(0.8 - 0.02)
    (rec,) = recoveries(read_events(str(run_dir)).events)
    assert (rec.step, rec.generation, rec.replaced, rec.cause) == (20, 1, (1,), "signal")
    assert rec.seconds == pytest.approx(2.2) and rec.redone_s == pytest.approx(0.8)

    t = totals(load(str(run_dir)))
    assert t["restarts"] == 0
    assert t["inplace"]["count"] == 1 and t["inplace"]["replaced"] == [1]
    assert t["inplace"]["seconds"] == pytest.approx(2.2)
    assert t["inplace"]["redone_s"] == pytest.approx(0.8)
    assert t["goodput"].parts["inplace"] == pytest.approx(2.2)
    assert render(str(run_dir))  # status reads the same journal without error

    exporter = Exporter(str(run_dir), "vm", 0, "127.0.0.1")
    try:
        got = _metrics(exporter)
    finally:
        exporter.close()
    assert got["orchestrator_restarts_total"] == 0
    assert got["orchestrator_inplace_recoveries_total"] == 1
    assert got["orchestrator_inplace_seconds_total"] == pytest.approx(2.2)
    assert got["orchestrator_time_seconds|inplace"] == pytest.approx(2.2)
    assert {f"orchestrator_time_seconds|{k}" for k in KINDS} <= set(got)


def test_a_real_in_place_recovery_is_its_own_kind(tmp_path: Path) -> None:
    """`orchestrator launch --nproc-per-node 2`, the example's Guard, rank 1 SIGKILLed at
    step 27: the ledger's ``inplace`` part is the journaled fault to first step, the
    redone steps are lost, nothing is a restart, and the parts still add up."""
    d = tmp_path / "run"
    policy = {
        "adjust": {"lr_factor": 1.0},
        "quarantine": {"enabled": False},
        "snapshot": {"every_steps": 5, "keep": 3, "shared_memory": False},
        "persist": {"every_steps": 10},
        "supervisor": {"backoff_s": 0.2},
        "faults": [{"kind": "crash", "step": 27, "rank": 1}],
    }
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
           "--run-dir", str(d), "--nproc-per-node", "2", str(EXAMPLE), "--steps", "40"]  # fmt: skip
    r = run(cmd, timeout=100)
    assert r.returncode == 0, r.stdout[-3000:]
    (ev,) = kinds(d, "inplace_recovery")
    times = ev["details"]["times"]
    led = run_ledger(str(d))
    assert sum(led.parts.values()) == pytest.approx(led.wall_s)
    assert led.parts["inplace"] == pytest.approx(times["first_step"] - times["fault"], abs=1e-6)
    assert led.parts["restart"] == 0.0 and led.parts["lost"] > 0.0
    s = summary(read_events(str(d)).events)
    assert (s["count"], s["replaced"]) == (1, [1])
    assert s["redone_s"] > 0.0 and s["seconds"] == pytest.approx(led.parts["inplace"])
    assert totals(load(str(d)))["inplace"] == s
    assert inplace_steps(str(d), 0) == (20,)  # what the supervisor's rules count


def test_a_full_restart_after_an_in_place_recovery_counts_the_redone_work_once() -> None:
    """An in-place recovery (fault 3.8 s, resumed from step 20 captured at 3 s, next step at
    6 s), then a crash (last progress 8.5 s); attempt 1 resumes from step 20 too: 3.0 to
    8.5 s is lost once (0.8 s of it the recovery's redone steps), less its 2.2 s in place."""
    times = {"fault": 3.8, "first_step": 6.0}
    events = [
        _ev(0.0, "attempt_start", by=-1),
        _ev(1.0, "first_step"),
        _ev(3.0, "snapshot", step=20, stall_ms=0.0),
        _ev(6.0, "inplace_recovery", step=20, generation=1, replaced=[1], times=times),
        _ev(9.0, "attempt_end", by=-1, outcome="crash", ended_at=9.0, progress_time=8.5),
        {**_ev(9.5, "attempt_start", by=-1), "attempt": 1},
        {**_ev(10.0, "resume", step=20, snapshot_step=20), "attempt": 1},
        {**_ev(10.5, "first_step"), "attempt": 1},
        {**_ev(12.0, "attempt_end", by=-1, outcome="ok", ended_at=12.0), "attempt": 1},
    ]
    led = ledger(events, [])
    assert led.wall_s == pytest.approx(12.0)
    assert sum(led.parts.values()) == pytest.approx(led.wall_s)
    assert led.parts["inplace"] == pytest.approx(2.2)
    assert led.parts["lost"] == pytest.approx(5.5 - 2.2)
    assert led.parts["productive"] == pytest.approx(7.5 - 2.2 - 3.3)
    assert led.parts["restart"] == pytest.approx(0.5 + 1.5)
