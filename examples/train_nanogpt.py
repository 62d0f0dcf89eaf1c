"""nanoGPT's ``train.py`` under the Guard (docs/nanogpt.md walks through the change).

Synthetic tokens are written to ``train.bin``/``val.bin`` (uint16 ``np.memmap``, as
nanoGPT's ``prepare.py`` writes them) in a temporary folder: nothing is downloaded. Runs as
``python examples/train_nanogpt.py`` or ``torchrun --nproc-per-node 2
examples/train_nanogpt.py`` (gloo on CPU, NCCL on GPU).

What is nanoGPT's and what changed: the model, the AdamW, the cosine LR set by hand each
iteration, gradient accumulation, clipping and the evaluation are its own; ``get_batch``
became a :class:`WindowDataset` with a :class:`RandomOffsetSampler` (a window's id is its
offset); ``iter_num`` became ``guard.global_step``; ``best_val_loss`` is a :class:`Value`
in every snapshot; ``require_backward_grad_sync``, the ``ckpt.pt`` resume and the local
micro-step loop are gone. ``--demo`` injects a transient NaN and a poisoned window.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from orchestrator import Guard, PolicyError, Value, exit_process, load_policy, parse_policy
from orchestrator.samplers import RandomOffsetSampler, TokenStreamSampler, WindowDataset


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model, cut to the bone: ``model(idx, targets) -> (logits, loss)``."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT
        for m in self.modules():  # nanoGPT's init
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def write_tokens(data_dir: str, n_tokens: int, vocab_size: int) -> None:
    """``train.bin`` and ``val.bin`` as nanoGPT's prepare.py writes them: arithmetic runs
    with random tokens among them (learnable, and noisy as text is), deterministic."""
    for split, seed, n in (("train", 0, n_tokens), ("val", 1, max(n_tokens // 10, 1024))):
        rng = np.random.default_rng(seed)
        runs = np.cumsum(rng.integers(1, 4, n)) % vocab_size
        noise = rng.integers(0, vocab_size, n)
        arr = np.memmap(
            os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="w+", shape=(n,)
        )
        arr[:] = np.where(rng.random(n) < 0.7, runs, noise)
        arr.flush()


def get_lr(it: int, a: argparse.Namespace) -> float:
    """nanoGPT's schedule: linear warmup, cosine decay to min_lr."""
    if it < a.warmup_iters:
        return a.learning_rate * (it + 1) / (a.warmup_iters + 1)
    if it > a.lr_decay_iters:
        return a.min_lr
    ratio = (it - a.warmup_iters) / (a.lr_decay_iters - a.warmup_iters)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (a.learning_rate - a.min_lr)


@torch.no_grad()
def estimate_loss(model: nn.Module, val: WindowDataset, a: argparse.Namespace) -> float:
    """The mean loss over the first ``eval_iters`` batches of validation windows: a fixed
    set, drawn by no RNG (so evaluating never moves the training's draws or dropout)."""
    model.eval()
    offsets = list(TokenStreamSampler(val.n_tokens, a.block_size, rank=0, world_size=1))
    losses = []
    for i in range(a.eval_iters):
        rows = [val[o] for o in offsets[i * a.batch_size : (i + 1) * a.batch_size]]
        device = next(model.parameters()).device
        X, Y = (torch.stack(t).to(device) for t in zip(*rows, strict=True))
        losses.append(float(model(X, Y)[1]))
    model.train()
    return sum(losses) / len(losses)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-iters", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank, per micro-batch")
    ap.add_argument("--gradient-accumulation-steps", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--n-tokens", type=int, default=20_000)
    ap.add_argument("--samples-per-epoch", type=int, help="draws per rank per epoch")
    ap.add_argument("--learning-rate", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=3e-4)
    ap.add_argument("--warmup-iters", type=int, default=5)
    ap.add_argument("--lr-decay-iters", type=int, default=60)
    ap.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping")
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--eval-iters", type=int, default=2)
    ap.add_argument("--data-dir", help="where train.bin/val.bin are written (default: a temp dir)")
    ap.add_argument("--policy", help="policy YAML (default: $ORCHESTRATOR_POLICY or defaults)")
    ap.add_argument("--run-dir", help="default: $ORCHESTRATOR_RUN_DIR or ./runs/<time>-<pid>")
    ap.add_argument("--demo", action="store_true", help="inject a NaN and a poisoned window")
    ap.add_argument("--save-final", help="directory for rank<r>.pt with the final state")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # entry point: ours to set
    ddp = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if ddp:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    device = torch.device(
        f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    )
    data_dir = a.data_dir or tempfile.mkdtemp(prefix="nanogpt-")  # each rank its own copy
    os.makedirs(data_dir, exist_ok=True)
    vocab_size = 64
    if a.data_dir is None or rank == 0:
        write_tokens(data_dir, a.n_tokens, vocab_size)
    if ddp and a.data_dir is not None:
        dist.barrier()  # rank 0 wrote the shared copy

    torch.manual_seed(1337)  # the same initial weights on every rank
    raw = GPT(vocab_size, a.block_size, n_layer=2, n_head=2, n_embd=32).to(device)
    model: nn.Module = DDP(raw) if ddp else raw
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.learning_rate, weight_decay=0.1)
    try:
        policy = demo_policy(a, world) if a.demo else load_policy(a.policy)
        guard = Guard(
            policy,
            model=model,
            optimizer=optimizer,
            grad_accum_steps=a.gradient_accumulation_steps,
            run_dir=a.run_dir,
        )
    except PolicyError as err:  # a policy that cannot be met: say why, no traceback
        print(f"[rank {rank}] {err}", file=sys.stderr)
        return 2
    best_val_loss = Value(1e9)  # rolled back and resumed with the model
    guard.register_state("best_val_loss", best_val_loss)

    train = WindowDataset(os.path.join(data_dir, "train.bin"), a.block_size)
    val = WindowDataset(os.path.join(data_dir, "val.bin"), a.block_size)
    sampler = RandomOffsetSampler(
        train.n_tokens, a.block_size, seed=1337, samples_per_epoch=a.samples_per_epoch
    )
    loader = guard.dataloader(train, a.batch_size, sampler=sampler)
    for X, Y in guard.batches(loader, max_steps=a.max_iters):  # one micro-batch each
        lr = get_lr(guard.global_step, a)  # never a local iter_num: a rollback moves it
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        _, loss = model(X.to(device), Y.to(device))
        guard.backward(loss)  # divides by the accumulation steps (the Guard runs no_sync)
        if a.grad_clip and guard.last_micro:  # the gradients are whole on the last one
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        if guard.step() != "commit":  # "accumulate", or an incident's re-runs and rollback
            continue
        if guard.global_step % a.eval_interval == 0 and rank == 0:
            val_loss = estimate_loss(raw, val, a)
            best_val_loss.value = min(best_val_loss.value, val_loss)
            print(
                f"step {guard.global_step}: train {guard.loss:.4f}, val {val_loss:.4f}, "
                f"lr {guard.lr:.2e}"  # the LR set here, times the Guard's after an incident
            )
    guard.close()
    if a.data_dir is None:
        shutil.rmtree(data_dir, ignore_errors=True)

    if a.save_final:
        os.makedirs(a.save_final, exist_ok=True)
        final = {
            "model": raw.state_dict(),
            "optim": optimizer.state_dict(),
            "step": guard.global_step,
            "best_val_loss": best_val_loss.value,
        }
        torch.save(final, os.path.join(a.save_final, f"rank{rank}.pt"))
    if rank == 0:
        print(
            f"done: {guard.global_step} steps, {len(guard.incidents)} incident(s), "
            f"{guard.rollbacks} rollback(s)"
        )
    return 0


def demo_policy(a: argparse.Namespace, world_size: int):  # type: ignore[no-untyped-def]
    """A transient NaN gradient at step 17 on the last rank, and a poisoned window: the
    third one rank 0 draws at step 12 (a window's id is its offset)."""
    rank0 = RandomOffsetSampler(
        a.n_tokens, a.block_size, seed=1337, rank=0, world_size=world_size,
        samples_per_epoch=a.samples_per_epoch,
    )  # fmt: skip
    draw = 12 * a.gradient_accumulation_steps * a.batch_size + 2  # in the first epoch
    poisoned = int(rank0.offsets(draw, 1)[0])
    faults = [
        {"kind": "nan_grad", "step": 17, "rank": world_size - 1},
        {"kind": "poison_sample", "sample": poisoned},
    ]
    return parse_policy({"faults": faults}, source="<demo>")


if __name__ == "__main__":
    exit_process(main())
