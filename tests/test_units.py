"""Unit tests of the parts: sampler, snapshot ring, adjuster, bisection, ledger, journal."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from inproc import events, train

from orchestrator.adjust import LRAdjuster
from orchestrator.data import GuardBatchSampler
from orchestrator.detect import SpikeDetector
from orchestrator.errors import OrchestratorError, PolicyError
from orchestrator.isolate import Bisection
from orchestrator.journal import Journal, read_journal
from orchestrator.policy import AdjustPolicy, SpikePolicy
from orchestrator.quarantine import Ledger
from orchestrator.snapshot import SnapshotRing

pytestmark = pytest.mark.timeout(60)


# --- sampler ------------------------------------------------------------------------------
def test_sampler_shards_are_disjoint_and_deterministic() -> None:
    s0 = GuardBatchSampler(100, 4, rank=0, world_size=2, seed=3)
    s1 = GuardBatchSampler(100, 4, rank=1, world_size=2, seed=3)
    assert s0.remaining_batches(0, 0) == 12  # 100 // 8, last partial global batch dropped
    offset = 0
    for _ in range(12):
        (a, nxt), (b, nxt1) = s0.batch_at(0, offset), s1.batch_at(0, offset)
        assert len(a) == len(b) == 4 and not set(a) & set(b) and nxt == nxt1 == offset + 8
        assert a + b == s0.global_batch_at(0, offset)
        offset = nxt
    assert list(s0) == list(GuardBatchSampler(100, 4, rank=0, world_size=2, seed=3))
    assert s0.global_batch_at(0, 0) != s0.global_batch_at(1, 0)  # reshuffled per epoch


def test_quarantine_after_the_position_shifts_only_later_samples() -> None:
    s = GuardBatchSampler(64, 4, rank=0, world_size=1, seed=0)
    before = list(s)
    victim = before[9][2]
    s.quarantine([victim])
    after = list(s)
    assert after[:9] == before[:9]  # what ran before step 9 is unchanged
    assert all(victim not in ids for ids in after)
    assert s.quarantined == {victim}


def test_quarantine_before_the_position_does_not_move_it() -> None:
    s = GuardBatchSampler(64, 4, rank=0, world_size=1, seed=0)
    full = list(s)
    _, offset = s.batch_at(0, 0)
    for _ in range(4):
        _, offset = s.batch_at(0, offset)  # 5 batches consumed
    s.quarantine(full[1] + full[2])  # ids already trained on (a window quarantine)
    s.set_position(0, offset)
    assert list(s)[:5] == full[5:10]  # nothing skipped, nothing repeated


def test_position_is_world_size_independent() -> None:
    two = GuardBatchSampler(64, 4, rank=0, world_size=2, seed=5)
    one = GuardBatchSampler(64, 4, rank=0, world_size=1, seed=5)
    _, off = two.batch_at(0, 0)
    _, off = two.batch_at(0, off)  # 2 steps at 2 ranks = 16 samples
    assert off == 16
    assert one.global_batch_at(0, off) == two.global_batch_at(0, off)[:4]


def test_sampler_resumes_from_position() -> None:
    s = GuardBatchSampler(40, 2, rank=0, world_size=1, seed=1)
    full = list(s)
    s.set_position(0, 14)
    assert list(s) == full[7:]


def test_sampler_rejects_dataset_smaller_than_a_global_batch() -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GuardBatchSampler(5, 4, rank=0, world_size=2)


# --- snapshot ring ------------------------------------------------------------------------
def _state(v: float) -> dict:
    return {"w": torch.full((3,), v), "n": {"k": [torch.tensor(int(v))]}, "meta": {"lr": v}}


def test_ring_copies_reuses_buffers_and_never_evicts_newest_sealed() -> None:
    ring = SnapshotRing(keep=2)
    s0 = ring.capture(0, _state(0.0))
    s0.sealed = True
    live = _state(1.0)
    s10 = ring.capture(10, live)
    live["w"].fill_(99.0)  # mutating the source must not touch the snapshot
    assert s10.materialize("w", clone=False).tolist() == [1.0, 1.0, 1.0]
    assert s10.materialize("meta", clone=False) == {"lr": 1.0}
    # s10 is unsealed, s0 is the newest sealed: the next capture must evict s10, not s0.
    bufs = s10.buffers
    s20 = ring.capture(20, _state(2.0))
    assert [s.step for s in ring.snapshots()] == [0, 20]
    assert s20.buffers[0] is bufs[0]  # same shape: the host buffer is reused
    ring.seal_through(20, 1)
    assert ring.pick(25, 0) == (s20, True)
    assert ring.pick(25, 10) == (s0, True)
    assert ring.pick(5, 10) == (s0, False)  # none old enough: oldest sealed, flagged
    ring.drop_after(0)
    assert [s.step for s in ring.snapshots()] == [0]


def test_restored_optimizer_state_does_not_alias_the_snapshot() -> None:
    from orchestrator.engines import TorchEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    eng = TorchEngine(model, opt)
    model(torch.randn(8, 4)).sum().backward()
    eng.commit(1.0)
    ring = SnapshotRing(keep=2)
    snap = ring.capture(1, eng.state())
    copy = [b.clone() for b in snap.buffers]
    eng.restore(snap, 1.0)
    for _ in range(3):
        model(torch.randn(8, 4)).sum().backward()
        eng.commit(1.0)
    assert all(torch.equal(a, b) for a, b in zip(copy, snap.buffers, strict=True))


# --- adjuster -----------------------------------------------------------------------------
def test_adjuster_cut_hold_ramp_and_compounding() -> None:
    adj = LRAdjuster(AdjustPolicy(lr_factor=0.5, hold_steps=2, rewarm_steps=4, min_lr_factor=0.2))
    assert adj.multiplier() == 1.0
    assert adj.on_incident() == 0.5
    phases = []
    mults = []
    for _ in range(6):
        mults.append(adj.multiplier())
        phases.append(adj.on_commit())
    assert mults == [0.5, 0.5, 0.5, 0.625, 0.75, 0.875]
    assert phases == [None, "rewarm_start", None, None, None, "restored"]
    assert adj.multiplier() == 1.0
    adj.on_incident()
    assert adj.on_incident() == 0.25 and adj.on_incident() == 0.2  # compounds, floored
    assert LRAdjuster(AdjustPolicy(lr_factor=1.0)).on_incident() == 1.0


# --- bisection ----------------------------------------------------------------------------
def _bisect(suspects: list[int], bad: set[int], together: bool = False) -> tuple[list[int], int]:
    b = Bisection(suspects, filler=suspects[:1])
    runs = 0
    while True:
        group = b.next_group()
        hit = bad <= set(group) if together else bool(bad & set(group))
        b.record(hit)
        runs += 1
        if not b.pending:
            return sorted(b.culprits), runs


def test_bisection_finds_culprits() -> None:
    assert _bisect(list(range(8)), {5}) == ([5], 7)
    assert _bisect(list(range(8)), {1, 6})[0] == [1, 6]
    assert _bisect(list(range(8)), set()) == ([], 1)  # did not reproduce
    # Two samples that fail only together: the smallest failing group is quarantined.
    assert _bisect(list(range(8)), {2, 5}, together=True)[0] == list(range(8))


def test_bisection_stops_once_more_culprits_than_its_cap_are_certain() -> None:
    """Every sample bad (an LR blow-up): not bisected down to each of them."""
    b = Bisection(list(range(16)), filler=[0], cap=4)
    runs = 0
    while b.pending:
        b.next_group()
        b.record(True)
        runs += 1
    # The whole, 2 halves, 4 quarters (4 certain), 2 eighths (5 > 4): 9 re-runs, not 31.
    assert b.exceeded and runs == 9
    few = Bisection(list(range(16)), filler=[0], cap=4)
    while few.pending:
        few.record(5 in few.next_group())
    assert few.culprits == [5] and not few.exceeded


# --- spikes -------------------------------------------------------------------------------
def test_spike_detector_robust_zscore() -> None:
    det = SpikeDetector(SpikePolicy(enabled=True, window=16, min_history=8, zscore=6.0))
    for i in range(10):
        assert det.check({"loss": 2.0 + 0.01 * (i % 3), "grad_norm": 1.0}) is None
    hit = det.check({"loss": 5.0, "grad_norm": 1.0})
    assert hit is not None and hit.metric == "loss" and hit.z(5.0) > 6.0
    assert det.check({"loss": 2.01, "grad_norm": 1.0}) is None
    # No decision before min_history values.
    assert SpikeDetector(SpikePolicy()).check({"loss": 1e9, "grad_norm": 0.0}) is None
    assert (
        SpikeDetector(SpikePolicy(enabled=False, min_history=4)).check(
            {"loss": 1e9, "grad_norm": 0.0}
        )
        is None
    )


def test_a_falling_loss_is_not_noise_and_a_spike_on_it_is_caught() -> None:
    """Fast early training: a window's spread around its median would take the trend for
    noise (and miss this spike); step-to-step changes do not."""
    det = SpikeDetector(SpikePolicy(window=100, min_history=20))
    g = torch.Generator().manual_seed(0)
    noise = 0.02 * torch.randn(100, generator=g)
    for i in range(100):
        assert det.check({"loss": 4.0 - 0.03 * i + float(noise[i]), "grad_norm": 1.0}) is None
    hit = det.check({"loss": 1.4, "grad_norm": 1.0})  # the trend is at about 1.0 here
    assert hit is not None and 0.9 < hit.reference < 1.2
    # A sub-batch's mean is noisier: the bar widens as 1 / sqrt(its share of the step).
    assert hit.exceeded(1.4, 1.0) and not hit.exceeded(1.4, 1 / 64)
    # A rollback takes the undone steps' values back: their replay is compared with the
    # history before them, not with the trend projected past them.
    steep = SpikeDetector(SpikePolicy(window=100, min_history=20))
    series = [4.0 - 0.05 * i + 0.002 * (i % 3) for i in range(30)]
    for i, x in enumerate(series):
        assert steep.check({"loss": x, "grad_norm": 1.0}, step=i) is None
    assert steep.check({"loss": series[20], "grad_norm": 1.0}, step=30) is not None
    steep.rewind(20)
    assert steep.check({"loss": series[20], "grad_norm": 1.0}, step=20) is None
    # A constant history has no noise; a rounding error is still no spike.
    flat = SpikeDetector(SpikePolicy(window=16, min_history=8))
    for _ in range(16):
        flat.check({"loss": 2.0, "grad_norm": 1.0})
    assert flat.check({"loss": 2.0 + 1e-6, "grad_norm": 1.0}) is None


# --- ledger and journal -------------------------------------------------------------------
def test_ledger_roundtrip_over_fsspec_memory() -> None:
    led = Ledger("memory://ledger-test/q/quarantine.jsonl")
    assert led.load() == set()
    led.add([5, 3], step=10, reason="nonfinite_loss")
    led.add([7], step=12, reason="spike_loss")
    assert Ledger(led.url).load() == {3, 5, 7}


def test_ledger_bad_line_names_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "quarantine.jsonl"
    f.write_text(json.dumps({"sample": 1}) + "\n" + '{"oops": 2}\n')
    with pytest.raises(OrchestratorError, match=r"line 2"):
        Ledger(str(f)).load()


def test_journal_skips_torn_last_line(tmp_path: Path) -> None:
    j = Journal(str(tmp_path), rank=0, attempt=2)
    j.write("incident", 5, {"reason": "x"})
    j.close()
    with open(j.path, "a") as f:
        f.write('{"kind": "rollb')  # a crash mid-write
    (e,) = list(read_journal(str(tmp_path)))
    assert (e["kind"], e["step"], e["attempt"], e["details"]) == ("incident", 5, 2, {"reason": "x"})


EXIT_CHECK = """
import logging, os, sys, torch.distributed as dist
from orchestrator import exit_process
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"],
                        rank=0, world_size=1)
dist.all_reduce(__import__("torch").ones(4))
logging.basicConfig(stream=sys.stderr)
logging.getLogger("t").warning("logged")
print("unflushed", end="")
exit_process(7)
print("never")
"""


def test_exit_process_flushes_and_keeps_the_code() -> None:
    """The end of a distributed script: the group is destroyed, buffered output and logs
    are flushed, and the code is the one given (os._exit skips the interpreter teardown)."""
    from conftest import free_port, run

    r = run([sys.executable, "-c", EXIT_CHECK], env={"PORT": str(free_port())}, timeout=50)
    assert r.returncode == 7, r.stdout
    assert "unflushed" in r.stdout and "logged" in r.stdout and "never" not in r.stdout


END_GROUPS_CHECK = """
import os, sys, torch, torch.distributed as dist
from orchestrator.comm import end_process_groups, exit_process, note_error
def start():
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"],
                            rank=0, world_size=1)
    dist.all_reduce(torch.ones(4), group=dist.new_group([0]))  # a group of its own too
start()
print("clean", end_process_groups(), dist.is_initialized(), flush=True)
os.environ["PORT"] = os.environ["PORT2"]
start()
note_error()  # e.g. a health check failed: a peer may be blocked in a collective
print("error", end_process_groups(), dist.is_initialized(), flush=True)
print("again", end_process_groups(), flush=True)
os.environ["PORT"] = os.environ["PORT3"]
start()
exit_process(3)  # an error code: aborted, and the code kept
"""


def test_process_groups_are_aborted_not_destroyed_after_an_error() -> None:
    """Destroying an NCCL group at exit can wait for peers blocked in a collective; after an
    error (note_error, an uncaught exception, a non-zero exit_process code) every group is
    aborted instead. The same path on gloo: the groups are gone and the process ends with
    its code."""
    from conftest import free_port, run

    ports = {"PORT": str(free_port()), "PORT2": str(free_port()), "PORT3": str(free_port())}
    r = run([sys.executable, "-c", END_GROUPS_CHECK], env=ports, timeout=50)
    assert r.returncode == 3, r.stdout
    lines = [line.split() for line in r.stdout.splitlines() if line.split()[:1] in (
        ["clean"], ["error"], ["again"])]  # fmt: skip
    assert lines == [["clean", "destroyed", "False"], ["error", "aborted", "False"],
                     ["again", "none"]]  # fmt: skip


def test_hang_suspects_are_the_ranks_behind() -> None:
    from orchestrator.heartbeat import suspects

    def beat(rank: int, step: int, phase: str) -> dict[str, object]:
        return {"rank": rank, "step": step, "phase": phase}

    # One rank still in backward while the rest wait in the check: that rank.
    assert suspects([beat(0, 30, "check"), beat(1, 30, "backward"), beat(2, 30, "check")]) == [1]
    # An earlier step is behind any phase of a later one.
    assert suspects([beat(0, 31, "train"), beat(1, 30, "check")]) == [1]
    # All at the same place, or a rank outside the step phases: the beats cannot tell.
    assert suspects([beat(0, 30, "check"), beat(1, 30, "check")]) == []
    assert suspects([beat(0, 30, "check"), beat(1, 30, "recovered")]) == []
    assert suspects([]) == []


def test_hang_culprits_come_from_the_heartbeat_phases_on_nccl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On NCCL the ranks waiting for a hung peer sit in the Guard's host sync (check.py's
    ``.tolist()``), outside any torch.distributed frame, so stacks alone name nobody. Real
    heartbeat files say rank 1 is still in backward of step 30 while ranks 0 and 2 are in the
    check: rank 1 is the culprit, by phase, with its innermost frame as the evidence."""
    from launch.hangs import culprit_words, name_culprits
    from orchestrator.heartbeat import Heartbeat, read_heartbeats

    monkeypatch.delenv("ORCHESTRATOR_SUPERVISOR_PID", raising=False)  # no stack signal here
    hbs = [Heartbeat(str(tmp_path), r, 0, interval_s=0.02) for r in range(3)]
    for r, hb in enumerate(hbs):
        hb.beat(30)  # the commit of step 29 (training thread), then the step's phases
        hb.enter("backward")
        if r != 1:
            hb.enter("check")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        beats = read_heartbeats(str(tmp_path))
        if [b["phase"] for b in beats] == ["check", "backward", "check"]:
            break
        time.sleep(0.02)
    for hb in hbs:
        hb.close()
    assert [b["phase"] for b in beats] == ["check", "backward", "check"]
    waiting = ['File "/site/orchestrator/check.py", line 88 in run',
               'File "/site/orchestrator/guard.py", line 410 in step',
               'File "train.py", line 60 in main']  # fmt: skip
    stacks = {
        0: waiting,
        1: ['File "train.py", line 41 in forward', 'File "train.py", line 58 in main'],
        2: waiting,
    }
    (culprit,) = name_culprits(beats, stacks, {0: "S", 1: "R", 2: "S"})
    assert (culprit["rank"], culprit["by"], culprit["step"], culprit["phase"]) == (
        1, "phase", 30, "backward",
    )  # fmt: skip
    assert culprit["frame"] == stacks[1][0] and culprit["answered"] and culprit["state"] == "R"
    assert "rank 1" in culprit_words(culprit)
    # A rank that gave no stack is named by its phase all the same, without a frame.
    (silent,) = name_culprits(beats, {0: waiting, 2: waiting}, {1: "T"})
    assert (silent["rank"], silent["answered"], silent["state"]) == (1, False, "T")
    assert silent["pid"] == beats[1]["pid"]
    # Where the phases cannot tell (everyone in the check), the stacks decide: the Guard's
    # check counts as waiting, so a rank stuck elsewhere is still named.
    same = [{**b, "phase": "check"} for b in beats]
    (fallback,) = name_culprits(same, stacks)
    assert (fallback["rank"], fallback["by"]) == (1, "stacks")
    assert name_culprits(same, {0: waiting, 1: waiting, 2: waiting}) == []


class _Counting(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """0, 1, 2, ... as {"id": i}; with ``stateful`` it resumes from its own state."""

    def __init__(self, n: int, stateful: bool) -> None:
        self.n, self.at = n, 0
        if stateful:
            self.state_dict = lambda: {"at": self.at}  # type: ignore[method-assign]
            self.load_state_dict = lambda s: setattr(self, "at", s["at"])  # type: ignore[method-assign]

    def __iter__(self):  # type: ignore[no-untyped-def]
        start = self.at if hasattr(self, "state_dict") else 0
        for i in range(start, self.n):
            self.at = i + 1
            yield {"id": i}


@pytest.mark.parametrize("stateful", [True, False], ids=["own-state", "replayed"])
def test_a_stream_resumes_where_it_stood_and_quarantine_does_not_move_it(stateful: bool) -> None:
    from orchestrator.stream import _Key, _Stream

    quarantined: set[int] = {2}
    first = _Stream(_Counting(20, stateful), _Key("id"), quarantined)
    it = iter(first)
    assert [next(it)[0] for _ in range(5)] == [0, 1, 3, 4, 5]  # 2 skipped
    state = first.state_dict()
    quarantined.add(7)  # quarantined after the position was saved, ahead of it
    again = _Stream(_Counting(20, stateful), _Key("id"), quarantined)
    again.load_state_dict(state)
    assert [i for i, _ in again] == [6, 8, 9, *range(10, 20)]


def test_a_user_sampler_resumes_across_epochs_and_is_told_each_epoch() -> None:
    from orchestrator.stream import _SkipQuarantined

    class Told(torch.utils.data.Sampler[int]):
        def __init__(self) -> None:
            self.epochs: list[int] = []

        def set_epoch(self, epoch: int) -> None:
            self.epochs.append(epoch)

        def __iter__(self):  # type: ignore[no-untyped-def]
            g = torch.Generator().manual_seed(self.epochs[-1])
            return iter(torch.randperm(10, generator=g).tolist())

        def __len__(self) -> int:
            return 10

    sampler = Told()
    batches = _SkipQuarantined(sampler, 3, {int(torch.randperm(10)[0])})
    whole = [b for _ in range(3) for b in batches]  # three epochs, 9 kept ids -> 3 batches
    assert sampler.epochs == [0, 1, 2] and len(whole) == 9
    # Stop after the first batch of epoch 1, resume from the state, in a new sampler.
    replay = _SkipQuarantined(sampler, 3, batches.quarantined)
    list(replay)
    it = iter(replay)
    next(it)
    state = replay.state_dict()
    resumed = _SkipQuarantined(Told(), 3, batches.quarantined)
    resumed.load_state_dict(state)
    assert list(resumed) == whole[4:6] and resumed.sampler.epochs == [1]


def test_rerun_rows_are_what_default_collate_of_the_subset_makes() -> None:
    import collections

    from torch.utils.data import default_collate

    from orchestrator.stream import _joined, _rows

    Pair = collections.namedtuple("Pair", "a b")
    samples = [
        {"x": torch.randn(3), "n": i, "name": f"s{i}", "pair": Pair(torch.tensor([i]), 0.5 * i)}
        for i in range(6)
    ]
    first, second = default_collate(samples[:4]), default_collate(samples[4:])
    got = _joined([_rows(first, [3]), _rows(second, [1]), _rows(first, [0])])
    want = default_collate([samples[3], samples[5], samples[0]])
    assert got.keys() == want.keys() and got["name"] == want["name"]
    for key in ("x", "n"):
        assert torch.equal(got[key], want[key]) and got[key].dtype == want[key].dtype
    assert isinstance(got["pair"], Pair)
    assert all(torch.equal(g, w) for g, w in zip(got["pair"], want["pair"], strict=True))


def test_shm_slots_seal_verify_and_withdraw(tmp_path: Path) -> None:
    """The shared-memory ring in one process: a sealed slot reads back exactly (bf16, bool,
    a 0-d tensor, plain values); bytes changed after sealing are refused by checksum; a
    rollback's drop withdraws the verdict; a held slot gets a new file and the old mapping
    keeps its bytes."""
    from orchestrator.faults import corrupt_slot
    from orchestrator.shm import ShmSlots
    from orchestrator.snapshot import SnapshotRing

    shm = ShmSlots(str(tmp_path / "shm"), rank=0, world_size=1, keep=2, attempt=3)
    ring = SnapshotRing(2, alloc=shm.alloc, on_drop=shm.drop)
    state = {
        "w": torch.randn(5, 3, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "count": torch.tensor(7),
        "groups": [{"lr": 0.1, "betas": (0.9, 0.95)}],
    }
    snap = ring.capture(10, state)
    assert snap is not None and snap.slot == 0
    for got, want in zip(snap.buffers, (state["w"], state["mask"], state["count"]), strict=True):
        assert torch.equal(got, want)
    snap.sealed = True
    shm.seal(snap, on_error=lambda err: pytest.fail(repr(err)), plan={})
    shm.join()
    assert shm.candidates() == ({10: (0, "3-0")}, [])
    assert shm.check(0) is None
    back = shm.load(0)
    assert torch.equal(back["w"], state["w"]) and back["w"].dtype == torch.bfloat16
    assert torch.equal(back["mask"], state["mask"]) and back["count"].item() == 7
    assert back["groups"] == [{"lr": 0.1, "betas": (0.9, 0.95)}]
    corrupt_slot(shm, snap)
    assert "checksum" in (shm.check(0) or "")
    # A second snapshot in slot 1, sealed; a rollback to before it withdraws its verdict.
    snap2 = ring.capture(20, state)
    assert snap2 is not None and snap2.slot == 1
    snap2.sealed = True
    shm.seal(snap2, on_error=lambda err: pytest.fail(repr(err)), plan={})
    shm.join()
    assert shm.candidates()[0] == {10: (0, "3-0"), 20: (1, "3-0")}
    ring.drop_after(10)
    assert shm.candidates()[0] == {10: (0, "3-0")}
    # Slot 1 again while slot 0 is being persisted (held): a new file for slot 0 only when
    # its own buffers were given up; the persisting reader's bytes never change.
    snap.held = True
    before = snap.buffers[0].clone()
    ring._buffers[0] = []  # what drop_after does to a held slot
    old_file = shm._files[0]
    assert shm.alloc(0, [state["w"], state["mask"], state["count"]], []) is not None
    assert shm._files[0] != old_file and not Path(str(old_file)).exists()
    assert torch.equal(snap.buffers[0], before)  # the old mapping is intact
    shm.close(remove=True)
    assert not (tmp_path / "shm").exists()


def test_reusing_a_slot_cancels_its_checksum_instead_of_waiting(tmp_path: Path) -> None:
    """A slot reused while its verdict's checksum still runs (steps of milliseconds, a
    state of GBs: seen on an H200) stops that checksum: no verdict, no error, the same
    file. The incremental checksum equals one zlib call per 64 MiB chunk."""
    import threading
    import zlib

    from orchestrator.shm import CHUNK, ShmSlots, _Cancelled, _crcs
    from orchestrator.snapshot import SnapshotRing

    buf = torch.randint(0, 255, (CHUNK + (9 << 20),), dtype=torch.uint8)
    data = buf.numpy().data
    assert _crcs(buf, cancel=threading.Event()) == [
        zlib.crc32(data[:CHUNK]),
        zlib.crc32(data[CHUNK:]),
    ]
    stop = threading.Event()
    stop.set()
    with pytest.raises(_Cancelled):
        _crcs(buf, cancel=stop)

    shm = ShmSlots(str(tmp_path / "shm"), rank=0, world_size=1, keep=2, attempt=0)
    ring = SnapshotRing(2, alloc=shm.alloc, on_drop=shm.drop)
    state = {"w": torch.randn(48 << 20 >> 2)}  # 48 MiB: twelve 4 MiB pieces
    snap = ring.capture(5, state)
    assert snap is not None
    snap.sealed = True
    errors: list[Exception] = []
    shm.seal(snap, on_error=errors.append, plan={})
    file = shm._files[0]
    shm.alloc(0, [state["w"]], snap.buffers)  # the slot again, its checksum under way
    assert not shm._sealing and errors == []
    assert shm.candidates()[0] == {} and shm._files[0] == file
    # Sealed and left alone, the verdict is written and checks.
    shm.seal(snap, on_error=errors.append, plan={})
    shm.join()
    assert shm.candidates()[0] == {5: (0, "0-0")} and shm.check(0) is None and errors == []
    shm.close(remove=True)


def test_every_slot_file_is_made_at_the_first_capture_with_room_to_grow(tmp_path: Path) -> None:
    """The first capture makes every slot's file at the engine's estimate (on an H200 a
    slot's first use cost 0.95 s mid-training: a 1.6 GiB file made and page-locked); the
    optimizer state created after it fits in place; a slot a persisting reader holds
    still gets a new file."""
    from orchestrator.shm import ShmSlots
    from orchestrator.snapshot import SnapshotRing

    shm = ShmSlots(str(tmp_path / "shm"), rank=0, world_size=1, keep=3, attempt=0)
    shm.reserve_bytes = 3 * 4096 * 4  # weights and two AdamW moments of 4096 floats
    ring = SnapshotRing(3, alloc=shm.alloc, on_drop=shm.drop)
    w = torch.randn(4096)
    first = ring.capture(0, {"w": w})
    assert first is not None
    files = [str(f) for f in shm._files]
    assert all(os.path.getsize(f) >= shm.reserve_bytes for f in files)
    # Not yet a slot's file: a restart now would not report slots 1 and 2 as unsealed.
    assert [os.path.basename(f).startswith("spare-") for f in files] == [False, True, True]
    assert shm.candidates() == ({}, ["slot 0: not sealed (no readable verdict)"])
    files = [f.replace("/spare-", "/") for f in files]
    # After the first step: AdamW's moments, and its step count, which no estimate counts.
    moments = {"w": w, "m": torch.randn(4096), "v": torch.rand(4096), "step": torch.tensor(1.0)}
    for step in (5, 10, 15):  # slots 1 and 2 first used, then slot 0 grown in place
        snap = ring.capture(step, moments)
        assert snap is not None
        for got, want in zip(snap.buffers, moments.values(), strict=True):
            assert torch.equal(got, want)
        snap.sealed = True
    assert shm._files == files
    ring._buffers[1] = []  # slot 1 handed to a persisting reader: never written again
    shm.alloc(1, list(moments.values()), [])
    assert shm._files[1] != files[1] and shm._files[0] == files[0]
    shm.close(remove=True)
    # A restart: slot 1 still holds the crashed process's snapshot (to flush or heal from),
    # and /dev/shm has room for one ring: no file is made ahead there.
    left = tmp_path / "shm" / "slot1" / "rank0-7.bin"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"x" * 64)
    again = ShmSlots(str(tmp_path / "shm"), rank=0, world_size=1, keep=3, attempt=1)
    again.reserve_bytes = shm.reserve_bytes
    SnapshotRing(3, alloc=again.alloc, on_drop=again.drop).capture(0, {"w": w})
    assert left.exists() and again._files[1] is None and again._files[2] is not None
    again.close(remove=True)


def test_a_ring_removed_under_a_writing_rank_stays_removed(tmp_path: Path) -> None:
    """A rank whose supervisor died removes the node's ring while its training thread still
    captures into it (orchestrator/lifeline.py): the folder must be gone afterwards, and the
    thread's next slot fails with a PersistError instead of making the folder again."""
    import threading

    from orchestrator.errors import PersistError
    from orchestrator.lifeline import remove_ring
    from orchestrator.shm import ShmSlots

    root = tmp_path / "ring"
    shm = ShmSlots(str(root), rank=0, world_size=1, keep=4, attempt=0)
    leaves = [torch.zeros(1024)]
    shm.alloc(0, leaves, [])
    errors: list[BaseException] = []
    stop = threading.Event()

    def capture() -> None:
        k = 0
        while not stop.is_set():
            k += 1
            try:
                shm.alloc(k % 4, leaves, [])
            except PersistError as err:
                errors.append(err)
                return

    t = threading.Thread(target=capture, daemon=True)
    t.start()
    time.sleep(0.05)  # let it write a few slots
    remove_ring(str(root))
    t.join(timeout=10)
    stop.set()
    assert not t.is_alive() and errors, "the capture thread went on writing"
    assert not root.exists() and not list(tmp_path.iterdir())


def test_a_restart_takes_the_newest_step_every_rank_sealed_on_one_timeline() -> None:
    from orchestrator.shm import agreeable

    # Rank 1's step 50 was left on this node by attempt 0 (it ran elsewhere in attempt 1):
    # never mixed with rank 0's step 50 of attempt 1; step 40 is common to both.
    seen = [({40: "1-0", 50: "1-0"}, []), ({40: "1-0", 50: "0-0"}, ["slot 2: no verdict"])]
    order, refused = agreeable(seen, newest_durable=-1)
    assert order == [40]
    assert refused[0] == "rank 1: slot 2: no verdict" and "step 50" in refused[1]
    assert agreeable(seen, newest_durable=45) == ([], refused)  # durable is newer
    assert agreeable([({30: "2-1"}, []), ({30: "2-1"}, [])], 30)[0] == [30]  # a tie: shm


def test_shm_slots_take_awkward_tensors_and_refuse_another_world_size(tmp_path: Path) -> None:
    """An empty shard (FSDP with more ranks than rows), a transposed (non-contiguous)
    tensor, odd byte counts between aligned ones: all read back exactly. Slots sealed at
    world size 2 are refused, with the reason, by a restart at world size 1."""
    from orchestrator.shm import ShmSlots
    from orchestrator.snapshot import SnapshotRing

    root = str(tmp_path / "shm")
    shm = ShmSlots(root, rank=0, world_size=2, keep=2, attempt=0)
    ring = SnapshotRing(2, alloc=shm.alloc, on_drop=shm.drop)
    state = {
        "empty": torch.empty(0, 7),
        "odd": torch.arange(3, dtype=torch.int8),
        "t": torch.arange(12.0).reshape(3, 4).t(),
        "f16": torch.randn(5, dtype=torch.float16),
    }
    snap = ring.capture(4, state)
    assert snap is not None
    snap.sealed = True
    shm.seal(snap, on_error=lambda err: pytest.fail(repr(err)), plan={})
    shm.join()
    assert shm.check(snap.slot) is None
    back = shm.load(snap.slot)
    for k, v in state.items():
        assert back[k].shape == v.shape and back[k].dtype == v.dtype and torch.equal(back[k], v)
    found, refused = ShmSlots(root, rank=0, world_size=1, keep=2, attempt=1).candidates()
    assert found == {} and refused == ["slot 0: step 4 was taken at world size 2, not 1"]
    # Rank 1 restarted on this node, which holds rank 0's slots: said, not silently skipped.
    found, refused = ShmSlots(root, rank=1, world_size=2, keep=2, attempt=1).candidates()
    assert found == {} and "ranks moved between nodes" in refused[0]


def test_state_held_alike_is_kept_once_per_node_each_rank_copying_its_share(
    tmp_path: Path,
) -> None:
    """Two ranks of one node (two slots objects in one process): the keys every rank holds
    alike go to one node file, of which each rank copies its half (cut inside tensors, at
    element boundaries, across odd sizes and dtypes); each reads the whole back. A step is
    refused while a share has no verdict or after the node's ranks change; a flipped byte
    is refused by the rank whose share holds it; a snapshot handed to durable storage never
    has its node file written again; ranks whose own keys differ in shape still agree on
    the node file."""
    from orchestrator.faults import corrupt_slot
    from orchestrator.shm import ShmSlots
    from orchestrator.snapshot import SnapshotRing

    root = str(tmp_path / "shm")
    g = torch.Generator().manual_seed(0)
    alike = {
        "model": {
            "emb": torch.randn(11, 5, generator=g).to(torch.bfloat16),  # odd vocabulary
            "empty": torch.empty(0, 3),
            "b": torch.randn(7, generator=g),
            "t": torch.randn(3, 4, generator=g).t(),  # not contiguous
        },
        "optim": {"step": torch.tensor(3, dtype=torch.int64), "lr": 0.1},
    }
    slots = [ShmSlots(root, r, 2, keep=2, attempt=1, node_ranks=[0, 1], token="tk") for r in (0, 1)]
    rings = [SnapshotRing(2, alloc=s.alloc, on_drop=s.drop) for s in slots]
    keys = frozenset({"model", "optim"})

    def state(rank: int, n: int = 3) -> dict[str, Any]:
        return {**alike, "rng": torch.full((n + rank,), rank, dtype=torch.uint8)}

    def capture(step: int, n: int = 3) -> list[Any]:
        first = rings[0].capture(step, state(0, n), keys)
        assert first is not None  # only rank 0 has copied: half of the node part is missing
        wanted = [*alike["model"].values(), alike["optim"]["step"]]
        assert not all(torch.equal(b, w) for b, w in zip(first.buffers, wanted, strict=False))
        second = rings[1].capture(step, state(1, n), keys)
        assert second is not None and all(  # now whole, seen through rank 0's mapping too
            torch.equal(b, w) for b, w in zip(first.buffers, wanted, strict=False)
        )
        return [first, second]

    snaps = capture(10)
    nodes = {s._node_files[0] for s in slots}
    assert len(nodes) == 1 and None not in nodes  # one node file, mapped by both
    for r, snap in enumerate(snaps):
        snap.sealed = True
        back = snap.materialize("model", clone=True)
        assert all(torch.equal(back[k], v) for k, v in alike["model"].items())
        slots[r].seal(snap, on_error=lambda err: pytest.fail(repr(err)), plan={})
        slots[r].join()
    shares = [s._share[0] for s in slots]
    assert sum(n for share in shares for _, n in share) == sum(
        t.numel() * t.element_size() for t in (*alike["model"].values(), alike["optim"]["step"])
    )
    for r, s in enumerate(slots):
        assert s.candidates() == ({10: (0, "1-0")}, []) and s.check(0) is None
        back = s.load(0)
        assert all(torch.equal(back["model"][k], v) for k, v in alike["model"].items())
        assert back["optim"] == {"step": 3, "lr": 0.1} and torch.equal(back["rng"], state(r)["rng"])
    # Another set of ranks on the node now, or a share without its verdict: refused.
    alone = ShmSlots(root, 0, 2, keep=2, attempt=2, node_ranks=[0], token="x")
    assert "this node runs ranks [0]" in alone.candidates()[1][0]
    slots[1].drop(0)
    assert "rank 1's share of the node part has no verdict" in slots[0].candidates()[1][0]
    slots[1].seal(snaps[1], on_error=lambda err: pytest.fail(repr(err)), plan={})
    slots[1].join()
    # A flipped byte in rank 1's share: rank 1 refuses it, rank 0's share is intact.
    corrupt_slot(slots[1], snaps[1])
    assert "node checksum" in (slots[1].check(0) or "") and slots[0].check(0) is None
    # Slot 1, then slot 0 again after its snapshot was handed to durable storage: a new node
    # file (a writer may still read the old one), the same on both ranks, even though rank
    # 1's own key changed shape in between.
    for snap in capture(20):
        snap.sealed = True  # the newest sealed: slot 0 is the next victim
    for snap in snaps:
        snap.persisted = True
    capture(30, n=5)
    assert len({s._node_files[0] for s in slots}) == 1 and slots[0]._node_files[0] not in nodes
    for s in slots:
        s.close(remove=False)
    slots[0].close(remove=True)
    assert not Path(root).exists()


def test_a_ring_copy_goes_to_a_holder_and_back_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Buddy replication's wire, in one process: node A's newest complete step (two ranks
    sharing a node part) goes to a holder's server and comes back into an empty ring, where
    it reads back exactly; a wrong run key, a path outside the copy and an aborted copy
    (its slot moved on while it was sent) are refused, and the holder keeps what it had."""
    from launch import replica
    from launch.replica import ReplicaServer, get, newest_complete, put
    from orchestrator.shm import ShmSlots
    from orchestrator.snapshot import SnapshotRing

    ring_a = str(tmp_path / "a")
    state = {"model": {"w": torch.randn(13, 3)}, "rng": torch.arange(4)}
    slots = [
        ShmSlots(ring_a, r, 2, keep=2, attempt=0, node_ranks=[0, 1], token="t") for r in (0, 1)
    ]
    for step in (10, 20):
        for s in slots:
            snap = SnapshotRing(2, alloc=s.alloc, on_drop=s.drop).capture(
                step, state, frozenset({"model"})
            )
            assert snap is not None
            snap.sealed = True
            s.seal(snap, on_error=lambda err: pytest.fail(repr(err)), plan={})
            s.join()
    found = newest_complete(ring_a)
    assert found is not None and found[0] == 20 and found[1][-1].endswith(".json")
    holder = ReplicaServer(str(tmp_path / "b"), key="k")
    addr = f"127.0.0.1:{holder.port}"
    try:
        assert put(addr, "k", "a", ring_a, *found) > 0
        with pytest.raises(ConnectionError, match="wrong run key"):
            put(addr, "other", "a", ring_a, *found)
        with pytest.raises(ConnectionError, match="outside"):
            _put_raw(holder.port, {"op": "put", "key": "k", "node": "a", "step": 30,
                                   "files": [["../escape", 0]]})  # fmt: skip
        # A verdict that changes while the copy is sent (its slot is being rewritten):
        # the sender aborts, the holder keeps step 20.
        stream = replica._stream

        def moving(wfile: Any, root: str, files: list[tuple[str, int]]) -> None:
            stream(wfile, root, files)
            verdict = Path(root) / files[-1][0]
            verdict.write_text(verdict.read_text().replace('"step": 20', '"step": 21'))

        monkeypatch.setattr(replica, "_stream", moving)
        with pytest.raises(ConnectionError, match="aborted"):
            put(addr, "k", "a", ring_a, *found)
        monkeypatch.undo()
        back = str(tmp_path / "c")
        assert get(addr, "k", "a", back)[0] == 20
        for r in (0, 1):
            c = ShmSlots(back, r, 2, keep=2, attempt=1, node_ranks=[0, 1], token="u")
            assert c.candidates()[0] == {20: (0, "0-0")} and c.check(0) is None
            assert torch.equal(c.load(0)["model"]["w"], state["model"]["w"])
        assert get(addr, "k", "nobody", str(tmp_path / "d")) == (-1, 0)
    finally:
        holder.close()
        for s in slots:
            s.close(remove=False)


def _put_raw(port: int, head: dict[str, Any]) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        f = sock.makefile("rwb")
        f.write((json.dumps(head) + "\n").encode())
        f.flush()
        reply = json.loads(f.readline() or b"{}")
    raise ConnectionError(reply.get("error"))


def test_a_full_shared_memory_fails_with_what_to_do(tmp_path: Path) -> None:
    """A tmpfs too small for a slot: the allocation fails at once with a PersistError that
    names the size, the folder and the remedies (never a SIGBUS at the first write)."""
    from orchestrator.errors import PersistError
    from orchestrator.shm import ShmSlots

    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True, check=False)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        shm = ShmSlots(str(small / "ring"), rank=0, world_size=1, keep=2, attempt=0)
        with pytest.raises(
            PersistError, match=r"4\.00 MiB ring slot of rank 0 .*shared_memory: false"
        ):
            shm.alloc(0, [torch.zeros(2**20)], [])
        assert not list((small / "ring" / "slot0").iterdir())  # nothing half-made left
        # At Guard start, on a /dev/shm already nearly full (a container's 64 MiB one): a
        # PolicyError that says how much is needed, where, and what to change.
        with open(small / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # until the tmpfs is full
                f.write(b"x" * 4096)
        policy = {"snapshot": {"shared_memory": True, "shm_dir": str(small)}}
        full = rf"in {small} on this node .*, but only .* free there: free or"
        with pytest.raises(PolicyError, match=full):
            train(tmp_path / "run", policy, steps=2)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_the_shared_memory_ring_without_a_supervisor_cleans_up_at_close(tmp_path: Path) -> None:
    """Plain python, no supervisor: the Guard keeps its ring under snapshot.shm_dir while it
    runs and removes it at close(); a shm_dir that does not exist is refused at start."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    policy = {"snapshot": {"shared_memory": True, "shm_dir": str(shm_dir)}}
    _, _, outcomes = train(tmp_path / "run", policy, steps=25)
    assert outcomes.count("commit") == 25
    assert [e["details"]["tier"] for e in events(tmp_path / "run", "snapshot")][-1] == "shm"
    assert list(shm_dir.iterdir()) == []
    missing = {"snapshot": {"shared_memory": True, "shm_dir": str(tmp_path / "nope")}}
    with pytest.raises(PolicyError, match=r"but it does not exist: free or enlarge"):
        train(tmp_path / "run2", missing, steps=2)


def test_a_failed_start_leaves_no_thread_and_no_open_file(tmp_path: Path) -> None:
    """The Guard's start fails part way (a ring folder that does not exist): the persist and
    heartbeat threads it started are stopped and the journal is closed, so a script that
    catches the error and goes on holds none of them."""
    import os
    import threading

    before = {t.ident for t in threading.enumerate()}
    run = tmp_path / "run"
    policy = {"snapshot": {"shared_memory": True, "shm_dir": str(tmp_path / "nope")}}
    with pytest.raises(PolicyError, match="does not exist"):
        train(run, policy, steps=2)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert left == []
    open_files = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            open_files.append(os.readlink(f"/proc/self/fd/{fd}"))
    assert not [f for f in open_files if f.startswith(str(run))], open_files


def test_a_heartbeat_that_cannot_be_written_is_said_once(tmp_path: Path) -> None:
    """The heartbeat file cannot be written (its folder replaced by a file, as a vanished
    or full disk does): the error is reported once, not every interval, and not silently."""
    import shutil

    from orchestrator.heartbeat import Heartbeat

    said: list[OSError] = []
    beat = Heartbeat(str(tmp_path), rank=0, attempt=0, interval_s=0.02, on_error=said.append)
    beat.beat(1)
    deadline = time.monotonic() + 10
    while not Path(beat.path).exists():  # bounded poll: the writer's first beat
        assert time.monotonic() < deadline
        time.sleep(0.01)
    shutil.rmtree(beat.dir)
    Path(beat.dir).write_text("not a folder any more")
    while beat.failures < 5:  # bounded poll: five intervals that could not write
        assert time.monotonic() < deadline, "the writer stopped trying"
        time.sleep(0.01)
    beat.close()
    assert len(said) == 1 and isinstance(said[0], OSError)


# --- RNG state ----------------------------------------------------------------------------
def test_rng_state_round_trips_and_holds_no_per_device_list() -> None:
    import random

    from orchestrator.rng import rng_state, set_rng_state

    state = rng_state()
    a = (torch.rand(3), random.random())
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a[0]) and random.random() == a[1]
    # CUDA, where there is one: this rank's device alone (a tensor, not a list by index).
    assert not isinstance(state.get("cuda"), list)


def _philox(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def test_old_format_cuda_rng_restores_the_stream_that_moved() -> None:
    """Old snapshots hold one CUDA state per device visible at save time. The rank's own is
    the one whose Philox offset moved; else the entry at the index of its device now;
    else none (fewer devices saved than that index: no IndexError)."""
    import random

    from orchestrator.rng import _old_entry, set_rng_state

    seed = 67280421310721
    states = [_philox(seed, 0), _philox(seed, 0), _philox(seed, 4096), _philox(seed, 0)]
    picked = _old_entry(states, index=0)  # resumed with one device per process: index 0
    assert picked is not None and torch.equal(picked, states[2])
    untouched = [_philox(seed, 0), _philox(seed + 1, 0)]
    picked = _old_entry(untouched, index=1)
    assert picked is not None and torch.equal(picked, untouched[1])
    assert _old_entry(untouched, index=5) is None
    # An old-format state loads without CUDA (the CUDA part is skipped, the rest restored).
    old = {"python": random.getstate(), "torch": torch.get_rng_state()}
    expect = torch.rand(2)
    set_rng_state({**old, "cuda": states})
    assert torch.equal(torch.rand(2), expect)


REBIND_DDP_CHECK = """
import os, warnings, torch, torch.distributed as dist
from torch import nn
from orchestrator.engines.rebind_ddp import ddp_unsupported, mirror_ddp
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"],
                        rank=0, world_size=1)
warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated in 2.13
def ddp(buffers, **kw):
    m = nn.Sequential(nn.Linear(4, 4), *([nn.BatchNorm1d(4)] if buffers else []))
    return nn.parallel.DistributedDataParallel(m, **kw)
print("default", ddp(True) and ddp_unsupported(ddp(True)))
print("no-broadcast", ddp_unsupported(ddp(True, broadcast_buffers=False)) is not None)
print("no-buffers", ddp_unsupported(ddp(False, broadcast_buffers=False)))
class Old(nn.parallel.DistributedDataParallel):  # as torch 2.11 keeps it: a plain attribute
    broadcast_buffers = False
old = Old(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
del old.forward_sync_buffers
print("old", ddp_unsupported(old))
new = ddp(True)
mirror_ddp(new)
print("mirrored", new.reducer is not None)
"""


def test_ddp_rebind_reads_either_torch_and_refuses_what_it_cannot_tell() -> None:
    """orchestrator/engines/rebind_ddp.py: torch 2.11's DDP has no forward_sync_buffers (an
    H200 run died healing on it); a 2.13 DDP with buffers and broadcast_buffers=False hides
    whether its constructor broadcast them, so in-place recovery falls back there."""
    from conftest import free_port, run

    r = run([sys.executable, "-c", REBIND_DDP_CHECK], env={"PORT": str(free_port())}, timeout=60)
    assert r.returncode == 0, r.stdout
    lines = dict(x.split(" ", 1) for x in r.stdout.splitlines() if " " in x)
    assert lines["default"] == "None" and lines["no-broadcast"] == "True", r.stdout
    assert lines["no-buffers"] == "None" and lines["old"] == "None", r.stdout
    assert lines["mirrored"] == "True", r.stdout
