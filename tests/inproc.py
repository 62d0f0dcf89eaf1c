"""In-process training loop for single-process Guard tests (no torch.distributed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from orchestrator import Guard, parse_policy, read_journal


class Regression(Dataset):
    """y = x . w + noise; sample ``spike`` gets a huge target (a 'bad label')."""

    def __init__(self, n: int = 256, spike: int | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.arange(8.0) + 0.1 * torch.randn(n, generator=g)
        if spike is not None:
            self.y[spike] = 1e4

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def train(
    run_dir: Path,
    policy: dict[str, Any],
    steps: int = 40,
    dataset: Dataset | None = None,
    scaler: torch.amp.GradScaler | None = None,
    clip_by_hand: float | None = None,
    grad_accum_steps: int | None = None,
) -> tuple[Guard, dict[str, Any], list[str]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    guard = Guard(
        parse_policy(policy),
        model=model,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        run_dir=str(run_dir),
        grad_accum_steps=grad_accum_steps,
    )
    loader = guard.dataloader(dataset or Regression(), batch_size=8, seed=1)
    outcomes = []
    for x, y in guard.batches(loader, max_steps=steps):
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        guard.backward(loss)
        if clip_by_hand is not None:
            if scaler is not None:
                scaler.unscale_(opt)  # the documented way to clip under a GradScaler
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_by_hand)
        outcomes.append(guard.step(loss))
    guard.close()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    if scaler is not None:
        state["scale"] = scaler.get_scale()
    return guard, state, outcomes


def events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_journal(str(run_dir)) if e["kind"] == kind]
