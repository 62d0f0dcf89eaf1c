"""FSDP1 or FSDP2 on 2 gloo ranks with a plain ``torch.amp.GradScaler`` (tests/test_overflow.py).

A ``nan_grad`` fault on rank 1 overflows only that rank's local gradient shard. Every rank
writes, per step: the Guard's outcome, the loss scale after the step, and a checksum of its
local parameter shards, to ``$OUT/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from orchestrator import Guard, exit_process, load_policy


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fsdp", choices=["fsdp1", "fsdp2"], required=True)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model: torch.nn.Module
    if args.fsdp == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(net, device_id=torch.device("cpu"))
    else:
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(net)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = Guard(
        load_policy(), model=model, optimizer=opt, scaler=scaler, run_dir=os.environ["RUN_DIR"]
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    loader = guard.dataloader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    rows = []
    for xb, yb in guard.batches(loader, max_steps=args.steps):
        step = guard.global_step
        loss = (model(xb) - yb).pow(2).mean()
        guard.backward(loss)
        outcome = guard.step()
        with torch.no_grad():
            total = sum(float(local(p).double().sum()) for p in model.parameters())
        rows.append(
            {"step": step, "outcome": outcome, "scale": scaler.get_scale(), "params": total}
        )
    guard.close()
    with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
