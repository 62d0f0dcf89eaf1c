"""The factory's parts alone: a component built from a context and its own policy section,
a clock injected through the context, and the teardown of a start that failed part way."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from inproc import events

from orchestrator.check import StepCheck
from orchestrator.comm import Comm
from orchestrator.context import Clock, Context
from orchestrator.durable import DurableTier
from orchestrator.engines import engine_for
from orchestrator.factory import Teardown
from orchestrator.heartbeat import Heartbeat
from orchestrator.policy import DetectPolicy, PersistPolicy
from orchestrator.tuning import Intervals

pytestmark = pytest.mark.timeout(60)


def _check(ctx: Context, detect: DetectPolicy) -> tuple[StepCheck, torch.nn.Module]:
    """A StepCheck and what it needs, from ``ctx`` and sections alone (no Policy)."""
    model = torch.nn.Linear(3, 1)
    engine = engine_for(model, torch.optim.SGD(model.parameters(), lr=0.1), None, None, None, None)
    durable = DurableTier(
        ctx,
        PersistPolicy(enabled=False),
        engine,
        lambda kind, **details: ctx.decide(kind, 0, **details),
        intervals=Intervals(1, None),
        policy_digest="test",
    )
    heartbeat = Heartbeat(ctx.run_dir, 0, ctx.attempt, 60.0)
    return StepCheck(ctx, detect, engine, durable, heartbeat), model


def test_a_step_check_is_built_from_a_context_and_its_detect_section_alone(
    tmp_path: Path,
) -> None:
    ctx = Context.open(Comm(None), str(tmp_path), attempt=0)
    check, model = _check(ctx, DetectPolicy())
    loss = model(torch.ones(2, 3)).sum()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    ok = check.run(0, loss.detach(), grads, stop_requested=False)
    assert ok.reason is None and ok.loss == pytest.approx(float(loss.detach()))
    assert math.isclose(ok.grad_norm, float(torch.cat([g.flatten() for g in grads]).norm()))
    bad = check.run(1, torch.tensor(float("nan")), grads, stop_requested=True)
    assert bad.reason == "nonfinite_loss" and bad.stop
    # Its decisions go to the context's journal, rank 0 writing them.
    zero = [torch.zeros_like(g) for g in grads]
    with pytest.warns(UserWarning):
        check.run(2, torch.tensor(1.0), zero, stop_requested=False)
    ctx.journal.close()
    assert [e["step"] for e in events(tmp_path, "zero_gradients")] == [2]


def test_the_context_clock_is_injectable(tmp_path: Path) -> None:
    now = [100.0]
    clock = Clock(monotonic=lambda: now[0], wall=lambda: 5.0)
    ctx = Context.open(Comm(None), str(tmp_path), attempt=3, clock=clock)
    now[0] += 2.5
    assert (ctx.clock.monotonic(), ctx.clock.wall()) == (102.5, 5.0)
    assert (ctx.run_dir, ctx.attempt, ctx.decide.writer) == (str(tmp_path), 3, True)
    ctx.journal.close()


def test_a_failed_start_closes_what_it_built_newest_first_despite_a_failure() -> None:
    closed: list[str] = []
    teardown = Teardown()
    teardown.add(lambda: closed.append("engine"))
    teardown.add(lambda: closed.append("journal"))

    def fails() -> None:
        closed.append("durable")
        raise OSError("disk gone")

    teardown.add(fails)
    teardown.add(lambda: closed.append("heartbeat"))
    teardown.run()
    assert closed == ["heartbeat", "durable", "journal", "engine"]
    teardown.run()  # twice: nothing is closed again
    assert len(closed) == 4
