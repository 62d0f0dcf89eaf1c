"""The user's own data pipeline through ``guard.dataloader`` (torchdata's StatefulDataLoader),
2 ranks, DDP, gloo: a ``DistributedSampler`` over a map-style set, and an endless
``IterableDataset`` whose samples carry an id (with loader workers). Rollbacks, quarantine
and resume rewind the loader's own state, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, assert_bitwise_equal, final_states, kinds, prequarantined, train

pytestmark = pytest.mark.timeout(400)

sys.path.insert(0, str(REPO / "tests"))
from regression_worker import stream_order, user_sampler  # noqa: E402

WORKER = REPO / "tests" / "regression_worker.py"
STEPS, SAMPLES, BATCH = 24, 1024, 8
EXACT: dict[str, Any] = {
    "adjust": {"lr_factor": 1.0},
    "snapshot": {"every_steps": 5},
    "persist": {"every_steps": 5},
}


def run(
    run_dir: Path,
    data: str,
    policy: dict[str, Any],
    workers: int = 0,
    ok: bool = True,
    samples: int = SAMPLES,
) -> None:
    """Train into ``run_dir``; it must end with exit code 0 (``ok``) or fail."""
    args = ["--data", data, "--steps", str(STEPS), "--samples", str(samples)]
    r = train(run_dir, 2, *args, "--workers", str(workers), policy=policy, script=WORKER)
    assert (r.returncode == 0) == ok, r.stdout[-4000:]


def sample_at(data: str, step: int, rank: int) -> int:
    """The fourth sample rank ``rank`` runs at ``step`` (first pass, nothing quarantined)."""
    if data == "stream":
        order = stream_order(SAMPLES, 0, rank, 2)
    else:
        sampler = user_sampler(SAMPLES, rank)
        sampler.set_epoch(0)
        order = list(sampler)
    return int(order[step * BATCH + 3])


# The sampler over 100 samples (50 per rank, 6 batches of 8 and 2 dropped per epoch): the
# 24 steps cross 3 epoch ends and the resume lands in a later epoch than the first.
@pytest.mark.parametrize(
    ("data", "workers", "samples"), [("sampler", 0, 100), ("stream", 2, SAMPLES)]
)
def test_transient_nan_then_crash_resume_bit_for_bit(
    tmp_path: Path, data: str, workers: int, samples: int
) -> None:
    """A NaN at step 7 rolls back to step 5 (the loader state from the ring), a crash at
    step 17 ends the attempt and the same command resumes from the newest durable snapshot
    (the loader state from storage): both must replay exactly the clean run's batches."""
    clean = tmp_path / "clean"
    run(clean, data, EXACT, workers, samples=samples)
    faulty = tmp_path / "faulty"
    faults = [
        {"kind": "inf_loss", "step": 7, "rank": 1},
        {"kind": "crash", "step": 17, "rank": 0, "after_persist": True},
    ]
    policy = {**EXACT, "faults": faults}
    run(faulty, data, policy, workers, ok=False, samples=samples)
    run(faulty, data, policy, workers, samples=samples)
    (rollback,) = kinds(faulty, "rollback")
    assert (rollback["details"]["from_step"], rollback["details"]["to_step"]) == (7, 5)
    (resume,) = kinds(faulty, "resume")
    assert resume["details"]["snapshot_step"] in (5, 10, 15)  # as far as the writes got
    assert resume["details"]["data_position"] == "per rank"
    (end,) = kinds(faulty, "run_end")  # the run's incident, though the resumed process had none
    assert (end["details"]["incidents"], end["details"]["attempt_incidents"]) == (1, 0)
    assert (end["details"]["rollbacks"], end["details"]["attempt_rollbacks"]) == (1, 0)
    for a, b in zip(final_states(clean), final_states(faulty), strict=True):
        assert a["step"] == b["step"] == STEPS
        assert_bitwise_equal(a, b, f"{data} final")


@pytest.mark.parametrize("data", ["sampler", "stream"])
def test_a_poison_sample_is_quarantined_by_id_bit_for_bit(tmp_path: Path, data: str) -> None:
    """A poison sample at step 6 is isolated and quarantined by its id; the run then equals
    one whose ledger held that id from the start (the loader skips it in both)."""
    bad = sample_at(data, step=6, rank=0)
    policy = {**EXACT, "faults": [{"kind": "poison_sample", "sample": bad}]}
    faulty = tmp_path / "faulty"
    run(faulty, data, policy)
    (inc,) = kinds(faulty, "incident")
    assert inc["step"] == 6 and inc["details"]["cause"] == "data"
    (q,) = kinds(faulty, "quarantine")
    assert q["details"]["samples"] == [bad]
    assert bad in inc["details"]["batch_ids"][0]

    pre = prequarantined(tmp_path, [bad])
    run(pre, data, policy)
    assert not kinds(pre, "incident")
    for a, b in zip(final_states(pre), final_states(faulty), strict=True):
        assert_bitwise_equal(a, b, f"{data} final")


def test_the_stream_position_does_not_reshard(tmp_path: Path) -> None:
    """A stream's position is each rank's own: resuming it at another world size is refused
    with a message that says so (not a silent restart of the data)."""
    d = tmp_path / "run"
    crash = {"kind": "crash", "step": 17, "rank": 0, "after_persist": True}
    policy = {**EXACT, "faults": [crash]}
    run(d, "stream", policy, ok=False)
    args = ["--data", "stream", "--steps", str(STEPS), "--samples", str(SAMPLES)]
    r = train(d, 1, *args, policy=policy, script=WORKER)
    assert r.returncode != 0 and "cannot be re-sharded over 1" in r.stdout
    assert not kinds(d, "resume")


def test_guard_dataloader_misuse_is_named(tmp_path: Path) -> None:
    from orchestrator import Guard, load_policy
    from orchestrator.errors import OrchestratorError, UsageError

    model = torch.nn.Linear(4, 1)
    guard = Guard(
        load_policy(),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        run_dir=str(tmp_path),
    )
    data = [(torch.zeros(4), torch.zeros(())) for _ in range(16)]

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(data)

    with pytest.raises(UsageError, match="sample_id"):
        guard.dataloader(Stream(), 4)
    with pytest.raises(UsageError, match="sampler="):
        guard.dataloader(data, 4, batch_sampler=[[0, 1]])
    with pytest.raises(UsageError, match="shuffle"):
        guard.dataloader(data, 4, sampler=range(16), shuffle=True)
    with pytest.raises(UsageError, match="persistent_workers"):
        guard.dataloader(Stream(), 4, sample_id=0, persistent_workers=True)
    with pytest.raises(UsageError, match="not an integer"):
        loader = guard.dataloader(Stream(), 4, sample_id=0)  # a tensor of 4 is no id
        next(iter(loader))
    with pytest.raises(OrchestratorError, match="rank 0: the data yields no full batch of 32"):
        loader = guard.dataloader(Stream(), 32, sample_id=lambda s: 0)
        next(guard.batches(loader, max_steps=1))
    with pytest.raises(UsageError, match=r"guard\.dataloader"):
        next(guard.batches(torch.utils.data.DataLoader(data), max_steps=1))
    guard.close()
