"""On one CUDA GPU (skipped without): host syncs of a healthy step counted by CUDA itself
(``torch.cuda.set_sync_debug_mode``), the CUDA RNG saved and restored for the rank's own
device, and the fp32 forensic re-run inside the loop's own ``torch.autocast``.

Run: ``pytest tests/gpu/test_gpu_numerics.py`` on a GPU machine (about a minute).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _guard_run(run_dir: Path, scaled: bool, steps: int, count_from: int) -> tuple[int, list[str]]:
    """A single-process Guard run on cuda:0; the CUDA sync warnings of steps >= count_from
    inside guard.backward/step, and the outcomes."""
    from orchestrator import Guard, parse_policy

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda") if scaled else None
    policy = {
        "persist": {"enabled": False},
        "snapshot": {"every_steps": 1000},
        "metrics": {"update_ratio_every": 1, "every_steps": 1},
    }
    guard = Guard(
        parse_policy(policy), model=model, optimizer=opt, scaler=scaler, run_dir=str(run_dir)
    )
    x = torch.randn(512, 64)
    data = torch.utils.data.TensorDataset(x, x.sum(1))
    loader = guard.dataloader(data, batch_size=32, seed=1)
    syncs, outcomes = 0, []
    for xb, yb in guard.batches(loader, max_steps=steps):
        xb, yb = xb.to(dev, non_blocking=True), yb.to(dev, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.float16 if scaled else torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(xb).squeeze(-1).float(), yb)
        counting = guard.global_step >= count_from
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if counting:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                guard.backward(loss)
                outcomes.append(guard.step())
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if counting:
            syncs += sum("synchroniz" in str(w.message) for w in seen)
    guard.close()
    return syncs, outcomes


@pytest.mark.parametrize("scaled", [False, True], ids=["bf16-autocast", "fp16-grad-scaler"])
def test_a_healthy_step_syncs_once(tmp_path: Path, scaled: bool) -> None:
    syncs, outcomes = _guard_run(tmp_path / "run", scaled, steps=20, count_from=5)
    assert outcomes.count("commit") >= 15
    # The check's .tolist() (one D2H copy: one sync) per counted step; the scale read every
    # 50 steps and at overflow skips is the only other one (docs/loop.md).
    overflow = outcomes[5:].count("overflow_skip")
    assert syncs <= 15 + overflow, syncs


def test_cuda_rng_is_this_devices_only_and_restores_into_the_current_device() -> None:
    from orchestrator.rng import rng_state, set_rng_state

    torch.cuda.init()
    state = rng_state()
    assert isinstance(state["cuda"], torch.Tensor)
    assert state["cuda_device"] == torch.cuda.current_device()
    a = torch.rand(4, device="cuda")
    set_rng_state(state)
    assert torch.equal(torch.rand(4, device="cuda"), a)
    # An old-format state (one per device): the entry that moved is this rank's stream.
    old = {**state, "cuda": [state["cuda"]]}
    set_rng_state(old)
    assert torch.equal(torch.rand(4, device="cuda"), a)
