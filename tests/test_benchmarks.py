"""The benchmark scripts still run (tiny sizes; the numbers are not looked at here: speed
is reported by running them, never asserted in a test)."""

from __future__ import annotations

import json
import sys

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
        ["benchmarks/bench_deepspeed.py", "--d-model", "32", "--layers", "1", "--reps", "1"],
    ],
    ids=["guard", "persist", "persist-fsdp", "deepspeed"],
)  # fmt: skip
def test_benchmark_runs(args: list[str]) -> None:
    r = run([sys.executable, *args, "--json"], timeout=280)
    assert r.returncode == 0, r.stdout[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [row["world_size"] for row in rows] == [1, 2]
    assert all(v == v for row in rows for v in row.values() if isinstance(v, float))  # no NaN
