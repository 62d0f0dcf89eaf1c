"""A model broken from a given step, under a GradScaler (DDP on 2 gloo ranks): its loss
stays finite while every gradient is NaN (d sqrt(x)/dx at 0 is inf, times 0), so the scaler
skips every step as an overflow. The Guard must call that an incident, not business as
usual (orchestrator/check.py, detect.overflow)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from orchestrator import Guard, exit_process, load_policy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--broken-from", type=int, default=20)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    guard = Guard(
        load_policy(), model=model, optimizer=opt, scaler=scaler, run_dir=os.environ["RUN_DIR"]
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    loader = guard.dataloader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    for xb, yb in guard.batches(loader, max_steps=args.steps):
        out = model(xb)
        loss = (out - yb).pow(2).mean()
        if guard.global_step >= args.broken_from:  # the model breaks: finite loss, NaN grads
            loss = loss + (out * 0).abs().sqrt().sum() * 0
        guard.backward(loss)
        guard.step()
    guard.close()
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
