"""The snapshot ring in shared memory by default (snapshot.shared_memory: auto): under the
supervisor where shm_dir has room, so a kill -9 resumes from memory; a shm_dir without room
(a container's 64 MiB /dev/shm) keeps it private and says why once; an explicit true with
no room fails at start; a plain run keeps it private; nothing is left in /dev/shm."""

from __future__ import annotations

import contextlib
import glob
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from inproc import events
from inproc import train as train_inproc
from test_supervisor import FAST, launch_cmd

from conftest import EXAMPLE, assert_bitwise_equal, final_states, free_port, kinds, run
from orchestrator.errors import PolicyError
from orchestrator.policy import parse_policy
from orchestrator.protocol import local_tier_key
from orchestrator.shm_room import HEADROOM_BYTES, Room, choose

pytestmark = pytest.mark.timeout(300)

MIB = 2**20
# No snapshot.shared_memory: the default. persist every 100 steps: nothing durable is as new
# as the ring, so a resume from step 20 can only come from shared memory.
DEFAULT = {
    "adjust": {"lr_factor": 1.0},
    "snapshot": {"every_steps": 10},
    "persist": {"every_steps": 100},
    "supervisor": FAST,
}


def _launched(d: Path, policy: dict[str, Any], steps: int) -> None:
    """The example GPT for ``steps`` on 2 ranks under the supervisor; it must end well and
    leave nothing of the run in /dev/shm."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(EXAMPLE),
           "--steps", str(steps), "--save-final", str(d / "final")]  # fmt: skip
    r = run(launch_cmd(d, policy, *cmd), timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    assert not glob.glob(f"/dev/shm/orchestrator-{local_tier_key(str(d))}*"), "shm left behind"


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``where`` (root only: the test skips, saying why, where
    it cannot be mounted)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size} tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_auto_is_one_choice_for_the_whole_group() -> None:
    """The choice is a function of every rank's reading (the all-gather), so ranks that
    read the free space at different moments, and every node, choose alike."""
    need = 100 * MIB
    roomy = Room("n0", need, need + HEADROOM_BYTES, True)
    assert choose("auto", [roomy, roomy]) == (True, None)
    # One rank of node n1 read less free space (another process wrote in between): the
    # whole group, node n0 included, keeps its ring private, and the tightest is named.
    tight = Room("n1", need, need + HEADROOM_BYTES - 1, True)
    assert choose("auto", [roomy, roomy, Room("n1", need, 10**12, True), tight]) == (False, tight)
    # A large ring needs a tenth of itself beside it, more than the fixed headroom.
    big = 10 * 2**30
    assert choose("auto", [Room("n0", big, big + HEADROOM_BYTES, True)])[0] is False
    assert choose("auto", [Room("n0", big, big + big // 10, True)])[0] is True
    # Without the supervisor nothing restarts from the ring or removes it after a crash.
    assert choose("auto", [Room("n0", 1, 10**12, False)]) == (False, None)
    # true and false are kept as asked (true without room fails at the memory check).
    assert choose(True, [tight]) == (True, None)
    assert choose(False, [roomy]) == (False, None)


def test_the_policy_reads_true_false_and_auto() -> None:
    assert parse_policy({}).snapshot.shared_memory == "auto"
    for said in (True, False, "auto"):
        assert parse_policy({"snapshot": {"shared_memory": said}}).snapshot.shared_memory == said
    # Buddy copies need a ring that is surely in shared memory: auto may keep it private.
    buddy = {"snapshot": {"replicate": "buddy", "shared_memory": True}}
    assert parse_policy(buddy).snapshot.replicate == "buddy"
    for mode in ("auto", False):
        with pytest.raises(PolicyError, match="shared_memory: true"):
            parse_policy({"snapshot": {"replicate": "buddy", "shared_memory": mode}})


def test_a_plain_run_keeps_its_ring_private_by_default(tmp_path: Path) -> None:
    """No supervisor: the default ring is private, and nothing says so (it is the plan)."""
    train_inproc(tmp_path / "run", {}, steps=12)
    assert {e["details"]["tier"] for e in events(tmp_path / "run", "snapshot")} == {"memory"}
    assert events(tmp_path / "run", "shm_fallback") == []
    assert not glob.glob(f"/dev/shm/orchestrator-{local_tier_key(str(tmp_path / 'run'))}*")


def test_a_kill_9_resumes_from_shared_memory_by_default(tmp_path: Path) -> None:
    """The default policy under `orchestrator launch`, rank 1 SIGKILLed at step 27: the
    ring was in /dev/shm, the next attempt resumes from its newest sealed slot (step 20,
    tier shm; no durable snapshot exists), and the job ends bit for bit as an uninterrupted
    one."""
    clean, d = tmp_path / "clean", tmp_path / "run"
    _launched(clean, DEFAULT, 30)
    _launched(d, {**DEFAULT, "faults": [{"kind": "crash", "step": 27, "rank": 1}]}, 30)
    assert {e["details"]["tier"] for e in kinds(d, "snapshot")} == {"shm"}
    assert kinds(d, "shm_fallback") == []
    assert [e["step"] for e in kinds(d, "persist")] == [30]  # the end's only
    (resume,) = kinds(d, "resume")
    assert resume["attempt"] == 1 and resume["details"]["tier"] == "shm"
    assert resume["details"]["snapshot_step"] == 20 and resume["details"]["refused"] == []
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_no_room_keeps_the_ring_private_and_says_why_once(tmp_path: Path) -> None:
    """shm_dir a real 64 MiB tmpfs (a container's /dev/shm): the ring would fit, but not
    with the headroom NCCL and data loader workers need there. The ring stays in private
    memory, rank 0 journals one shm_fallback with the sizes and what to do, and nothing is
    made in the tmpfs."""
    with _tmpfs(tmp_path / "shm", "64m") as small:
        d = tmp_path / "run"
        _launched(d, {**DEFAULT, "snapshot": {"every_steps": 10, "shm_dir": str(small)}}, 12)
        (said,) = kinds(d, "shm_fallback")
        details = said["details"]
        assert said["rank"] == 0 and said["attempt"] == 0 and details["path"] == str(small)
        assert 0 < details["need_bytes"] < details["free_bytes"] <= 64 * MIB
        assert details["need_bytes"] + details["headroom_bytes"] > details["free_bytes"]
        assert "--shm-size" in details["remedy"] and "medium: Memory" in details["remedy"]
        assert {e["details"]["tier"] for e in kinds(d, "snapshot")} == {"memory"}
        assert list(small.iterdir()) == []


def test_true_without_room_fails_at_start_naming_the_field(tmp_path: Path) -> None:
    """An explicit true is kept: with no room it fails at start (never a silent private
    ring), saying what it needs, where, and how to give it room."""
    with _tmpfs(tmp_path / "shm", "64k") as small:
        policy = {"snapshot": {"shared_memory": True, "shm_dir": str(small)}}
        said = r"snapshot\.shared_memory: true: .* in {} .*--shm-size.*shared_memory: false"
        with pytest.raises(PolicyError, match=said.format(small)):
            train_inproc(tmp_path / "run", policy, steps=2)
        assert list(small.iterdir()) == []
