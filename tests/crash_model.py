"""A tiny token model (DDP on 2 gloo ranks) whose data holds one sample with a token id past
the vocabulary: its forward raises IndexError in nn.Embedding at the same step of every
attempt, as a corrupt shard of a real data set would (orchestrator/crashes.py)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from orchestrator import Guard, exit_process, load_policy

VOCAB = 37  # odd on purpose


class Tokens(Dataset[torch.Tensor]):
    def __init__(self, bad: int | None) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, VOCAB, (512, 17), generator=g)
        if bad is not None:
            self.data[bad, 5] = VOCAB + 3  # the corrupt token

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bad", type=int)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, VOCAB))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = Guard(load_policy(), model=model, optimizer=opt)
    loader = guard.dataloader(Tokens(args.bad), batch_size=8, shuffle=True, seed=3)
    for tokens in guard.batches(loader, max_steps=args.steps):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )
        guard.backward(loss)
        guard.step()
    guard.close()
    dist.barrier()


if __name__ == "__main__":
    main()
    exit_process(0)
