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
    # Within health.timeout_s, and not much sooner:
    # rank 0 waited for rank 1's evidence until then.
    assert 0.75 * timeout_s <= health_event["details"]["seconds"] < timeout_s
    # The collectives ended on the check's own deadline (the async_op wait NCCL takes too),
    # not on the group's timeout, which is longer (NCCL's watchdog must never fire first).
    (mine,) = health_event["details"]["ranks"]
    assert mine["checks"]["collectives"]["error"].startswith("HealthTimeout")
    assert mine["checks"]["bandwidth"] == {
        "ok": False,
        "error": mine["checks"]["collectives"]["error"],
    }
    (fault,) = kinds(d, "fault")
    assert fault["rank"] == 1 and fault["details"]["key"] == "miss_health:rank=1"
    # The healthy rank was not killed: it closed its run, saying why it stopped.
    (end,) = kinds(d, "run_end")
    assert end["rank"] == 0 and end["details"]["status"] == "stopped"


def test_a_rank_frozen_inside_the_check_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    """miss_health with stop on rank 1: it enters the standalone check (the roll call) and
    freezes (SIGSTOP: no thread of it runs). Rank 0's collectives end at the check's
    deadline; rank 1's evidence never comes; rank 0 names it as entered but silent, within
    health.timeout_s, and exits 72."""
    timeout_s = 4.0
    fault = {"kind": "miss_health", "rank": 1, "stop": True}
    code, report, out = health(tmp_path, {"health": {"timeout_s": timeout_s}, "faults": [fault]})
    assert code == EXIT_UNHEALTHY, out[-3000:]
    assert report["silent"] == {"1": socket.gethostname()} and report["absent"] == {}
    assert list(report["bad_ranks"]) == ["1"]
    assert report["bad_ranks"]["1"][0].startswith("absent: entered")
    assert 0.75 * timeout_s <= report["seconds"] < timeout_s
    (mine,) = report["ranks"]
    assert mine["rank"] == 0 and mine["checks"]["compute"]["ok"]
    assert mine["checks"]["collectives"]["error"].startswith("HealthTimeout")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "how", ["set_float32_matmul_precision_high", "set_float32_matmul_precision_medium",
            "cuda_allow_tf32", "new_api_tf32"],
)  # fmt: skip
def test_compute_check_runs_at_ieee_fp32_and_restores_the_scripts_setting(
    tmp_path: Path, how: str
) -> None:
    """A script that turns TF32 on (nanoGPT does; bf16 on CPUs with oneDNN: "medium") must
    not fail the compute self-test: its matmul runs at IEEE fp32 (on CPU the same code
    path), and the script's setting is what it was afterwards, through both of torch's
    precision APIs."""
    import torch

    from orchestrator.comm import Comm
    from orchestrator.health import HealthChecker, ieee_fp32
    from orchestrator.journal import Journal
    from orchestrator.policy import parse_policy

    def settings() -> dict[str, Any]:
        b = torch.backends
        out: dict[str, Any] = {"cuda.matmul": b.cuda.matmul.fp32_precision,
                               "mkldnn.matmul": b.mkldnn.matmul.fp32_precision}  # fmt: skip
        for name, get in (("legacy", torch.get_float32_matmul_precision),
                          ("cuda_tf32", lambda: b.cuda.matmul.allow_tf32)):  # fmt: skip
            try:
                out[name] = get()
            except RuntimeError:  # the script mixed the two APIs: torch will not say
                out[name] = "mixed"
        return out

    before = settings()
    try:
        if how.startswith("set_float32"):
            torch.set_float32_matmul_precision(how.rsplit("_", 1)[1])
        elif how == "cuda_allow_tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
        else:
            torch.backends.cuda.matmul.fp32_precision = "tf32"
        theirs = settings()
        assert theirs["cuda.matmul"] == "tf32"
        with ieee_fp32():  # consistent inside: cuBLAS checks the two APIs agree
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cuda.matmul.allow_tf32 is False
            assert settings()["mkldnn.matmul"] == "ieee"
        assert settings() == theirs
        policy = parse_policy({"health": {"memory_mb": 1}})
        journal = Journal(str(tmp_path), 0, 0)
        checker = HealthChecker(policy.health, Comm(), str(tmp_path))
        report = checker.run("preflight")
        checker.close()
        journal.close()
        assert report.healthy, report.to_dict()
        assert report.ranks[0]["checks"]["compute"]["max_rel_error"] < 1e-4
        assert settings() == theirs  # the script's TF32 is on again
        if how == "set_float32_matmul_precision_high":
            assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before["legacy"])
        torch.backends.cuda.matmul.fp32_precision = before["cuda.matmul"]
        torch.backends.mkldnn.matmul.fp32_precision = before["mkldnn.matmul"]


@pytest.mark.timeout(60)
def test_a_second_checker_on_the_same_store_does_not_read_the_first_ones_keys() -> None:
    """Two checkers in sequence on the same group and store (a second Guard in a process
    after the first closed), 2 ranks as threads (tests/harness.py). Both ranks ran the first
    checker's round 1; rank 1 never enters the second's round 1: rank 0 names it absent,
    instead of reading its roll call and evidence of the first checker as this round's."""
    import threading

    from harness import run_ranks

    from orchestrator.comm import Comm
    from orchestrator.health import HealthChecker, HealthReport
    from orchestrator.policy_ops import HealthPolicy

    policy = HealthPolicy(timeout_s=2.0, bandwidth_mb=0.01, memory_mb=1)
    checked = threading.Event()  # rank 0's second check is over: rank 1 may close

    def rank_main(rank: int, _: int) -> tuple[HealthReport, HealthReport | None]:
        comm = Comm()
        first = HealthChecker(policy, comm, None)
        report = first.run("first")
        first.close()
        second = HealthChecker(policy, comm, None)
        again = None
        if rank == 0:
            again = second.run("second")
            checked.set()
        else:
            assert checked.wait(30)
        second.close()
        return report, again

    (first0, second0), (first1, _) = run_ranks(rank_main, 2, timeout_s=45)
    assert first0.healthy and first1.healthy, first0.to_dict()
    assert [r["rank"] for r in first0.ranks] == [0, 1]
    assert second0 is not None
    assert [r["rank"] for r in second0.ranks] == [0]  # no stale evidence of rank 1
    assert second0.absent == {1: socket.gethostname()} and second0.silent == {}
    assert 1 in second0.bad and second0.bad[1][0].startswith("absent")
