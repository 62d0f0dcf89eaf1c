"""The node agent's warm spare (supervisor.in_place_spares; orchestrator/agent_spare.py,
orchestrator/spare.py): a dead rank's replacement is a pre-started process that runs the
user's script unchanged, as a fresh one would. Real processes, gloo, 2 ranks under
`orchestrator launch --nproc-per-node 2`; assertions on state and journal events."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import kinds, run
from orchestrator.agent_spare import PER_RANK

pytestmark = pytest.mark.timeout(180)

FAST = {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5}
BASE = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}, "supervisor": FAST}
WORKER = Path(__file__).parent / "inplace_worker.py"


def launch(d: Path, policy: dict[str, Any], *args: str) -> dict[int, dict[str, Any]]:
    """Run the worker under the agent to its end; each rank's final record."""
    path = d.parent / f"{d.name}-policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
           "--run-dir", str(d), "--nproc-per-node", "2",
           str(WORKER), "--out", str(d / "out"), *args]  # fmt: skip
    r = run(cmd, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:]
    return {k: json.loads((d / "out" / f"rank{k}.json").read_text()) for k in (0, 1)}


def start(d: Path, rank: int, gen: int) -> dict[str, Any]:
    rec: dict[str, Any] = json.loads((d / "out" / f"start-rank{rank}-gen{gen}.json").read_text())
    return rec


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return launch(tmp_path_factory.mktemp("clean") / "run", BASE)


def test_dead_ranks_take_the_warm_spare_bit_for_bit(tmp_path: Path, clean: Any) -> None:
    """Rank 1 SIGKILLed at step 12 and, as the replacement, at step 27: both replacements
    are warm spares (the second started after the first was used), rank 0 keeps its
    process, the state is bit for bit the uninterrupted run's, and each replacement saw at
    its start what the first rank 1, a fresh process, saw: argv, sys.path[0], directory,
    environment (but for the generation's variables), __main__, handlers."""
    d = tmp_path / "run"
    got = launch(d, BASE, "--die-at", "12", "27")
    for rank in (0, 1):
        assert got[rank]["hex"] == clean[rank]["hex"], rank
    assert got[0]["pid_start"] == got[0]["pid_end"] and got[1]["gen"] == 2
    reps = kinds(d, "rank_replaced")
    assert [(e["details"]["generation"], e["details"]["spare"]) for e in reps] == [
        (1, True), (2, True)]  # fmt: skip
    assert reps[1]["details"]["pid_new"] == got[1]["pid_start"]
    fresh = start(d, 1, 0)
    for gen, rep in ((1, reps[0]), (2, reps[1])):
        warm = start(d, 1, gen)
        assert warm["pid"] == rep["details"]["pid_new"] and warm["ppid"] == fresh["ppid"]
        for key in ("argv", "path0", "cwd", "faulthandler", "main", "name", "sigint", "sigterm"):
            assert warm[key] == fresh[key], key
        same = {k: v for k, v in warm["env"].items() if k not in PER_RANK}
        assert same == {k: v for k, v in fresh["env"].items() if k not in PER_RANK}
        assert warm["env"]["ORCHESTRATOR_INPLACE_GEN"] == str(gen)
        assert warm["env"]["RANK"] == "1" and warm["env"]["MASTER_PORT"] != fresh["env"][
            "MASTER_PORT"]  # fmt: skip
    assert kinds(d, "restart") == [] and len(kinds(d, "attempt_end")) == 1


def test_a_dead_spare_falls_back_to_a_fresh_process(tmp_path: Path, clean: Any) -> None:
    d = tmp_path / "run"
    got = launch(d, BASE, "--die-at", "27", "--kill-spare")
    (rep,) = kinds(d, "rank_replaced")
    assert rep["details"]["spare"] is False and rep["details"]["pid_new"] == got[1]["pid_start"]
    assert got[0]["pid_start"] == got[0]["pid_end"]
    for rank in (0, 1):
        assert got[rank]["hex"] == clean[rank]["hex"], rank


def test_no_spares_by_policy(tmp_path: Path, clean: Any) -> None:
    """supervisor.in_place_spares: 0: the replacement is a fresh process, no spare ran."""
    d = tmp_path / "run"
    policy = {**BASE, "supervisor": {**FAST, "in_place_spares": 0}}
    got = launch(d, policy, "--die-at", "27")
    (rep,) = kinds(d, "rank_replaced")
    assert rep["details"]["spare"] is False
    for rank in (0, 1):
        assert got[rank]["hex"] == clean[rank]["hex"], rank
    assert all(start(d, r, g)["spares"] == 0 for r, g in ((0, 0), (1, 0), (1, 1)))


AGENT = """
import os, sys
from orchestrator.agent_ranks import _die_with_agent
from orchestrator.agent_spare import Spares
cmd = [sys.executable, "-u", sys.argv[1]]
spares = Spares(1, cmd, dict(os.environ))
spares.refill(_die_with_agent)
print(spares.idle[0].proc.pid, flush=True)
sys.stdin.readline()
{end}
"""


KILL_AGENT = "os.kill(os.getpid(), 9)"
EOF_ONLY = "os.close(spares.idle[0].fd); print(spares.idle[0].proc.wait(), flush=True)"


@pytest.mark.parametrize("end", [KILL_AGENT, EOF_ONLY])
def test_a_spare_runs_nothing_without_its_agent(tmp_path: Path, end: str) -> None:
    """The agent dies (SIGKILL: the kernel kills the spare) or closes the spare's pipe
    without a rank (the spare exits 0 by itself): the script never ran."""
    marker = tmp_path / "ran"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT.format(end=end), str(script)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ},
    )  # fmt: skip
    assert agent.stdout is not None and agent.stdin is not None
    pid = int(agent.stdout.readline())
    agent.stdin.write(b"\n")
    agent.stdin.close()
    agent.wait(60)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            break  # dead; its parent (gone: init reaps it) has not reaped it yet
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert not marker.exists()
    if end == KILL_AGENT:
        assert agent.returncode == -signal.SIGKILL
    else:
        assert agent.stdout.read().strip() == b"0" and agent.returncode == 0
