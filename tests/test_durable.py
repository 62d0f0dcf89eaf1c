"""Durable snapshots: crash and resume, storage errors, corrupt snapshots, resharding, S3.

Multi-rank runs use the example under torchrun (gloo, CPU); the final state is compared bit
for bit with an uninterrupted run, and decisions are read from the journal.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from inproc import events
from inproc import train as train_inproc

from conftest import REPO, assert_bitwise_equal, final_states, kinds, train
from orchestrator.store import DurableStore

pytestmark = pytest.mark.timeout(300)

STEPS = ["--steps", "60"]
PERSIST = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10, "keep": 3}}


@pytest.fixture(scope="module")
def uninterrupted(clean_run: Callable[[int], Path]) -> Path:
    return clean_run(60)  # PERSIST's keep does not change what is trained


# covered by default: tests/test_durable_faults.py (kills, the same command resumes bit
# for bit) and the truncated-snapshot test below
@pytest.mark.matrix
def test_crash_then_same_command_resumes_bit_for_bit(tmp_path: Path, uninterrupted: Path) -> None:
    d = tmp_path / "run"
    policy = {**PERSIST, "faults": [{"kind": "crash", "step": 50, "rank": 0}]}
    first = train(d, 2, *STEPS, policy=policy)
    assert first.returncode != 0
    assert [e["step"] for e in kinds(d, "fault")] == [50]
    assert not kinds(d, "run_end")
    second = train(d, 2, *STEPS, policy=policy)  # the same command again
    assert second.returncode == 0, second.stdout[-3000:]
    (resume,) = kinds(d, "resume")
    assert resume["details"]["snapshot_step"] in (30, 40)  # 40 unless its write was cut short
    assert resume["attempt"] == 0 and kinds(d, "run_end")[0]["details"]["steps"] == 60
    for a, b in zip(final_states(uninterrupted), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_truncated_newest_snapshot_is_rejected_and_older_used(
    tmp_path: Path, uninterrupted: Path
) -> None:
    d = tmp_path / "run"
    policy = {
        **PERSIST,
        "faults": [
            {"kind": "truncate_snapshot", "step": 40},
            {"kind": "crash", "step": 47, "rank": 1},
        ],
    }
    assert train(d, 2, *STEPS, policy=policy).returncode != 0
    assert 40 in DurableStore(str(d / "snapshots")).committed_steps()
    r = train(d, 2, *STEPS, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]
    (bad,) = kinds(d, "snapshot_invalid")
    assert bad["details"]["snapshot_step"] == 40
    assert any("truncated" in why for why in bad["details"]["reasons"])
    (resume,) = kinds(d, "resume")
    assert resume["details"]["snapshot_step"] == 30
    for a, b in zip(final_states(uninterrupted), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
    listing = subprocess.run(
        [sys.executable, "-m", "launch.cli", "snapshots", str(d)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listing.returncode == 0
    rows = {int(line.split()[0]): line for line in listing.stdout.splitlines()[2:]}
    assert rows[60].endswith("valid") and "INVALID" not in rows[60]


def test_two_rank_snapshot_resumes_at_one_rank(tmp_path: Path) -> None:
    d = tmp_path / "run"
    r = train(d, 2, "--steps", "40", policy=PERSIST)
    assert r.returncode == 0, r.stdout[-3000:]
    two = final_states(d)
    assert DurableStore(str(d / "snapshots")).committed_steps()[0] == 40  # the final state
    (d / "final").rename(d / "final-2ranks")
    r = train(d, 1, "--steps", "40", policy=PERSIST)
    assert r.returncode == 0, r.stdout[-3000:]
    (resume,) = kinds(d, "resume")
    details = resume["details"]
    assert (details["snapshot_step"], details["saved_world_size"], details["world_size"]) == (
        40, 2, 1,
    )  # fmt: skip
    assert details["offset"] == 640  # 40 steps x 16 samples: the same at any world size
    (one,) = final_states(d)
    assert_bitwise_equal(two[0]["model"], one["model"], "model")
    assert_bitwise_equal(two[0]["optim"], one["optim"], "optim")
    r = train(d, 1, "--steps", "50", policy=PERSIST)  # and it trains on from there
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "run_end")[-1]["details"]["steps"] == 50


def test_transient_storage_errors_are_retried(tmp_path: Path) -> None:
    policy = {
        "persist": {"every_steps": 10, "retry_max_wait_s": 0.05},
        "faults": [{"kind": "storage_error", "op": "write", "times": 3}],
    }
    train_inproc(tmp_path, policy, steps=25)
    retries = events(tmp_path, "persist_retry")
    assert [(e["step"], e["details"]["attempt"]) for e in retries] == [(10, 1), (10, 2), (10, 3)]
    persisted = [e["step"] for e in events(tmp_path, "persist")]
    skipped = [e["step"] for e in events(tmp_path, "persist_skipped")]
    assert persisted[0] == 10 and persisted[-1] == 25  # 10 committed after its retries
    assert sorted(persisted + skipped) == [10, 20, 25]  # 20 may come while 10 still retries
    assert not events(tmp_path, "persist_failed")


def test_permanent_storage_errors_are_journaled_and_training_goes_on(tmp_path: Path) -> None:
    policy = {
        "persist": {"every_steps": 10, "retries": 2, "retry_max_wait_s": 0.05},
        "faults": [{"kind": "storage_error", "op": "write", "times": 1000}],
    }
    guard, _, _ = train_inproc(tmp_path, policy, steps=25)
    assert guard.global_step == 25
    failed = [e["step"] for e in events(tmp_path, "persist_failed")]
    skipped = [e["step"] for e in events(tmp_path, "persist_skipped")]
    assert failed[0] == 10 and sorted(failed + skipped) == [10, 20, 25]
    assert DurableStore(str(tmp_path / "snapshots")).committed_steps() == []


def test_required_persist_stops_training(tmp_path: Path) -> None:
    from orchestrator.errors import PersistError

    policy = {
        "persist": {"every_steps": 10, "retries": 1, "required": True},
        "faults": [{"kind": "storage_error", "op": "write", "times": 1000}],
    }
    with pytest.raises(PersistError, match=r"persist\.required is true"):
        train_inproc(tmp_path, policy, steps=200)


def test_retention_keeps_the_newest_and_every_nth(tmp_path: Path) -> None:
    policy = {"persist": {"every_steps": 10, "keep": 2, "keep_every_steps": 20}}
    train_inproc(tmp_path, policy, steps=55)
    store = DurableStore(str(tmp_path / "snapshots"))
    # Tiny steps outrun the writer, so some snapshots are skipped; retention acts on the rest.
    persisted = sorted((e["step"] for e in events(tmp_path, "persist")), reverse=True)
    assert persisted[0] == 55
    expected = sorted(set(persisted[:2]) | {s for s in persisted if s % 20 == 0}, reverse=True)
    assert store.committed_steps() == expected


def test_tampered_metadata_is_rejected_before_unpickling(tmp_path: Path) -> None:
    train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=20)
    store = DurableStore(str(tmp_path / "snapshots"))
    meta = tmp_path / "snapshots" / "step_000000020" / "rank_0" / ".metadata"
    evil = b"cos\nsystem\n(S'echo pwned > " + str(tmp_path).encode() + b"/pwned'\ntR."
    meta.write_bytes(evil.ljust(meta.stat().st_size, b" "))  # same size: only sha256 can tell
    (cand,) = [c for c in store.candidates() if c.step == 20]
    assert "sha256" in (store.check(cand) or "")
    train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=20)
    assert not (tmp_path / "pwned").exists()
    (bad,) = events(tmp_path, "snapshot_invalid")
    assert bad["details"]["snapshot_step"] == 20
    assert events(tmp_path, "resume")[0]["details"]["snapshot_step"] == 10


def test_s3_store_with_a_real_server(tmp_path: Path, s3_url: str) -> None:
    policy = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10, "url": s3_url}}
    d = tmp_path / "run"
    r = train(d, 2, "--steps", "20", policy=policy, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    store = DurableStore(s3_url)
    assert store.committed_steps() == [20, 10]
    assert all(store.check(c) is None for c in store.candidates())
    r = train(d, 1, "--steps", "25", policy=policy, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "resume")[0]["details"]["snapshot_step"] == 20


def test_slow_writer_on_one_rank_keeps_ranks_in_agreement(
    tmp_path: Path, uninterrupted: Path
) -> None:
    """Rank 0's writer lags (slow storage) while snapshots, persists and a rollback happen:
    the ranks must still skip, hold and roll back alike (else DDP diverges or hangs)."""
    policy = {
        **PERSIST,
        "persist": {"every_steps": 10, "keep": 3},
        "snapshot": {"every_steps": 5, "keep": 2},
        "faults": [
            {"kind": "slow_storage", "op": "write", "seconds": 2.0, "rank": 0},
            {"kind": "nan_grad", "step": 37, "rank": 1},
        ],
    }
    d = tmp_path / "run"
    r = train(d, 2, *STEPS, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "persist_skipped") or kinds(d, "snapshot_skipped")  # the lag was felt
    assert len(kinds(d, "rollback")) == 1
    for a, b in zip(final_states(uninterrupted), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_rollback_invalidates_newer_durable_snapshots(tmp_path: Path) -> None:
    """A snapshot persisted after the rollback target must never be resumed from."""
    exact = {"adjust": {"lr_factor": 1.0}, "quarantine": {"enabled": False}}
    policy = {
        **exact,
        "snapshot": {"every_steps": 2, "keep": 4, "min_age_steps": 4},
        "persist": {"every_steps": 2, "keep": 10},
        "faults": [{"kind": "nan_grad", "step": 13}],
    }
    _, clean, _ = train_inproc(tmp_path / "clean", policy, steps=20)
    d = tmp_path / "run"
    train_inproc(d, policy, steps=16)
    (rb,) = events(d, "rollback")
    target = rb["details"]["to_step"]
    assert target <= 9
    # Whatever was committed past the target before the rollback is withdrawn (how much
    # was committed depends on how fast the writer kept up with these tiny steps).
    before = [e["step"] for e in events(d, "persist") if e["time"] < rb["time"]]
    gone = [s for e in events(d, "persist_invalidate") for s in e["details"]["uncommitted_steps"]]
    assert {s for s in before if s > target} <= set(gone)
    assert all(s > target for s in gone)
    # Started again: resumes from the replayed timeline's snapshot and matches the clean run.
    _, state, _ = train_inproc(d, policy, steps=20)
    assert events(d, "resume")[0]["details"]["snapshot_step"] == 16
    assert_bitwise_equal(clean, state)


def test_no_valid_snapshot_stops_instead_of_starting_over(tmp_path: Path) -> None:
    from orchestrator.errors import PersistError

    train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=20)
    for f in (tmp_path / "snapshots").glob("step_*/rank_0/*.distcp"):
        f.write_bytes(f.read_bytes()[:10])
    with pytest.raises(PersistError, match=r"none valid.*persist\.resume: false"):
        train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=30)


def test_node_local_tier_is_preferred_on_restart(tmp_path: Path, uninterrupted: Path) -> None:
    local = tmp_path / "shm"
    policy = {
        **PERSIST,
        "persist": {"every_steps": 10, "keep": 3, "local_dir": str(local)},
        "faults": [{"kind": "crash", "step": 45, "rank": 1}],
    }
    d = tmp_path / "run"
    assert train(d, 2, *STEPS, policy=policy).returncode != 0
    assert kinds(d, "persist_local")
    r = train(d, 2, *STEPS, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]
    (resume,) = kinds(d, "resume")
    assert resume["details"]["tier"] == "local" and resume["details"]["snapshot_step"] in (30, 40)
    for a, b in zip(final_states(uninterrupted), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
    # A restart on a fresh node (empty local dir) uses the remote store.
    for p in local.rglob("COMMITTED"):
        p.unlink()
    r = train(d, 2, "--steps", "70", policy=policy, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    assert kinds(d, "resume")[-1]["details"]["tier"] == "remote"
