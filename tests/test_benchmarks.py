"""The benchmark scripts still run (tiny sizes; the numbers are not looked at here: speed
is reported by running them, never asserted in a test)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "args",
    [
        ["benchmarks/bench_guard.py", "--d-model", "32", "--layers", "1", "--steps", "2",
         "--rounds", "1", "--snap-reps", "1"],
        ["benchmarks/bench_persist.py", "--d-model", "32", "--layers", "1", "--reps", "1"],
        ["benchmarks/bench_persist.py", "--fsdp", "--d-model", "32", "--layers", "1",
         "--reps", "1"],
        # DeepSpeed's engine is tested in test_deepspeed.py; its benchmark script (70 s of
        # CI here) runs with the full matrix.
        pytest.param(["benchmarks/bench_deepspeed.py", "--d-model", "32", "--layers", "1",
                      "--reps", "1"], marks=pytest.mark.matrix),
    ],
    ids=["guard", "persist", "persist-fsdp", "deepspeed"],
)  # fmt: skip
def test_benchmark_runs(args: list[str]) -> None:
    r = run([sys.executable, *args, "--json"], timeout=280)
    assert r.returncode == 0, r.stdout[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["world_size"] for row in rows] == [1, 2]
    assert all(v == v for row in rows for v in row.values() if isinstance(v, float))  # no NaN


@pytest.mark.matrix  # 55 s of CI; the per-topic scripts above run in the default set
def test_suite_cases_run_and_tabulate() -> None:
    """The suite's own cases at a tiny size, and its tables built from their results."""
    sys.path.insert(0, "benchmarks")
    from suite import tables

    results = []
    for case in ("snapshot", "detect", "recovery"):
        r = run([sys.executable, "benchmarks/cases.py", case, "--size", "tiny", "--reps", "1",
                 "--steps", "2", "--json"], timeout=280)  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:]
        rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
        assert [row["world_size"] for row in rows] == ([1] if case == "recovery" else [1, 2])
        results += [{"case": case, "size": "tiny", "nproc": row["world_size"], "result": row}
                    for row in rows]  # fmt: skip
    md = tables(results)
    for heading in (
        "Snapshot stall and restore",
        "Shared-memory ring",
        "Detection cost",
        "Recovery",
    ):
        assert heading in md
    assert md.count("\n| 0.0M |") == 4  # one row per world size, private ring and shared
    for row in (r["result"] for r in results if r["case"] == "snapshot"):
        assert row["shm_node_slot_over_state"] < 1.1  # the replicated state counted once


@pytest.mark.matrix  # about 2 minutes: three supervised runs with crashes
def test_goodput_benchmark_runs() -> None:
    r = run([sys.executable, "benchmarks/bench_goodput.py", "--steps", "60", "--crash-every",
             "40", "--nan-every", "40", "--d-model", "32", "--layers", "1", "--sweep", "10",
             "--json"], timeout=280)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["config"] for row in rows] == ["defaults", "auto", "fixed-10-10"]
    assert all(0 < row["goodput"] <= 1 for row in rows)


@pytest.mark.matrix  # two supervised runs with a crash each (about 20 s); none of the extras
def test_inplace_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "inplace.json"
    r = run([sys.executable, "benchmarks/bench_inplace.py", "--smoke", "--json", str(out)],
            timeout=280)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(x["case"], "failed" in x) for x in runs] == [("inplace", False), ("restart", False)]
    assert runs[0]["resumed_step"] == 25  # the newest snapshot before the fault at 27
    assert all(x["fault_to_full_step_s"] > 0 for x in runs)
