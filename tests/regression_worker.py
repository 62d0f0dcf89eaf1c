"""A regression net on data that holds real bad samples: targets of 3e38, whose squared error
overflows fp32 (nothing injected). One rank of the data-budget tests, under torchrun:

    torchrun --nproc-per-node 2 tests/regression_worker.py --engine ddp --poison 20

``--engine ddp|fsdp1|fsdp2|zero2`` (FSDP2 and ZeRO-2 in bf16, FSDP1 in fp32). ``--accum N``:
gradient accumulation over N micro-batches (DDP, FSDP1, FSDP2). ``--data guard|sampler|stream``:
the Guard's sampler (default), a ``DistributedSampler`` of the user's, or an endless
``IterableDataset`` with sample ids (both through torchdata's StatefulDataLoader); ``--workers N``
loader workers.
``--save-final DIR`` writes each rank's local state as plain tensors, and under DDP how many
gradient all-reduces ran (a comm hook counts).
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
from train_gpt import local_shards  # noqa: E402
from train_gpt_deepspeed import tensors_only  # noqa: E402

from orchestrator import Guard, exit_process, load_policy  # noqa: E402

POISON_TARGET = 3e38


class NoisyRegression(torch.utils.data.Dataset):
    """y = x . w + noise, with ``poison`` samples (chosen by a seeded permutation) whose
    target is 3e38."""

    def __init__(self, n: int, poison: int, dim: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, dim) + 0.1 * torch.randn(n, generator=g)
        self.poison = poison_ids(n, poison)
        self.y[self.poison] = POISON_TARGET

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class RegressionStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The same samples as an endless stream of ``(x, y, id)``: each pass is a permutation
    seeded by (3 + pass); rank r of W reads its ids r, r + W, ..., split over loader workers.
    It keeps no state of its own: a resume replays it up to the position."""

    def __init__(self, data: NoisyRegression, rank: int, world_size: int) -> None:
        self.data, self.rank, self.world_size = data, rank, world_size

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        for epoch in itertools.count():
            ids = stream_order(len(self.data), epoch, self.rank, self.world_size)
            for i in ids[worker::workers]:
                x, y = self.data[i]
                yield x, y, i


def stream_order(n: int, epoch: int, rank: int, world_size: int) -> list[int]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(3 + epoch))
    return order[rank::world_size].tolist()


def user_sampler(n: int, rank: int) -> torch.utils.data.DistributedSampler:  # type: ignore[type-arg]
    data = range(n)
    return torch.utils.data.DistributedSampler(
        data, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True
    )


ALLREDUCES = [0]


def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    """DDP's own all-reduce of a gradient bucket, counted. (Unannotated: DDP checks the
    annotations at run time, and this module's are strings.)"""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ALLREDUCES[0] += 1
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]


def poison_ids(n: int, count: int) -> list[int]:
    return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(123))[:count].tolist())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("ddp", "fsdp1", "fsdp2", "zero2"), default="ddp")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--poison", type=int, default=0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--accum", type=int, default=None)
    ap.add_argument("--data", choices=("guard", "sampler", "stream"), default="guard")
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--save-final")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if "RANK" not in os.environ:  # started as one plain process, not by torchrun
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    kw: dict[str, Any] = {}
    if args.engine == "zero2":
        import deepspeed

        opt_params: dict[str, Any] = {"lr": args.lr}
        if args.optimizer == "adamw":
            opt_params["torch_adam"] = True  # bit-for-bit replays on CPU (train_gpt_deepspeed)
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={
                "train_micro_batch_size_per_gpu": args.batch_size,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": args.optimizer.upper(), "params": opt_params},
            },
        )
        module: Any = engine
        kw["engine"] = engine
    else:
        if args.engine == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mp_policy=mp)
            module = fully_shard(model, mp_policy=mp)
        elif args.engine == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            # fp32: FSDP1's bf16 MixedPrecision on CPU hands AdamW bf16 gradients here.
            module = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        else:
            module = nn.parallel.DistributedDataParallel(model)
            module.register_comm_hook(None, counting_allreduce)
        opt_cls = torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD
        kw.update(model=module, optimizer=opt_cls(module.parameters(), lr=args.lr))

    guard = Guard(load_policy(), grad_accum_steps=args.accum, **kw)
    data = NoisyRegression(args.samples, args.poison)
    workers = {"num_workers": args.workers}
    if args.data == "stream":
        stream = RegressionStream(data, rank, dist.get_world_size())
        loader = guard.dataloader(stream, args.batch_size, sample_id=2, **workers)
    elif args.data == "sampler":
        sampler = user_sampler(len(data), rank)
        loader = guard.dataloader(data, args.batch_size, sampler=sampler, **workers)
    else:
        loader = guard.dataloader(data, args.batch_size, seed=3, **workers)
    for batch in guard.batches(loader, max_steps=args.steps):
        x, y = batch[0], batch[1]
        if args.engine == "zero2":
            x = x.bfloat16()  # DeepSpeed's bf16 module takes bf16 inputs (no autocast)
        loss = F.mse_loss(module(x).squeeze(-1).float(), y)
        guard.backward(loss)
        guard.step(loss)
    guard.close()

    if args.save_final:
        if args.engine == "zero2":
            state = {
                "zero": tensors_only(engine.optimizer.state_dict()),
                "module": tensors_only(engine.module.state_dict()),
            }
        else:
            opt = kw["optimizer"]
            state = {
                "model": local_shards(model.state_dict()),
                "optim": local_shards(opt.state_dict()),
            }
        os.makedirs(args.save_final, exist_ok=True)
        torch.save({**state, "step": guard.global_step}, f"{args.save_final}/rank{rank}.pt")
        with open(f"{args.save_final}/allreduces{rank}.txt", "w") as f:
            f.write(str(ALLREDUCES[0]))
    dist.barrier()
    return 0


if __name__ == "__main__":
    exit_process(main())
