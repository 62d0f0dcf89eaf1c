"""The Guard in one process (no torch.distributed): API contract, scaler, spikes, window
quarantine, memory budget. Multi-rank behaviour is in test_ddp_e2e.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from inproc import Regression, events, train

from conftest import assert_bitwise_equal
from orchestrator import Guard, PolicyError, UsageError, parse_policy
from orchestrator.data import GuardBatchSampler

pytestmark = pytest.mark.timeout(120)


EXACT = {"adjust": {"lr_factor": 1.0}, "quarantine": {"enabled": False}}


def test_single_process_inf_loss_rollback_is_bit_for_bit(tmp_path: Path) -> None:
    _, clean, _ = train(tmp_path / "clean", EXACT)
    faulty = {**EXACT, "faults": [{"kind": "inf_loss", "step": 23}]}
    guard, state, outcomes = train(tmp_path / "faulty", faulty)
    assert outcomes.count("incident") == 1 and guard.rollbacks == 1
    (inc,) = events(tmp_path / "faulty", "incident")
    assert inc["details"]["reason"] == "nonfinite_loss" and inc["details"]["per_rank"] == [
        {"loss": True, "grads": False}
    ]
    assert_bitwise_equal(clean, state)


def test_rerun_after_restart_does_not_refire_one_shot_fault(tmp_path: Path) -> None:
    faulty = {**EXACT, "faults": [{"kind": "nan_grad", "step": 5}]}
    train(tmp_path / "run", faulty, steps=10)
    guard, _, outcomes = train(tmp_path / "run", faulty, steps=10)  # same run dir
    assert "incident" not in outcomes and not guard.incidents


def test_api_misuse_says_what_to_do(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(parse_policy({}), model=model, optimizer=opt, run_dir=str(tmp_path))
    try:
        loader = guard.dataloader(Regression(), batch_size=4)
        batches = guard.batches(loader, max_steps=5)
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        with pytest.raises(UsageError, match=r"needs guard\.backward"):
            guard.step(loss)
        guard.backward(loss)
        with pytest.raises(UsageError, match="twice for one batch"):
            guard.backward(loss)
        with pytest.raises(UsageError, match=r"DataLoader returned by guard\.dataloader"):
            next(guard.batches(torch.utils.data.DataLoader(Regression()), max_steps=1))
    finally:
        guard.close(persist=False)  # and give the test process its signal handlers back


def test_step_refuses_a_loss_backward_did_not_see(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(parse_policy({}), model=model, optimizer=opt, run_dir=str(tmp_path))
    try:
        loader = guard.dataloader(Regression(), batch_size=4)
        outcomes = []
        for x, y in guard.batches(loader, max_steps=2):
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            guard.backward(loss)
            if guard.global_step == 0:
                with pytest.raises(UsageError, match=r"another tensor than guard\.backward"):
                    guard.step(loss.detach() * 2)
                outcomes.append(guard.step(loss))  # the same tensor is accepted
            else:
                outcomes.append(guard.step())
        assert outcomes == ["commit", "commit"] and guard.global_step == 2
    finally:
        guard.close(persist=False)


def test_ring_that_cannot_fit_fails_at_start(tmp_path: Path) -> None:
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.Adam(model.parameters())
    policy = parse_policy({"snapshot": {"keep": 3, "max_host_memory_gb": 0.01}})
    with pytest.raises(PolicyError, match=r"snapshot.keep=3 needs .* snapshot.max_host_memory_gb"):
        Guard(policy, model=model, optimizer=opt, run_dir=str(tmp_path))


def test_spike_is_isolated_to_its_sample(tmp_path: Path) -> None:
    # The samples of step 25: what guard.dataloader(Regression(), batch_size=8, seed=1) yields.
    step_ids = GuardBatchSampler(256, 8, rank=0, world_size=1, seed=1).batch_at(0, 25 * 8)[0]
    policy = {
        "detect": {"spike": {"enabled": True, "window": 16, "min_history": 8, "zscore": 8.0}},
        "adjust": {"lr_factor": 0.5},
    }
    guard, _, outcomes = train(tmp_path / "run", policy, dataset=Regression(spike=step_ids[3]))
    assert outcomes.count("incident") == 1
    (inc,) = events(tmp_path / "run", "incident")
    assert inc["step"] == 25 and inc["details"]["reason"] == "spike_loss"
    (q,) = events(tmp_path / "run", "quarantine")
    # Re-run like a NaN: only the sample whose loss alone clears the bar (its bad label).
    assert q["details"]["samples"] == [step_ids[3]]
    assert inc["details"]["cause"] == "data" and inc["details"]["why"] == "isolated"
    assert guard.global_step == 40


def test_window_scope_quarantines_preceding_steps(tmp_path: Path) -> None:
    policy = {
        "quarantine": {"scope": "window", "window_steps": 2},
        "faults": [{"kind": "inf_loss", "step": 12}],
    }
    guard, _, _ = train(tmp_path / "run", policy, steps=20)
    (q,) = events(tmp_path / "run", "quarantine")
    assert len(q["details"]["samples"]) == 3 * 8  # steps 10, 11 and 12
    assert set(q["details"]["samples"]) == set(guard.quarantined)


def test_grad_scaler_overflow_is_skipped_and_incident_cuts_scale(tmp_path: Path) -> None:
    # An absurd initial scale overflows the scaled gradients: the scaler skips those steps.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    policy = {**EXACT, "faults": [{"kind": "inf_loss", "step": 20}]}
    guard, _, outcomes = train(tmp_path / "run", policy, scaler=scaler, steps=30)
    assert outcomes[0] == "overflow_skip" and "commit" in outcomes
    assert outcomes.count("incident") == 1  # only the non-finite loss is an incident
    (adj,) = events(tmp_path / "run", "adjust")
    assert adj["details"]["loss_scale_factor"] == 0.5
    assert guard.global_step == 30


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "grad-scaler"])
def test_policy_clip_equals_clipping_by_hand(tmp_path: Path, scaled: bool) -> None:
    """clip.max_norm clips by the check's norm as clip_grad_norm_ would; clipping by hand
    (after the loop's own scaler.unscale_, which the Guard must not repeat) matches it."""

    def scaler() -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None

    _, unclipped, _ = train(tmp_path / "none", EXACT, scaler=scaler())
    clipped = {**EXACT, "clip": {"max_norm": 0.5}}
    _, by_policy, outcomes = train(tmp_path / "policy", clipped, scaler=scaler())
    _, by_hand, _ = train(tmp_path / "hand", EXACT, scaler=scaler(), clip_by_hand=0.5)
    assert set(outcomes) == {"commit"}
    for name, value in by_policy["model"].items():
        torch.testing.assert_close(value, by_hand["model"][name], rtol=1e-5, atol=1e-7)
        assert not torch.allclose(value, unclipped["model"][name]), name


@pytest.mark.parametrize("rerun", [False, True], ids=["isolation", "isolation+forensics"])
def test_a_bad_sample_is_explained_by_data_and_keeps_the_lr(tmp_path: Path, rerun: bool) -> None:
    """A real bad sample (a target whose squared error overflows) is isolated, quarantined
    and charged to the data budget, with the LR kept, whether or not diagnose.rerun is on."""
    data = Regression()
    data.y[37] = 3e38
    guard, _, outcomes = train(tmp_path / "run", {"diagnose": {"rerun": rerun}}, dataset=data)
    assert "incident" in outcomes and guard.adjuster.multiplier() == 1.0
    (inc,) = events(tmp_path / "run", "incident")
    assert (inc["details"]["cause"], inc["details"]["why"], inc["details"]["budget"]) == (
        "data",
        "isolated",
        "data",
    )
    (q,) = events(tmp_path / "run", "quarantine")
    assert q["details"]["samples"] == [37] and q["details"]["total"] == 1
    assert [e["details"]["phase"] for e in events(tmp_path / "run", "adjust")] == ["kept"]


def _guard(tmp_path: Path, policy: dict | None = None, **kw: object) -> tuple[Guard, Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        parse_policy(policy or {}), model=model, optimizer=opt, run_dir=str(tmp_path), **kw
    )  # type: ignore[arg-type]
    return guard, model, opt


def test_an_optimizer_step_outside_the_guard_is_refused(tmp_path: Path) -> None:
    guard, model, opt = _guard(tmp_path)
    loader = guard.dataloader(Regression(), batch_size=4)
    with pytest.raises(UsageError, match=r"optimizer\.step\(\) was called outside the Guard"):
        for x, y in guard.batches(loader, max_steps=3):
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            guard.backward(loss)
            opt.step()  # doubles every update if it went through
    guard.close(persist=False)
    opt.step()  # a closed Guard lets go of the optimizer


def test_zeroed_gradients_at_the_check_are_said_once(tmp_path: Path) -> None:
    guard, model, opt = _guard(tmp_path)
    loader = guard.dataloader(Regression(), batch_size=4)
    with pytest.warns(UserWarning, match="gradient norm is exactly 0.0 at step 0"):
        for x, y in guard.batches(loader, max_steps=3):
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            guard.backward(loss)
            opt.zero_grad()  # the loop's old habit: the check would see nothing
            guard.step()
    guard.close()
    assert [e["step"] for e in events(tmp_path, "zero_gradients")] == [0]


def test_a_scheduler_not_given_to_the_guard_is_warned_about(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    with pytest.warns(UserWarning, match=r"not passed to the Guard.*Guard\(scheduler=\.\.\.\)"):
        guard = Guard(parse_policy({}), model=model, optimizer=opt, run_dir=str(tmp_path))
    guard.close(persist=False)


def test_effective_lr_loss_and_grad_norm_are_readable(tmp_path: Path) -> None:
    policy = {"adjust": {"lr_factor": 0.5}, "faults": [{"kind": "inf_loss", "step": 4}]}
    guard, model, opt = _guard(tmp_path, policy)
    loader = guard.dataloader(Regression(), batch_size=4)
    assert guard.loss is None and guard.grad_norm is None and guard.lr == pytest.approx(0.1)
    seen = []
    for x, y in guard.batches(loader, max_steps=6):
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        guard.backward(loss)
        if guard.step() == "commit":
            seen.append((loss.item(), guard.loss, guard.grad_norm))
    guard.close()
    assert all(a == pytest.approx(b) and g is not None and g > 0 for a, b, g in seen)
    # After the incident the LR in param_groups is the scheduler's; the effective one is cut.
    assert opt.param_groups[0]["lr"] == 0.1 and guard.lr == pytest.approx(0.05)


FORGETS_CLOSE = """
import sys, torch
sys.path.insert(0, {tests!r})
from inproc import Regression
from orchestrator import Guard, parse_policy
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
guard = Guard(parse_policy({{"metrics": {{"flush_every": 1000}}}}), model=model, optimizer=opt,
              run_dir={run_dir!r})
for x, y in guard.batches(guard.dataloader(Regression(), batch_size=4), max_steps=5):
    guard.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
    guard.step()
{ending}
"""


@pytest.mark.parametrize("ending", ["", "import orchestrator; orchestrator.exit_process(0)"])
def test_a_forgotten_close_still_ends_the_run_record(tmp_path: Path, ending: str) -> None:
    code = FORGETS_CLOSE.format(
        tests=str(Path(__file__).parent), run_dir=str(tmp_path), ending=ending
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    (end,) = events(tmp_path, "run_end")
    assert end["details"]["status"] == "not_closed" and end["step"] == 5
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [0, 1, 2, 3, 4]  # flushed at exit
    assert "guard.close() was not called" in r.stderr


def _train_to(guard: Guard, model: Any, steps: int) -> None:
    for x, y in guard.batches(guard.dataloader(Regression(), batch_size=4), max_steps=steps):
        guard.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
        guard.step()
    guard.close()


def test_a_finished_run_says_so_and_fresh_starts_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = {"persist": {"every_steps": 2}}
    guard, model, _ = _guard(tmp_path, policy)
    _train_to(guard, model, 4)
    guard, model, _ = _guard(tmp_path, policy)  # the same run started again
    with caplog.at_level("WARNING", logger="orchestrator.lifecycle"):
        _train_to(guard, model, 4)
    assert guard.global_step == 4 and [e["step"] for e in events(tmp_path, "resume")] == [4]
    assert "already at step 4 (max_steps=4): nothing to train" in caplog.text

    guard, model, _ = _guard(tmp_path, policy, fresh=True)  # a new run in the used directory
    assert guard.global_step == 0
    _train_to(guard, model, 3)
    assert (
        not events(tmp_path, "resume") and events(tmp_path, "run_end")[0]["details"]["steps"] == 3
    )
    (archived,) = (tmp_path / "archive").iterdir()  # the earlier run's files, all kept
    assert (archived / "snapshots" / "step_000000004" / "COMMITTED").exists()
    assert len(events(archived, "run_end")) == 2
