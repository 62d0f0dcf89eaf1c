"""``transformers.Trainer`` under the Guard (orchestrator/integrations/hf.py), 2 ranks, gloo,
through examples/train_hf_trainer.py: the real Trainer with its own loader, gradient
accumulation 2, clipping, bf16 on CPU, a tiny Llama; 8 steps over 1.33 epochs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, assert_bitwise_equal, final_states, kinds, prequarantined, train

pytestmark = pytest.mark.timeout(300)

SCRIPT = REPO / "examples" / "train_hf_trainer.py"
STEPS = 8
# LR kept after an incident, so a rolled-back run can end where a clean one does.
EXACT: dict[str, Any] = {"adjust": {"lr_factor": 1.0}, "snapshot": {"every_steps": 2}}


def run(run_dir: Path, *args: str, policy: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    r = train(run_dir, 2, "--steps", str(STEPS), *args, policy=policy, script=SCRIPT)
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
        assert len(a["log_history"]) == STEPS + 1  # one entry a step, then the summary
        for key in ("model", "optim", "log_history", "global_step"):
            assert_bitwise_equal(a[key], b[key], f"rank {rank} {key}")
        assert b["global_step"] == b["guard_step"] == STEPS
    assert not kinds(tmp_path / "guarded", "incident")
