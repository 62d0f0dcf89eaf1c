"""Health checks on 2 real gloo ranks: `orchestrator health` as a standalone pre-flight, and
inside the Guard (pre-flight and on an incident) with the UNHEALTHY exit under the
supervisor. Faults make one rank's collective contributions or compute wrong."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import EXAMPLE, free_port, kinds, run
from orchestrator.errors import EXIT_UNHEALTHY

pytestmark = pytest.mark.timeout(300)


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]  # fmt: skip


def launch_unhealthy(tmp_path: Path, policy: dict[str, Any], d: Path) -> None:
    """The example (20 steps, 2 ranks) under the supervisor into ``d``, expected to stop
    with 72."""
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", policy_file(tmp_path, policy),
           "--run-dir", str(d), "--", *torchrun(str(EXAMPLE), "--steps", "20")]  # fmt: skip
    r = run(cmd, timeout=200)
    assert r.returncode == EXIT_UNHEALTHY, r.stdout[-3000:]


def policy_file(tmp_path: Path, policy: dict[str, Any]) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return str(path)


def health(tmp_path: Path, policy: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    run_dir = tmp_path / "health"
    cmd = [sys.executable, "-m", "launch.cli", "health", "--policy",
           policy_file(tmp_path, policy), "--run-dir", str(run_dir), "--", *torchrun()]  # fmt: skip
    r = run(cmd, timeout=120)
    return r.returncode, json.loads((run_dir / "health.json").read_text()), r.stdout


def test_standalone_preflight_healthy(tmp_path: Path) -> None:
    code, report, out = health(tmp_path, {})
    assert code == 0, out[-3000:]
    assert report["healthy"] and report["bad_ranks"] == {}
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for r in report["ranks"]:
        c = r["checks"]
        assert c["collectives"]["ok"] and c["compute"]["ok"] and c["memory"]["ok"]
        assert c["bandwidth"]["gbps"] > 0
    table = [line.split() for line in out.splitlines() if line[:1] in "01"]
    assert [row[0] for row in table] == ["0", "1"] and all(row[-1] == "ok" for row in table)


def test_standalone_corrupt_allreduce_names_the_rank(tmp_path: Path) -> None:
    code, report, out = health(tmp_path, {"faults": [{"kind": "corrupt_allreduce", "rank": 1}]})
    assert code == EXIT_UNHEALTHY, out[-3000:]
    assert report["bad_ranks"] == {"1": ["collectives"]}
    # Rank 0 received rank 1's wrong data; the all-reduce result is wrong everywhere.
    by_rank = {r["rank"]: r["checks"]["collectives"] for r in report["ranks"]}
    assert by_rank[0]["bad_senders"] == [1] and not by_rank[0]["all_reduce_ok"]


def test_flaky_compute_names_the_rank(tmp_path: Path) -> None:
    code, report, out = health(tmp_path, {"faults": [{"kind": "flaky_compute", "rank": 0}]})
    assert code == EXIT_UNHEALTHY, out[-3000:]
    assert report["bad_ranks"] == {"0": ["compute"]}
    compute = {r["rank"]: r["checks"]["compute"] for r in report["ranks"]}
    assert compute[0]["max_rel_error"] > 1e-3 > compute[1]["max_rel_error"]
    assert compute[0]["checksum"] != compute[1]["checksum"]


@pytest.mark.parametrize("when", ["preflight", "incident"])
def test_guard_exits_unhealthy_under_the_supervisor(tmp_path: Path, when: str) -> None:
    """corrupt_allreduce on rank 1: the Guard's health check (at start, or on the incident
    a NaN causes) fails naming rank 1; the workers exit 72 and the supervisor, allowed no
    unhealthy attempt, stops with 72. Bounded by the health timeout, never a hang."""
    timeout_s = 20.0
    policy = {
        "health": {"preflight": when == "preflight", "timeout_s": timeout_s},
        "supervisor": {"max_unhealthy": 0, "backoff_s": 0.2},
        "faults": [{"kind": "corrupt_allreduce", "rank": 1}]
        + ([{"kind": "nan_grad", "step": 5, "rank": 0}] if when == "incident" else []),
    }
    d = tmp_path / "run"
    t0 = time.monotonic()
    launch_unhealthy(tmp_path, policy, d)
    (event,) = kinds(d, "unhealthy")
    assert event["details"]["ranks"] == [1] and event["details"]["failed"] == {"1": ["collectives"]}
    assert event["details"]["reason"] == (
        "preflight" if when == "preflight" else "incident at step 5"
    )
    (health_event,) = kinds(d, "health")
    assert health_event["details"]["seconds"] < timeout_s
    assert time.monotonic() - t0 < 120
    assert kinds(d, "run_end")[-1]["details"]["status"] == "stopped"


def test_slow_rank_below_the_baseline_is_named(tmp_path: Path) -> None:
    """A first (healthy) pre-flight records the bandwidth baseline in the run directory; a
    second one with rank 1 four times slower fails bandwidth, naming rank 1."""
    code, first, out = health(tmp_path, {"health": {"preflight": True}})
    assert code == 0, out[-3000:]
    assert (tmp_path / "health" / "health_baseline.json").exists()
    slow = {
        "health": {"preflight": True},
        "faults": [{"kind": "slow_rank", "rank": 1, "factor": 8}],
    }
    code, report, out = health(tmp_path, slow)
    assert code == EXIT_UNHEALTHY, out[-3000:]
    assert list(report["bad_ranks"]) == ["1"] and "bandwidth" in report["bad_ranks"]["1"][0]
    assert report["bandwidth_gbps"] < 0.5 * report["baseline_gbps"]
    assert report["baseline_gbps"] == first["bandwidth_gbps"]


def test_a_rank_that_never_enters_the_check_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    """miss_health on rank 1: it never enters the pre-flight check (it blocks, as a rank hung
    elsewhere does). Rank 0's collectives time out after health.timeout_s; the roll call
    names rank 1 as absent, with its host; the job ends with 72 instead of hanging."""
    timeout_s = 5.0
    policy = {
        "health": {"preflight": True, "timeout_s": timeout_s},
        "supervisor": {"max_unhealthy": 0, "backoff_s": 0.2},
        "faults": [{"kind": "miss_health", "rank": 1}],
    }
    d = tmp_path / "run"
    t0 = time.monotonic()
    launch_unhealthy(tmp_path, policy, d)
    assert time.monotonic() - t0 < 90
    (event,) = kinds(d, "unhealthy")
    assert event["rank"] == 0 and event["details"]["ranks"] == [1]
    assert event["details"]["failed"]["1"][0].startswith("absent")
    assert event["details"]["hosts"] == [socket.gethostname()]  # the absent rank's, named
    (health_event,) = kinds(d, "health")
    assert health_event["details"]["absent"] == {"1": event["details"]["hosts"][0]}
    assert health_event["details"]["seconds"] < timeout_s + 10
    (fault,) = kinds(d, "fault")
    assert fault["rank"] == 1 and fault["details"]["key"] == "miss_health:rank=1"
