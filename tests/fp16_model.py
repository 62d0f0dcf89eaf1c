"""A tiny fp16 model under the Guard (DDP on 2 gloo ranks) for the precision forensics test.

With ``--big``, sample 77's inputs are large enough that a squared activation passes
fp16's 65,504 (inf in fp16, fine in fp32); the policy may poison other samples.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from orchestrator import Guard, exit_process, load_policy

BIG = 77


class Data(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, big: bool) -> None:
        self.big = big

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        if self.big and i == BIG:
            x = x * 3000.0
        return x, x.sum().reshape(1) / 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 32)
        self.out = torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h * h / 32)  # squared activations: a large input overflows fp16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(Net().half())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = Guard(load_policy(), model=model, optimizer=opt, run_dir=os.environ["RUN_DIR"])
    loader = guard.dataloader(Data(args.big), batch_size=8)
    for x, y in guard.batches(loader, max_steps=args.steps):
        dtype = next(model.parameters()).dtype  # fp32 during the forensics fp32 re-run
        loss = (model(x.to(dtype)).float() - y).pow(2).mean()
        guard.backward(loss)
        guard.step()
    guard.close()
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
