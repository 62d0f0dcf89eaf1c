"""Issue 33, the ranks' side of in-place recovery (orchestrator/rejoin.py), without the agent:
this file's parent plays it (orchestrator/inplace_protocol.py's contract): it hosts the
control store and one group store per generation, starts 2 ranks of the example GPT (DDP,
gloo) with torchrun's environment, and when rank 1 dies (the policy's crash fault: SIGKILL
at step 27, generation 0 only: the fault is journaled as fired) it writes the next
generation's word and starts rank 1 alone again. Rank 0 keeps its process; the final state
is bit for bit that of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import yaml

from conftest import EXAMPLE, REPO, assert_bitwise_equal, final_states, kinds, run, train
from orchestrator.inplace_protocol import (
    ENV_CONTROL_ADDR,
    ENV_CONTROL_PORT,
    ENV_GENERATION,
    ENV_INPLACE,
    NextGeneration,
    joined_key,
    next_key,
)
from orchestrator.protocol import ENV_SHM_DIR

pytestmark = pytest.mark.timeout(300)

STEPS = ["--steps", "40"]
POLICY: dict[str, Any] = {
    "adjust": {"lr_factor": 1.0},
    "quarantine": {"enabled": False},
    "snapshot": {"every_steps": 5, "keep": 3},
    "persist": {"every_steps": 10},
}
CRASH = {"faults": [{"kind": "crash", "step": 27, "rank": 1}]}


class Parent:
    """The agent's part, as small as the protocol allows (one node, 2 ranks)."""

    def __init__(
        self,
        run_dir: Path,
        policy: dict[str, Any],
        on_death: Callable[[], None] | None = None,
        fallback: str | None = None,
    ) -> None:
        self.on_death = on_death  # runs once rank 1 died, before its replacement starts
        self.fallback = fallback  # the agent's word instead of a next generation
        self.run_dir, self.cause = run_dir, "signal"
        self.hangs = any(f["kind"] == "hang" for f in policy.get("faults", []))
        self.control = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.stores = [self._group_store()]
        run_dir.mkdir(parents=True)
        policy_file = run_dir.parent / f"{run_dir.name}-policy.yaml"
        policy_file.write_text(yaml.safe_dump(policy))
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",  # a hang's stacks, on the SIGABRT below
            "ORCHESTRATOR_RUN_DIR": str(run_dir),
            "ORCHESTRATOR_POLICY": str(policy_file),
            "MASTER_ADDR": "127.0.0.1",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            ENV_INPLACE: "1",
            ENV_CONTROL_ADDR: "127.0.0.1",
            ENV_CONTROL_PORT: str(self.control.port),
        }
        self.cmd = [sys.executable, str(EXAMPLE), *STEPS, "--save-final", str(run_dir / "final")]
        self.logs = run_dir.parent / f"{run_dir.name}-logs"
        self.logs.mkdir()

    @staticmethod
    def _group_store() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    def start(self, rank: int, gen: int) -> subprocess.Popen[bytes]:
        env = dict(self.env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        env.update({"MASTER_PORT": str(self.stores[gen].port), ENV_GENERATION: str(gen)})
        out = open(self.logs / f"rank{rank}-gen{gen}.log", "wb")
        return subprocess.Popen(self.cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def run(self, timeout_s: float = 120.0) -> tuple[dict[int, int], int]:
        """Run to the end, replacing rank 1 once. Returns exit codes and rank 0's pid."""
        procs = {r: self.start(r, 0) for r in range(2)}
        pid0, gen, deadline = procs[0].pid, 0, time.monotonic() + timeout_s
        gone: set[int] = set()
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                for p in procs.values():
                    p.send_signal(signal.SIGABRT)
                    p.wait()
                raise AssertionError(f"timed out; logs: {self.tail()}")
            if gen == 0 and self._hung(procs[1]):
                procs[1].kill()  # the agent's hang watch: the hung rank is killed alone
                procs[1].wait()
            dead = [r for r, p in procs.items() if p.poll() not in (None, 0) and r not in gone]
            if dead == [1] and gen == 0 and self.fallback is not None:
                gen, gone = -1, {1}  # the agent gives up: the survivor must raise
                word = NextGeneration(0, 0, (1,), "signal", fallback=self.fallback)
                self.control.set(next_key(0), word.encode())
            elif dead == [1] and gen == 0:
                gen = 1
                procs[1] = self._replace()
            elif dead and gen == -1:
                gone.update(dead)
            elif dead:
                for p in procs.values():
                    p.kill()
                raise AssertionError(f"ranks {dead} died; logs: {self.tail()}")
            time.sleep(0.02)
        return {r: p.returncode for r, p in procs.items()}, pid0

    def _hung(self, proc: subprocess.Popen[bytes]) -> bool:
        """Rank 1 fired a ``hang`` fault (journaled before it blocks), still alive."""
        if not self.hangs or proc.poll() is not None or not (self.run_dir / "journal").exists():
            return False
        hung = any(e["details"]["key"].startswith("hang") for e in kinds(self.run_dir, "fault"))
        self.cause = "hang" if hung else self.cause
        return hung

    def _replace(self) -> subprocess.Popen[bytes]:
        """Rank 1 died in generation 0: generation 1's store, the word, the replacement."""
        if self.on_death is not None:
            self.on_death()
        self.stores.append(self._group_store())
        word = NextGeneration(1, self.stores[1].port, (1,), self.cause, time=time.time())
        self.control.set(next_key(0), word.encode())
        return self.start(1, 1)

    def tail(self) -> str:
        return "\n".join(
            f"== {f.name}\n{f.read_text()[-2500:]}" for f in sorted(self.logs.iterdir())
        )


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("clean") / "run"
    r = train(d, 2, *STEPS, policy=POLICY)
    assert r.returncode == 0, r.stdout[-3000:]
    return d


def test_sigkill_of_rank1_heals_in_place_bit_for_bit(tmp_path: Path, clean: Path) -> None:
    d = tmp_path / "run"
    parent = Parent(d, {**POLICY, **CRASH})
    codes, pid0 = parent.run()
    assert codes == {0: 0, 1: 0}, parent.tail()
    # rank 0 never restarted: the process started first ran to the end, one run_start
    assert pid0 > 0 and [e["rank"] for e in kinds(d, "run_start")].count(0) == 1
    assert int(parent.control.add(joined_key(1), 0)) == 2
    (rec,) = kinds(d, "inplace_recovery")
    det = rec["details"]
    assert det["generation"] == 1 and det["replaced"] == [1] and det["cause"] == "signal"
    assert rec["step"] == 20
    assert det["sources"]["0"]["source"] == "ring"
    assert det["sources"]["1"]["source"] == "durable"
    t = det["times"]
    assert t["fault"] <= t["reform"] <= t["heal"] <= t["first_step"], t
    assert [e["rank"] for e in kinds(d, "fault")] == [1]
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_torn_durable_part_heals_from_the_peer(tmp_path: Path) -> None:
    """Rank 1's part of the durable snapshot of step 20 is torn when it dies, so no durable
    snapshot holds a step the survivors keep: the replacement takes the survivor's ring
    slot of step 25, checked by CRC32. Its own RNG is lost with its process (its dropout
    differs from an uninterrupted run), so the check is the replicas': every rank ends with
    the same model and optimizer state, and rank 0 kept its process."""
    d = tmp_path / "run"

    def tear() -> None:
        (part,) = (d / "snapshots" / "step_000000020" / "rank_1").glob("*.distcp")
        raw = bytearray(part.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        part.write_bytes(bytes(raw))

    parent = Parent(d, {**POLICY, **CRASH}, on_death=tear)
    codes, pid0 = parent.run()
    assert codes == {0: 0, 1: 0}, parent.tail()
    assert pid0 > 0 and [e["rank"] for e in kinds(d, "run_start")].count(0) == 1
    (rec,) = kinds(d, "inplace_recovery")
    det = rec["details"]
    assert rec["step"] == 25 and det["replaced"] == [1]
    assert det["sources"]["0"]["source"] == "ring"
    assert det["sources"]["1"]["source"] == "peer"
    s0, s1 = final_states(d)
    assert s0["step"] == s1["step"] == 40
    assert_bitwise_equal(s0["model"], s1["model"], "model")
    assert_bitwise_equal(s0["optim"], s1["optim"], "optim")


def test_lost_shm_slots_heal_from_the_durable_part(tmp_path: Path, clean: Path) -> None:
    """The ring in shared memory (the supervisor's folder, as under the agent): rank 1's
    slots are gone when it dies (memory lost with it); its replacement heals from its
    durable part instead, rank 0 in its first process, bit for bit."""
    d, shm = tmp_path / "run", tmp_path / "shm"
    lost: list[str] = []

    def lose_rank1_slots() -> None:
        for f in shm.glob("slot*/rank1*"):
            lost.append(f.name)
            f.unlink()

    parent = Parent(d, {**POLICY, **CRASH}, on_death=lose_rank1_slots)
    parent.env[ENV_SHM_DIR] = str(shm)
    codes, _ = parent.run()
    assert codes == {0: 0, 1: 0}, parent.tail()
    assert any(n.endswith(".json") for n in lost), lost  # rank 1 had sealed slots there
    (rec,) = kinds(d, "inplace_recovery")
    assert rec["step"] == 20 and rec["details"]["sources"]["1"]["source"] == "durable", rec
    assert [e["rank"] for e in kinds(d, "run_start")].count(0) == 1
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_the_agents_fallback_raises_the_collectives_error(tmp_path: Path) -> None:
    """The agent's word is a fallback (it restarts everything): the survivor raises the
    collective's own error, as without the agent; no in-place recovery is journaled."""
    d = tmp_path / "run"
    parent = Parent(d, {**POLICY, **CRASH}, fallback="a test's fallback")
    codes, _ = parent.run()
    assert codes[0] != 0 and codes[1] == -signal.SIGKILL, parent.tail()
    assert not kinds(d, "inplace_recovery")
    assert max(e["step"] for e in kinds(d, "snapshot")) <= 27  # the run ended at the fault
    assert not kinds(d, "run_end") or kinds(d, "run_end")[0]["details"]["steps"] < 40


def test_hung_rank1_killed_alone_heals_in_place_bit_for_bit(tmp_path: Path, clean: Path) -> None:
    """Rank 1 hangs inside step 27 (the survivor blocks in the check's all-reduce); the
    parent, as the agent's hang watch, kills it alone: the survivor's collective fails, and
    the recovery is the crash's, bit for bit."""
    d = tmp_path / "run"
    parent = Parent(d, {**POLICY, "faults": [{"kind": "hang", "step": 27, "rank": 1}]})
    codes, _ = parent.run()
    assert codes == {0: 0, 1: 0}, parent.tail()
    (rec,) = kinds(d, "inplace_recovery")
    assert rec["details"]["cause"] == "hang" and rec["step"] == 20
    assert rec["details"]["sources"]["1"]["source"] == "durable"
    assert [e["rank"] for e in kinds(d, "run_start")].count(0) == 1
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_under_the_node_agent_rank1_is_replaced_alone_bit_for_bit(
    tmp_path: Path, clean: Path
) -> None:
    """The whole path: `orchestrator launch --nproc-per-node 2` (the node agent), the
    example's Guard, rank 1 SIGKILLed at step 27 (generation 0 only): the agent starts
    rank 1 alone, the survivor re-forms the group in its first process, one attempt, bit
    for bit as the uninterrupted run on every rank."""
    d = tmp_path / "run"
    policy = {**POLICY, **CRASH, "supervisor": {"backoff_s": 0.2}}  # shared memory: auto
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
           "--run-dir", str(d), "--nproc-per-node", "2",
           str(EXAMPLE), *STEPS, "--save-final", str(d / "final")]  # fmt: skip
    r = run(cmd, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    (rep,) = kinds(d, "rank_replaced")
    assert (rep["details"]["rank"], rep["details"]["cause"]) == (1, "signal")
    (rec,) = kinds(d, "inplace_recovery")
    assert rec["details"]["replaced"] == [1] and rec["step"] == 25, rec  # newer than durable
    assert rec["details"]["sources"]["1"]["source"] == "shm", rec  # the dead rank's own slot
    assert [e["rank"] for e in kinds(d, "run_start")].count(0) == 1  # rank 0: one process
    assert kinds(d, "restart") == [] and len(kinds(d, "attempt_end")) == 1
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
