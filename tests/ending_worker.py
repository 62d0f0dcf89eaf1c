"""One rank of the ending tests (tests/test_ending.py): a tiny loop under the Guard that ends
the way most scripts end, ``guard.close()`` then a plain return (no ``exit_process``):

    torchrun --nproc-per-node 2 tests/ending_worker.py --engine fsdp1

``--engine ddp|fsdp1|fsdp2|zero2`` (gloo, CPU; ZeRO-2 in bf16). ``--late-collective``: the
deterministic form of the abort at exit. Rank 0 leaves an all-reduce in flight on a tensor it
lets go of; rank 1 joins it only once rank 0 is in its last ``atexit`` handler, which holds the
GIL (C code, no bytecode) into interpreter finalization. Rank 0's gloo worker thread then
frees the tensor while the GIL is held and finalization starts: without the Guard's exit
fence, SIGABRT.
"""

from __future__ import annotations

import atexit
import functools
import sys
from typing import Any

# Registered before anything else registers one: atexit runs handlers last in, first out, so
# these two run last, after the Guard's: rank 0 says it is exiting, then holds the GIL.
_STORE: list[Any] = []


def _say_rank0_is_exiting() -> None:
    if _STORE:
        _STORE[0].set("rank0_exiting", "1")


if "--late-collective" in sys.argv:
    atexit.register(functools.partial(sum, range(15_000_000)))  # ~0.3 s of C code, GIL held
    atexit.register(_say_rank0_is_exiting)

import argparse  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from orchestrator import Guard, parse_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("ddp", "fsdp1", "fsdp2", "zero2"), default="ddp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--late-collective", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    kw: dict[str, Any] = {}
    if args.engine == "zero2":
        import deepspeed

        module, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={
                "train_micro_batch_size_per_gpu": 8,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            },
        )
        kw["engine"] = module
    else:
        if args.engine == "fsdp1":
            from torch.distributed.fsdp import FullyShardedDataParallel

            module = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        elif args.engine == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            module = fully_shard(model)
        else:
            module = nn.parallel.DistributedDataParallel(model)
        kw.update(model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3))
    guard = Guard(parse_policy({"persist": {"enabled": False}}), **kw)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256))
    for x, y in guard.batches(guard.dataloader(data, batch_size=8), max_steps=args.steps):
        if args.engine == "zero2":
            x = x.bfloat16()  # DeepSpeed's bf16 module takes bf16 inputs (no autocast)
        guard.backward(F.mse_loss(module(x).squeeze(-1).float(), y))
        guard.step()
    guard.close()

    if args.late_collective:
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            _STORE.append(store)
            dist.all_reduce(torch.ones(1000), async_op=True)  # neither work nor tensor kept
        else:
            store.wait(["rank0_exiting"])
            dist.all_reduce(torch.ones(1000))


if __name__ == "__main__":
    main()
