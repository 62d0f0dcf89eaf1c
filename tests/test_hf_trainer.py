"""``transformers.Trainer`` under the Guard (orchestrator/integrations/hf.py), 2 ranks, gloo,
through examples/train_hf_trainer.py: the real Trainer with its own loader, gradient
accumulation 2, clipping, bf16 on CPU, evaluation every 4 steps, a tiny GPT-2 (dropout); 8
steps over 1.33 epochs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_supervisor import launch_cmd

from conftest import (
    REPO,
    assert_bitwise_equal,
    final_states,
    kinds,
    prequarantined,
    train,
    train_cmd,
)
from conftest import run as subprocess_run

pytestmark = pytest.mark.timeout(300)

SCRIPT = REPO / "examples" / "train_hf_trainer.py"
STEPS = 8
# GPT-2 has dropout: every replay must draw the masks the run it replays drew.
ARGS = ("--steps", str(STEPS), "--arch", "gpt2")
# LR kept after an incident, so a rolled-back run can end where a clean one does.
EXACT: dict[str, Any] = {"adjust": {"lr_factor": 1.0}, "snapshot": {"every_steps": 2}}


def run(run_dir: Path, *args: str, policy: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    r = train(run_dir, 2, *ARGS, *args, policy=policy, script=SCRIPT)
    assert r.returncode == 0, r.stdout[-4000:]
    states = final_states(run_dir)
    assert len(states) == 2
    # Replicas byte-identical at the end (weights and optimizer state).
    assert_bitwise_equal(states[0]["model"], states[1]["model"], "replicas: model")
    assert_bitwise_equal(states[0]["optim"], states[1]["optim"], "replicas: optimizer")
    return states


def test_a_healthy_guarded_run_is_trainer_alone_bit_for_bit(tmp_path: Path) -> None:
    plain = run(tmp_path / "plain", "--plain")
    guarded = run(tmp_path / "guarded", policy=EXACT)
    for rank, (a, b) in enumerate(zip(plain, guarded, strict=True)):
        # The losses, grad norms, LRs and epochs Trainer logged at every step, the weights
        # and the optimizer state.
        # One entry a step, an evaluation every 4 steps, then the summary.
        assert len(a["log_history"]) == STEPS + STEPS // 4 + 1
        assert [e["step"] for e in a["log_history"] if "eval_loss" in e] == [4, 8]
        for key in ("model", "optim", "log_history", "global_step"):
            assert_bitwise_equal(a[key], b[key], f"rank {rank} {key}")
        assert b["global_step"] == b["guard_step"] == STEPS
    assert not kinds(tmp_path / "guarded", "incident")


def sample_at(step: int, micro: int, rank: int, position: int = 1) -> int:
    """A sample ``rank`` runs in micro-batch ``micro`` of ``step`` (epoch 0, nothing
    quarantined), in Trainer's order: accelerate's seedable sampler (seed 0 + epoch), batches
    of 4, every other batch to each of the 2 ranks."""
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(0)).tolist()
    batch = (step * 2 + micro) * 2 + rank
    return int(perm[batch * 4 + position])


def test_a_poison_sample_is_quarantined_and_a_transient_nan_rolled_back(tmp_path: Path) -> None:
    bad = sample_at(step=3, micro=1, rank=1)
    faults = [
        {"kind": "poison_sample", "sample": bad},
        {"kind": "inf_loss", "step": 5, "rank": 0, "micro": 0},
    ]
    faulty = run(tmp_path / "faulty", policy={**EXACT, "faults": faults})
    poison, transient = kinds(tmp_path / "faulty", "incident")
    assert poison["step"] == 3 and poison["details"]["cause"] == "data"
    assert transient["step"] == 5 and transient["details"]["why"] == "not_reproduced"
    (q,) = kinds(tmp_path / "faulty", "quarantine")
    assert q["details"]["samples"] == [bad]
    assert [r["details"]["to_step"] for r in kinds(tmp_path / "faulty", "rollback")] == [2, 4]

    pre = prequarantined(tmp_path, [bad])
    clean = run(pre, policy=EXACT)
    assert not kinds(pre, "incident")
    for rank, (a, b) in enumerate(zip(clean, faulty, strict=True)):
        # Refused steps were never logged: the log is the clean run's, step for step.
        for key in ("model", "optim", "log_history"):
            assert_bitwise_equal(a[key], b[key], f"rank {rank} {key}")
        assert b["global_step"] == b["guard_step"] == STEPS


def test_a_sigkilled_rank_restarts_under_launch_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    plain = run(tmp_path / "plain", "--plain")
    d = tmp_path / "run"
    fast = {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5}
    # The crash waits for this rank's write of the step-4 snapshot.
    crash = {"kind": "crash", "step": 5, "rank": 1, "after_persist": True}
    policy = {**EXACT, "persist": {"every_steps": 2}, "supervisor": fast, "faults": [crash]}
    cmd, _ = train_cmd(d, 2, *ARGS, script=SCRIPT)
    r = subprocess_run(launch_cmd(d, policy, *cmd))
    assert r.returncode == 0, r.stdout[-4000:]
    (restart,) = kinds(d, "restart")
    assert restart["details"]["cause"] == "crash" and restart["step"] == 5, restart
    (resume,) = kinds(d, "resume")
    # Step 4's write is done on rank 1 when it dies; rank 0 may not have committed it yet.
    assert resume["attempt"] == 1 and resume["details"]["snapshot_step"] in (2, 4), resume
    for rank, (a, b) in enumerate(zip(plain, final_states(d), strict=True)):
        # Trainer's log too: its entries before the crash came back with the snapshot.
        for key in ("model", "optim", "log_history", "global_step"):
            assert_bitwise_equal(a[key], b[key], f"rank {rank} {key}")
        assert b["guard_step"] == STEPS


# In the full matrix (three attempts): the crash probe's own path is covered by default in
# tests/test_crashes.py; here it is driven from begin_step.
@pytest.mark.matrix
def test_a_sample_that_raises_in_trainer_s_forward_is_quarantined_within_3_attempts(
    tmp_path: Path,
) -> None:
    bad = sample_at(step=3, micro=1, rank=1)
    d = tmp_path / "run"
    fast = {"backoff_s": 0.2, "backoff_max_s": 0.5}
    policy = {**EXACT, "persist": {"every_steps": 2}, "supervisor": fast,
              "faults": [{"kind": "crash_sample", "sample": bad}]}  # fmt: skip
    cmd, _ = train_cmd(d, 2, *ARGS, script=SCRIPT)
    r = subprocess_run(launch_cmd(d, policy, *cmd))
    assert r.returncode == 0, r.stdout[-4000:]
    errors = [e for e in kinds(d, "loop_error") if e["attempt"] == 0 and e["rank"] == 1]
    assert errors and errors[0]["step"] == 3 and errors[0]["details"]["micro"] == 1
    assert bad in errors[0]["details"]["samples"]
    (inc,) = kinds(d, "incident")
    assert inc["details"]["reason"] == "crash" and inc["details"]["samples"] == [bad]
    states = final_states(d)
    assert all(s["global_step"] == s["guard_step"] == STEPS for s in states)


def test_guarded_makes_any_trainer_subclass_guarded_in_one_process(tmp_path: Path) -> None:
    from transformers import Trainer, TrainingArguments

    from orchestrator import UsageError, parse_policy
    from orchestrator.integrations.hf import GuardTrainerMixin, guarded

    sys.path.insert(0, str(SCRIPT.parent))
    from train_hf_trainer import Tokens, model

    class MyTrainer(Trainer):
        pass  # stands for SFTTrainer or any subclass

    cls = guarded(MyTrainer)
    assert cls.__name__ == "GuardedMyTrainer" and cls.__mro__[1:3] == (GuardTrainerMixin, MyTrainer)
    with pytest.raises(UsageError, match="Trainer subclass"):
        guarded(dict)

    def trainer(policy: dict[str, Any], where: str) -> Any:
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
            gradient_accumulation_steps=2, use_cpu=True, report_to=[], save_strategy="no",
            disable_tqdm=True,
        )  # fmt: skip
        run_dir = str(tmp_path / where)
        return cls(model=model(), args=args, train_dataset=Tokens(32),
                   guard_policy=parse_policy(policy), guard_run_dir=run_dir)  # fmt: skip

    t = trainer(EXACT, "run")
    with pytest.raises(UsageError, match="resumes by itself"):
        t.train(resume_from_checkpoint=str(tmp_path))
    t.train()
    assert t.state.global_step == t.guard.global_step == 3
    with pytest.raises(UsageError, match="Trainer clips"):
        trainer({**EXACT, "clip": {"max_norm": 1.0}}, "clipped").train()


# In the full matrix (two runs after Trainer alone's): the deferred stop is the default
# tests' code path up to the stop itself.
@pytest.mark.matrix
def test_a_preempted_run_resumes_bit_for_bit_with_the_same_command(tmp_path: Path) -> None:
    plain = run(tmp_path / "plain", "--plain")
    d = tmp_path / "run"
    policy = {**EXACT, "faults": [{"kind": "preempt", "step": 5, "rank": 1}]}
    r = train(d, 2, *ARGS, policy=policy, script=SCRIPT)
    assert r.returncode != 0, r.stdout[-3000:]
    # The stop agreed at step 5's check waits for Trainer to finish that step (its scheduler
    # step, counters and log): the snapshot is of step 6's start, the step held whole.
    (pre,) = kinds(d, "preempted")
    assert pre["details"]["persisted"] and pre["details"]["durable_step"] == 6
    resumed = run(d, policy=policy)  # the same command: resumes, the fault already fired
    (resume,) = kinds(d, "resume")
    assert resume["details"]["snapshot_step"] == 6
    for rank, (a, b) in enumerate(zip(plain, resumed, strict=True)):
        for key in ("model", "optim", "log_history", "global_step"):
            assert_bitwise_equal(a[key], b[key], f"rank {rank} {key}")
