"""A small GPT on synthetic tokens, trained under the Guard.

Runs unchanged as ``python examples/train_gpt.py`` or
``torchrun --nproc-per-node 2 examples/train_gpt.py`` (gloo on CPU, NCCL on GPU).

``--demo`` injects a transient NaN gradient (step 37, last rank) and a poisoned sample so
you can watch detect -> isolate -> quarantine -> roll back -> adjust -> resume.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from orchestrator import (
    Guard,
    PolicyError,
    exit_process,
    load_policy,
    parse_policy,
    read_journal,
)


class SyntheticTokens(torch.utils.data.Dataset):
    """Sample i: an arithmetic progression mod ``vocab`` with a start and stride drawn from
    a generator seeded by i. Deterministic, learnable, nothing downloaded."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(i)
        start = int(torch.randint(self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int, seq_len: int, d: int, layers: int, heads: int, ckpt: bool = False
    ) -> None:
        super().__init__()
        self.ckpt = ckpt  # activation checkpointing: recompute each block in backward
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq_len, d))
        self.blocks = nn.ModuleList(Block(d, heads, dropout=0.1) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        mask = self.mask[: idx.shape[1], : idx.shape[1]]
        for block in self.blocks:
            if self.ckpt and self.training:
                x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False)
            else:
                x = block(x, mask)
        return self.head(self.ln(x))


def demo_policy(world_size: int):  # type: ignore[no-untyped-def]
    return parse_policy(
        {
            "faults": [
                {"kind": "nan_grad", "step": 37, "rank": world_size - 1},
                {"kind": "poison_sample", "sample": 123},
            ]
        },
        source="<demo>",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--policy", help="policy YAML (default: $ORCHESTRATOR_POLICY or defaults)")
    ap.add_argument("--demo", action="store_true", help="inject a NaN and a poisoned sample")
    ap.add_argument("--run-dir", help="default: $ORCHESTRATOR_RUN_DIR or ./runs/<time>-<pid>")
    ap.add_argument("--save-final", help="directory for rank<r>.pt with the final state")
    ap.add_argument(
        "--fsdp", action="store_true", help="shard with FSDP2 (fully_shard), bf16 compute"
    )
    ap.add_argument("--fsdp1", action="store_true", help="shard with FSDP1, bf16 compute")
    ap.add_argument("--act-ckpt", action="store_true", help="activation checkpointing")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # entry point: ours to set
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)

    vocab = 64
    torch.manual_seed(0)  # same initial weights on every rank
    model: nn.Module = TinyGPT(
        vocab, args.seq_len, args.d_model, args.layers, heads=4, ckpt=args.act_ckpt
    ).to(device)
    if (args.fsdp or args.fsdp1) and world == 1:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    if args.fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        model = FullyShardedDataParallel(
            model,
            device_id=device,
            mixed_precision=MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
            ),
        )
    elif args.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    elif world > 1:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = 20
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    torch.manual_seed(1234 + rank)  # per-rank dropout streams

    try:
        policy = demo_policy(world) if args.demo else load_policy(args.policy)
        guard = Guard(policy, model=model, optimizer=opt, scheduler=sched, run_dir=args.run_dir)
    except PolicyError as err:  # a policy that cannot be met: say why, no traceback
        print(f"[rank {rank}] {err}", file=sys.stderr)
        return 2
    loader = guard.dataloader(
        SyntheticTokens(args.samples, args.seq_len, vocab), batch_size=args.batch_size, seed=7
    )
    for batch in guard.batches(loader, max_steps=args.steps):
        batch = batch.to(device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
        guard.backward(loss)
        outcome = guard.step()
        if rank == 0 and outcome == "commit" and guard.global_step % 25 == 0:
            print(f"step {guard.global_step:4d}  loss {loss.item():.4f}", flush=True)
    guard.close()

    if args.save_final:
        os.makedirs(args.save_final, exist_ok=True)
        torch.save(
            {
                "model": local_shards(
                    dict(model.named_parameters())  # FSDP1: the local flat shards
                    if args.fsdp1
                    else getattr(model, "module", model).state_dict()
                ),
                "optim": local_shards(opt.state_dict()),
                "step": guard.global_step,
            },
            os.path.join(args.save_final, f"rank{rank}.pt"),
        )
    if rank == 0:
        events = list(read_journal(guard.run_dir))
        kinds = [e["kind"] for e in events]
        print(
            f"\ndone: {guard.global_step} steps, {len(guard.incidents)} incident(s), "
            f"{guard.rollbacks} rollback(s), "
            f"{kinds.count('snapshot')} snapshots; journal: {guard.run_dir}/journal/"
        )
    return 0


def local_shards(tree):  # type: ignore[no-untyped-def]
    """This rank's shards of a (possibly FSDP2/DTensor) state dict, as plain tensors."""
    if isinstance(tree, dict):
        return {k: local_shards(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [local_shards(v) for v in tree]
    if hasattr(tree, "to_local"):
        tree = tree.to_local()
    if isinstance(tree, torch.Tensor):  # plain tensors (not FlatParameter): weights_only loads
        return torch.empty_like(tree, requires_grad=False).copy_(tree.detach())
    return tree


if __name__ == "__main__":
    # Exits with main()'s code (a RunStop's included); a plain return after guard.close()
    # would end the run as safely (the Guard fences gloo at exit: docs/loop.md).
    exit_process(main())
