"""The Guard's hooks for a framework that fetches a whole step's micro-batches before it
runs any (``begin_step``/``begin_micro``/``end_micro``/``run_reruns``, as the
``transformers.Trainer`` integration drives them), in one process: the same run as
``guard.batches`` bit for bit, and a poison sample isolated by nested re-runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from inproc import Regression, events, train
from torch.utils.data import SequentialSampler

from conftest import assert_bitwise_equal, prequarantined
from orchestrator import Guard, UsageError, parse_policy
from orchestrator.data import GuardBatchSampler
from orchestrator.engines.framework import FrameworkEngine
from orchestrator.guard import COMMIT, INCIDENT

pytestmark = pytest.mark.timeout(120)

GA, STEPS = 2, 12
EXACT = {"adjust": {"lr_factor": 1.0}, "snapshot": {"every_steps": 2}}


def framework_train(
    run_dir: Path, policy: dict[str, Any], samples: int = 256, sampler: bool = False
) -> tuple[Guard, dict[str, Any]]:
    """inproc.train's model, data and schedule, in the shape of Trainer's loop: fetch the
    step's micro-batches, run each (the loop divides the loss), then step the scheduler and
    zero the gradients itself after the Guard applied the optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    engine = FrameworkEngine(
        model, opt, sched, backward=lambda loss: loss.backward(), grad_accum_steps=GA
    )
    guard = Guard(parse_policy(policy), engine=engine, run_dir=str(run_dir))
    data = Regression(samples)
    if sampler:  # the user's sampler: a StatefulDataLoader, its position per rank
        loader = guard.dataloader(data, batch_size=8, sampler=SequentialSampler(data))
    else:
        loader = guard.dataloader(data, batch_size=8, seed=1)

    def forward(batch: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(model(x).squeeze(-1), y)

    while guard.global_step < STEPS:
        for m, batch in enumerate(guard.begin_step(loader, GA, STEPS)):
            guard.begin_micro()
            guard.backward(forward(batch) / GA)
            if m + 1 < GA:
                assert guard.step() == "accumulate"
                guard.end_micro()
        outcome = guard.step()
        if outcome == INCIDENT:
            guard.run_reruns(forward)
        guard.end_micro()
        if outcome == COMMIT:
            sched.step()
        opt.zero_grad()
    guard.close()
    return guard, {"model": model.state_dict(), "optim": opt.state_dict()}


def test_a_prefetched_step_is_the_guard_loop_bit_for_bit(tmp_path: Path) -> None:
    _, reference, _ = train(tmp_path / "ref", EXACT, steps=STEPS, grad_accum_steps=GA)
    guard, state = framework_train(tmp_path / "hooks", EXACT)
    assert guard.global_step == STEPS
    assert_bitwise_equal(reference, state)


def test_a_poison_sample_is_isolated_by_nested_reruns(tmp_path: Path) -> None:
    # A sample of step 5's second micro-batch: the ids must be charged to it, not to the
    # first (fetched before it, run before it).
    sampler = GuardBatchSampler(len(Regression()), 8, rank=0, world_size=1, seed=1)
    bad = sampler.batch_at(0, (5 * GA + 1) * 8)[0][3]
    policy = {**EXACT, "faults": [{"kind": "poison_sample", "sample": bad}]}
    guard, faulty = framework_train(tmp_path / "faulty", policy)
    (inc,) = events(tmp_path / "faulty", "incident")
    assert inc["step"] == 5 and inc["details"]["cause"] == "data"
    (q,) = events(tmp_path / "faulty", "quarantine")
    assert q["details"]["samples"] == [bad]
    assert guard.quarantined == {bad} and guard.global_step == STEPS
    pre = prequarantined(tmp_path, [bad])
    _, clean = framework_train(pre, EXACT)
    assert not events(pre, "incident")
    assert_bitwise_equal(clean, faulty)


def test_begin_step_refuses_a_short_step(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = FrameworkEngine(model, opt, backward=lambda loss: loss.backward(), grad_accum_steps=2)
    guard = Guard(parse_policy({}), engine=engine, run_dir=str(tmp_path))
    try:
        loader = guard.dataloader(Regression(), batch_size=4)
        with pytest.raises(UsageError, match="out of phase"):
            guard.begin_step(loader, 1, 5)
        with pytest.raises(UsageError, match="needs begin_step first"):
            guard.begin_micro()
    finally:
        guard.close()


def test_a_rollback_to_an_epoch_s_very_end_resumes_with_the_next_epoch(tmp_path: Path) -> None:
    # 64 samples in batches of 8, 2 per step: an epoch is 4 steps, and the snapshot of step
    # 4 is at epoch 0's very end. A NaN in step 5 rolls back to it; the restored loader
    # yields nothing, which ends that epoch (it used to say the data had no full batch).
    _, clean = framework_train(tmp_path / "clean", {**EXACT, "snapshot": {"every_steps": 4}},
                               samples=64, sampler=True)  # fmt: skip
    fault = {"kind": "inf_loss", "step": 5}
    policy = {**EXACT, "snapshot": {"every_steps": 4}, "faults": [fault]}
    guard, faulty = framework_train(tmp_path / "faulty", policy, samples=64, sampler=True)
    assert guard.rollbacks == 1 and guard.global_step == STEPS
    (rollback,) = events(tmp_path / "faulty", "rollback")
    assert rollback["details"]["to_step"] == 4
    assert_bitwise_equal(clean, faulty)
