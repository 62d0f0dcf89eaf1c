"""`orchestrator launch --nproc-per-node N`: the node agent (orchestrator/agent.py) as the
launcher of each attempt. Real processes, gloo, 2 ranks; assertions on state (whole
tensors, every rank) and journal events."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import (
    EXAMPLE,
    assert_bitwise_equal,
    final_states,
    free_port,
    kinds,
    preempt_at,
    run,
    spawn,
    wait,
)
from orchestrator.errors import EXIT_PREEMPTED

pytestmark = pytest.mark.timeout(240)

FAST = {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5}
BASE = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}, "supervisor": FAST}
WORKER = Path(__file__).parent / "inplace_worker.py"
NO_RANK_SIDE = Path(__file__).parent / "no_rank_side.py"  # the example, in-place off inside


def launch(run_dir: Path, policy: dict[str, Any], *script: str) -> list[str]:
    path = run_dir.parent / f"{run_dir.name}-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    return [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
            "--run-dir", str(run_dir), "--nproc-per-node", "2", *script]  # fmt: skip


def test_the_agent_trains_as_torchrun_does_bit_for_bit(tmp_path: Path, clean_run: Any) -> None:
    d = tmp_path / "run"
    r = run(launch(d, BASE, str(EXAMPLE), "--steps", "30", "--save-final", str(d / "final")))
    assert r.returncode == 0, r.stdout[-3000:]
    (start,) = kinds(d, "attempt_start")
    assert start["details"]["cmd"][1:3] == ["-m", "orchestrator.agent"]
    for a, b in zip(final_states(clean_run(30)), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_a_crash_without_the_rank_side_restarts_everything_bit_for_bit(
    tmp_path: Path, clean_run: Any
) -> None:
    """Today's script (no in-place rank side): the survivor dies of its peer's death, the
    agent falls back, and the supervisor's full restart resumes from the snapshot, bit for
    bit."""
    d = tmp_path / "run"
    policy = {
        **BASE,
        "supervisor": {**FAST, "in_place_timeout_s": 30},
        "faults": [{"kind": "crash", "step": 25, "rank": 1}],
    }
    script = [str(NO_RANK_SIDE), str(EXAMPLE), "--steps", "30", "--save-final", str(d / "final")]
    r = run(launch(d, policy, *script))
    assert r.returncode == 0, r.stdout[-3000:]
    (restart,) = kinds(d, "restart")
    assert restart["details"]["cause"] == "crash" and restart["attempt"] == 0
    (resume,) = kinds(d, "resume")
    assert resume["attempt"] == 1 and resume["details"]["snapshot_step"] == 20
    assert kinds(d, "rank_replaced") == []
    (failed,) = kinds(d, "inplace_failed")  # the survivor died too: the fallback, journaled
    assert failed["attempt"] == 0 and failed["details"]["ranks"] == [1]
    for a, b in zip(final_states(clean_run(30)), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_a_survivor_that_cannot_re_form_says_why_and_every_rank_restarts(
    tmp_path: Path,
) -> None:
    """An engine that does not re-form in place (FSDP1): the survivor tells the agent why
    before it gives up, and the agent falls back at once with that reason (not "rank 0
    died", nor in_place_timeout_s later if its exit is slow); the full restart finishes."""
    d = tmp_path / "run"
    policy = {**BASE, "faults": [{"kind": "crash", "step": 12, "rank": 1}]}
    r = run(launch(d, policy, str(EXAMPLE), "--fsdp1", "--steps", "16"))
    assert r.returncode == 0, r.stdout[-3000:]
    (failed,) = kinds(d, "inplace_failed")
    reason = failed["details"]["reason"]
    assert reason.startswith("a survivor cannot re-form in place (rank 0: FSDP1"), reason
    (restart,) = kinds(d, "restart")
    assert restart["attempt"] == 0 and kinds(d, "rank_replaced") == []


def test_sigterm_preempts_through_the_agent_and_resumes(tmp_path: Path) -> None:
    d = tmp_path / "run"
    policy = {**BASE, "persist": {"every_steps": 1000}}  # only the preemption persists
    code, out = preempt_at(launch(d, policy, str(EXAMPLE), "--steps", "60"), d, 10)
    assert code == EXIT_PREEMPTED, out[-3000:]
    (pre,) = kinds(d, "preempted")
    assert pre["details"]["persisted"] is True
    r = run(launch(d, policy, str(EXAMPLE), "--steps", "60"))
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "resume")[0]["details"]["snapshot_step"] == pre["step"]
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 60


def _states(out: Path) -> dict[int, dict[str, Any]]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def clean_worker(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    d = tmp_path_factory.mktemp("clean") / "run"
    r = run(launch(d, BASE, str(WORKER), "--out", str(d / "out")), timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    return _states(d / "out")


def test_a_dead_rank_is_replaced_alone(tmp_path: Path, clean_worker: Any) -> None:
    """Rank 1 SIGKILLed at step 12: the agent starts it again alone in generation 1, rank 0
    keeps its process, and both end bit for bit as without the fault."""
    d = tmp_path / "run"
    r = run(launch(d, BASE, str(WORKER), "--out", str(d / "out"), "--die-at", "12"), timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    got = _states(d / "out")
    assert got[0]["pid_start"] == got[0]["pid_end"] and got[0]["gen"] == 1
    assert got[1]["gen"] == 1
    for rank in (0, 1):
        assert got[rank]["hex"] == clean_worker[rank]["hex"], rank
    (rep,) = kinds(d, "rank_replaced")
    det = rep["details"]
    assert (det["rank"], det["cause"], det["generation"], det["returncode"]) == (
        1, "signal", 1, -signal.SIGKILL)  # fmt: skip
    assert det["pid_new"] == got[1]["pid_start"] and det["pid_old"] != det["pid_new"]
    assert kinds(d, "restart") == [] and len(kinds(d, "attempt_end")) == 1


def test_a_replacement_slower_than_hang_timeout_s_is_no_hang(
    tmp_path: Path, clean_worker: Any
) -> None:
    """Rank 1 dies at step 12 and its replacement takes 4 s to start (imports, CUDA: 8 s
    on an H200), twice hang_timeout_s. The dead rank's last beat and the survivor waiting
    in the re-form are not a hang (the agent removes the beat; the survivor's phase is
    ``rejoin``, judged by in_place_timeout_s): in place, no restart. Under load the drill's
    crash_inplace cell restarted every rank on the dead rank's stale beat."""
    d = tmp_path / "run"
    policy = {**BASE, "supervisor": {**FAST, "hang_timeout_s": 2.0}}
    script = ["--out", str(d / "out"), "--die-at", "12", "--slow-start", "4"]
    r = run(launch(d, policy, str(WORKER), *script), timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "hang") == [] and kinds(d, "restart") == []
    (rep,) = kinds(d, "rank_replaced")
    assert rep["details"]["rank"] == 1 and rep["details"]["seconds"] >= 4.0
    got = _states(d / "out")
    assert got[0]["pid_start"] == got[0]["pid_end"]
    for rank in (0, 1):
        assert got[rank]["hex"] == clean_worker[rank]["hex"], rank


def test_a_second_death_while_healing_falls_back_to_a_full_restart(
    tmp_path: Path, clean_worker: Any
) -> None:
    d = tmp_path / "run"
    r = run(
        launch(d, BASE, str(WORKER), "--out", str(d / "out"), "--die-at", "12", "--die-again"),
        timeout=120,
    )
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "rank_replaced") == []  # the replacement never joined
    (failed,) = kinds(d, "inplace_failed")
    assert failed["details"]["ranks"] == [1] and failed["details"]["generation"] == 1
    assert "healing" in failed["details"]["reason"]
    (restart,) = kinds(d, "restart")
    assert restart["attempt"] == 0 and restart["details"]["cause"] == "crash"
    got = _states(d / "out")
    for rank in (0, 1):
        assert got[rank]["hex"] == clean_worker[rank]["hex"], rank


def two_nodes(run_dir: Path, policy: dict[str, Any], *script: str) -> None:
    """Two simulated nodes (one rank each, torch's c10d rendezvous, addresses 127.0.0.1
    and .2, as tests/test_nodes.py), each under its own supervisor, run to their end."""
    path = run_dir.parent / f"{run_dir.name}-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    port, procs = free_port(), []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
               "--run-dir", str(run_dir), "--nproc-per-node", "1", "--nnodes", "2",
               "--node-rank", str(node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_dir.name,
               "--local-addr", f"127.0.0.{node + 1}", *script]  # fmt: skip
        procs.append(spawn(cmd, {"OMP_NUM_THREADS": "1", "ORCHESTRATOR_NODE": f"n{node}"}))
    for p in procs:
        r = wait(p, 200)
        assert r.returncode == 0, r.stdout[-3000:]


@pytest.mark.matrix  # the node-1 in-place test covers the agents' c10d rendezvous
def test_two_nodes_through_c10d_restart_both_after_a_crash_bit_for_bit(
    tmp_path: Path, clean_run: Any
) -> None:
    """A script without the ranks' side on two nodes: node 1's crash restarts both."""
    d = tmp_path / "run"
    policy = {**BASE, "faults": [{"kind": "crash", "step": 25, "rank": 1}]}
    two_nodes(d, policy, str(EXAMPLE), "--steps", "30", "--save-final", str(d / "final"))
    starts = sorted((e["details"]["node"], e["attempt"]) for e in kinds(d, "attempt_start"))
    assert starts == [("n0", 0), ("n0", 1), ("n1", 0), ("n1", 1)]
    assert {e["attempt"] for e in kinds(d, "resume")} == {1}
    assert kinds(d, "rank_replaced") == []
    for a, b in zip(final_states(clean_run(30)), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_two_nodes_node_1s_dead_rank_is_replaced_and_node_0s_rank_stays(
    tmp_path: Path, clean_worker: Any
) -> None:
    """Node 1's agent asks node 0's (which hosts the stores) for the next generation and
    replaces its rank alone; node 0's rank keeps its process; bit for bit."""
    d = tmp_path / "run"
    two_nodes(d, BASE, str(WORKER), "--out", str(d / "out"), "--die-at", "12")
    got = _states(d / "out")
    assert got[0]["pid_start"] == got[0]["pid_end"] and got[0]["gen"] == 1
    for rank in (0, 1):
        assert got[rank]["hex"] == clean_worker[rank]["hex"], rank
    (rep,) = kinds(d, "rank_replaced")
    assert (rep["details"]["rank"], rep["details"]["generation"]) == (1, 1)
    assert kinds(d, "restart") == []


def test_deaths_beyond_in_place_max_per_attempt_restart_everything(
    tmp_path: Path, clean_worker: Any
) -> None:
    """A rank that dies again after its replacement (a crash that follows the data) meets
    the supervisor's rules: past supervisor.in_place_max_per_attempt, a full restart."""
    d = tmp_path / "run"
    policy = {**BASE, "supervisor": {**FAST, "in_place_max_per_attempt": 1}}
    r = run(launch(d, policy, str(WORKER), "--out", str(d / "out"), "--die-at", "8", "16"))
    assert r.returncode == 0, r.stdout[-3000:]
    (rep,) = kinds(d, "rank_replaced")
    assert rep["details"]["generation"] == 1 and rep["attempt"] == 0
    (failed,) = kinds(d, "inplace_failed")
    assert "in_place_max_per_attempt" in failed["details"]["reason"]
    (restart,) = kinds(d, "restart")
    assert restart["attempt"] == 0 and restart["details"]["cause"] == "crash"
    got = _states(d / "out")
    for rank in (0, 1):
        assert got[rank]["hex"] == clean_worker[rank]["hex"], rank


def test_a_hung_rank_is_killed_and_replaced_alone(tmp_path: Path, clean_worker: Any) -> None:
    """Rank 1 stops making progress at step 12: the supervisor's hang watch names it, kills
    it alone, and the agent replaces it (cause: hang); rank 0 keeps its process. The
    replacement takes longer to start than hang_timeout_s (the survivors make no progress
    meanwhile): the watch gives the recovery in_place_timeout_s before it judges again (the
    drill's hang_inplace cell restarted every rank when it did not, under load)."""
    d = tmp_path / "run"
    policy = {**BASE, "supervisor": {**FAST, "hang_timeout_s": 2.0}}
    script = ["--out", str(d / "out"), "--hang-at", "12", "--slow-start", "4"]
    r = run(launch(d, policy, str(WORKER), *script))
    assert r.returncode == 0, r.stdout[-3000:]
    (hang,) = kinds(d, "hang")
    assert [c["rank"] for c in hang["details"]["culprits"]] == [1]
    (rep,) = kinds(d, "rank_replaced")
    assert (rep["details"]["rank"], rep["details"]["cause"]) == (1, "hang")
    assert rep["time"] >= hang["time"]
    got = _states(d / "out")
    assert got[0]["pid_start"] == got[0]["pid_end"]
    for rank in (0, 1):
        assert got[rank]["hex"] == clean_worker[rank]["hex"], rank
    assert kinds(d, "restart") == [] and len(kinds(d, "attempt_end")) == 1


def test_in_place_off_by_policy_restarts_every_rank(tmp_path: Path, clean_worker: Any) -> None:
    """supervisor.in_place: false: the agent stops every rank at the first death, as
    torchrun, and the ranks see no in-place variables."""
    d = tmp_path / "run"
    policy = {**BASE, "supervisor": {**FAST, "in_place": False}}
    r = run(launch(d, policy, str(WORKER), "--out", str(d / "out"), "--die-at", "12"))
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "rank_replaced") == []
    (restart,) = kinds(d, "restart")
    assert restart["attempt"] == 0 and restart["details"]["cause"] == "crash"
    got = _states(d / "out")
    assert got[0]["inplace"] is None
    for rank in (0, 1):
        assert got[rank]["hex"] == clean_worker[rank]["hex"], rank
