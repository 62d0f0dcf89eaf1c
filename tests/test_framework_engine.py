"""The Guard under a loop a framework drives (orchestrator/engines/framework.py): the
framework's backward, scheduler and zero_grad, the Guard's judgement and the inner
optimizer's step; and a framework's wrapped optimizer given to a Guard that owns the loop."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import assert_bitwise_equal
from orchestrator import Guard, UsageError, parse_policy
from orchestrator.engines import FrameworkEngine

pytestmark = pytest.mark.timeout(120)

EXACT = {"adjust": {"lr_factor": 1.0}, "quarantine": {"enabled": False}}
GA, STEPS = 2, 6


def _objects() -> tuple[
    torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler
]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    return model, opt, sched


def _data() -> torch.Tensor:
    return torch.randn(GA * STEPS, 4, 5, generator=torch.Generator().manual_seed(1))


def _alone() -> dict[str, object]:
    """The framework alone: accumulate GA micro-batches (loss / GA), step, schedule, zero."""
    model, opt, sched = _objects()
    for i, x in enumerate(_data()):
        (model(x).pow(2).mean() / GA).backward()
        if (i + 1) % GA == 0:
            opt.step()
            sched.step()
            opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict()["state"]}


def _guarded(run_dir: Path, policy: dict[str, object]) -> tuple[Guard, dict[str, object], int]:
    """The same loop with the framework's calls routed through the Guard, as an
    integration does: the Guard judges each step, the framework schedules on a commit."""
    model, opt, sched = _objects()
    engine = FrameworkEngine(
        model, opt, sched, backward=lambda loss: (loss / GA).backward(), grad_accum_steps=GA
    )
    guard = Guard(parse_policy(policy), engine=engine, run_dir=str(run_dir))
    data = torch.utils.data.TensorDataset(_data())
    scheduled = 0
    for (x,) in guard.batches(guard.dataloader(data, 1, shuffle=False), max_steps=STEPS):
        guard.backward(model(x[0]).pow(2).mean())
        if guard.step() == "commit":
            sched.step()
            opt.zero_grad()
            scheduled += 1
    guard.close()
    return guard, {"model": model.state_dict(), "optim": opt.state_dict()["state"]}, scheduled


def test_a_framework_driven_loop_is_bit_for_bit_the_framework_alone(tmp_path: Path) -> None:
    guard, state, scheduled = _guarded(tmp_path, EXACT)
    assert guard.global_step == scheduled == STEPS
    assert_bitwise_equal(_alone(), state, "final")


def test_a_rolled_back_step_is_replayed_through_the_framework(tmp_path: Path) -> None:
    """A NaN gradient at step 3 rolls back to the snapshot of step 2 (every 2 steps) and the
    replay ends where the framework alone does: the framework's scheduler was stepped once
    per committed step only (its state is in the snapshot the rollback restores)."""
    policy = {**EXACT, "snapshot": {"every_steps": 2}, "faults": [{"kind": "nan_grad", "step": 3}]}
    guard, state, scheduled = _guarded(tmp_path, policy)
    assert guard.rollbacks == 1 and guard.global_step == STEPS
    assert scheduled == STEPS + 1  # step 2 committed twice: before the rollback and after
    assert_bitwise_equal(_alone(), state, "final")


def test_a_built_engine_comes_alone(tmp_path: Path) -> None:
    model, opt, sched = _objects()
    engine = FrameworkEngine(model, opt, sched, backward=lambda loss: loss.backward())
    with pytest.raises(UsageError, match="takes the engine alone"):
        Guard(engine=engine, model=model, run_dir=str(tmp_path))


def test_accelerates_wrapped_optimizer_is_unwrapped_and_its_own_step_refused(
    tmp_path: Path,
) -> None:
    """``Guard(optimizer=AcceleratedOptimizer)`` in a loop the Guard owns: the Guard steps
    the optimizer inside (the run equals a plain one), and a step through the wrapper is
    refused with what to do, not an AttributeError."""
    accelerate = pytest.importorskip("accelerate")
    model = _objects()[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    plain_model = copy.deepcopy(model)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-2, weight_decay=0.1)
    wrapped = accelerate.Accelerator(cpu=True).prepare_optimizer(opt)
    try:
        _train_through_the_wrapper(tmp_path, model, wrapped, plain_model, plain_opt)
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def _train_through_the_wrapper(
    run_dir: Path,
    model: torch.nn.Module,
    wrapped: torch.optim.Optimizer,
    plain_model: torch.nn.Module,
    plain_opt: torch.optim.Optimizer,
) -> None:
    guard = Guard(parse_policy(EXACT), model=model, optimizer=wrapped, run_dir=str(run_dir))
    x = _data()
    data = torch.utils.data.TensorDataset(x)
    for (b,) in guard.batches(guard.dataloader(data, 1, shuffle=False), max_steps=3):
        guard.backward(model(b[0]).pow(2).mean())
        guard.step()
    for i in range(3):
        plain_model(x[i]).pow(2).mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()
    assert_bitwise_equal(plain_model.state_dict(), model.state_dict(), "model")
    with pytest.raises(UsageError, match="outside the Guard"):
        wrapped.step()
    guard.close()


@pytest.mark.parametrize("divided", [False, True])
def test_the_checked_loss_is_the_step_mean_whoever_divides(tmp_path: Path, divided: bool) -> None:
    """Accelerate divides the loss inside its backward; Trainer and Lightning divide it
    before (``loss_divided``): either way the Guard checks, logs and judges spikes by the
    step's mean loss, not that mean divided by the accumulation steps once more."""
    model, opt, sched = _objects()
    backward = (lambda loss: loss.backward()) if divided else (lambda loss: (loss / GA).backward())
    engine = FrameworkEngine(
        model, opt, sched, backward=backward, grad_accum_steps=GA, loss_divided=divided
    )
    guard = Guard(parse_policy(EXACT), engine=engine, run_dir=str(tmp_path))
    data = torch.utils.data.TensorDataset(_data())
    losses: list[float] = []
    for (x,) in guard.batches(guard.dataloader(data, 1, shuffle=False), max_steps=1):
        loss = model(x[0]).pow(2).mean()
        losses.append(float(loss))
        guard.backward(loss / GA if divided else loss)
        if guard.step() == "commit":
            sched.step()
            opt.zero_grad()
    guard.close()
    assert guard.loss == pytest.approx(sum(losses) / GA, rel=1e-6)
