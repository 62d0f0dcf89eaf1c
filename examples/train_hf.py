"""Real model code under the Guard: tiny Hugging Face ``transformers`` Llama or GPT-2 (random
init, nothing downloaded) on synthetic tokens, on every engine the Guard supports.

    torchrun --nproc-per-node 2 examples/train_hf.py --arch llama --engine fsdp2
    torchrun --nproc-per-node 2 examples/train_hf.py --arch gpt2 --engine zero3

The shapes are the awkward ones real models bring: a vocabulary of 1001 tokens (not
divisible by the world size) and a scalar value head (``Linear(hidden, 1)``, as RLHF critics
add), whose shard is empty on rank 1 under FSDP2. Llama has untied embeddings, grouped-query
attention and a non-persistent rotary buffer; GPT-2 ties its input and output embeddings and
has dropout. The position (GPT-2) or token (Llama) embedding is frozen. The optimizer has two
parameter groups (no weight decay on norms and biases), except under FSDP1 with
``use_orig_params=False``, where the optimizer only sees flat parameters.

Gradient clipping: the policy's ``clip.max_norm`` (the Guard clips by the norm its check
already has), ``--clip-by-hand`` (the loop calls ``clip_grad_norm_`` between
``guard.backward`` and ``guard.step``), or DeepSpeed's own ``gradient_clipping``
(``--ds-clip``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import SyntheticTokens, local_shards
from train_gpt_deepspeed import tensors_only

from orchestrator import Guard, PolicyError, exit_process, load_policy

ENGINES = ("ddp", "fsdp2", "fsdp1", "fsdp1-orig", "zero1", "zero2", "zero3")
VOCAB = 1001


class WithValueHead(nn.Module):
    """A causal LM plus a scalar value head on its last hidden state (trl's
    ``AutoModelForCausalLMWithValueHead`` shape): ``Linear(hidden, 1)`` has one row, so
    dim-0 sharding over two ranks leaves rank 1 an empty shard."""

    def __init__(self, lm: nn.Module, hidden: int) -> None:
        super().__init__()
        self.lm = lm
        self.v_head = nn.Linear(hidden, 1)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lm(input_ids=idx, output_hidden_states=True)
        return out.logits, self.v_head(out.hidden_states[-1]).squeeze(-1)


def build_model(arch: str, seq_len: int) -> tuple[WithValueHead, list[nn.Module]]:
    """The model and its transformer blocks (the units of per-block sharding)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if arch == "llama":
        lm: Any = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=88,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=seq_len,
                tie_word_embeddings=False,
            )
        )
        lm.model.embed_tokens.weight.requires_grad_(False)
        blocks = list(lm.model.layers)
    else:
        lm = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=seq_len,
                bos_token_id=0,
                eos_token_id=0,
            )
        )
        lm.transformer.wpe.weight.requires_grad_(False)
        blocks = list(lm.transformer.h)
    return WithValueHead(lm, 32), blocks


def frozen_modules(model: WithValueHead) -> list[nn.Module]:
    return [m for m in model.modules() if any(not p.requires_grad for p in m.parameters(False))]


def param_groups(model: nn.Module, flat: bool) -> list[dict[str, Any]]:
    """Weight decay on matrices only; never on norms and biases (by name: FSDP1 views and
    FSDP2 shards do not keep the original dimensionality)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if flat:
        return [{"params": [p for _, p in named], "weight_decay": 0.01}]

    def no_decay(name: str) -> bool:
        return name.endswith("bias") or "norm" in name or ".ln_" in name

    return [
        {"params": [p for n, p in named if not no_decay(n)], "weight_decay": 0.01},
        {"params": [p for n, p in named if no_decay(n)], "weight_decay": 0.0},
    ]


def loss_of(logits: torch.Tensor, value: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    lm = F.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    target = batch[:, -1].float() / VOCAB  # something learnable for the value head
    return lm + 0.1 * F.mse_loss(value[:, -1].float(), target)


def wrap(args: argparse.Namespace, model: WithValueHead, blocks: list[nn.Module]) -> Any:
    """Apply the engine; returns (module to call, optimizer, scheduler, DeepSpeed engine)."""
    world = dist.get_world_size()
    if args.compile:
        for block in blocks:
            block.compile(backend=args.compile)  # in place: parameter names do not change
    if args.engine == "ddp":
        module: nn.Module = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    elif args.engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(
            param_dtype=None if args.fp32 else torch.bfloat16, reduce_dtype=torch.float32
        )
        for block in blocks:  # torchtitan's wrapping: every block, then the root
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        module = model
    elif args.engine.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import CustomPolicy

        # A flat parameter must be all trainable or all frozen (use_orig_params=False):
        # frozen modules become units of their own, as do the blocks.
        units = {id(m) for m in [*blocks, *frozen_modules(model)]}
        module = FullyShardedDataParallel(
            model,
            auto_wrap_policy=CustomPolicy(lambda m: id(m) in units),
            device_id=torch.device("cpu"),
            mixed_precision=None
            if args.fp32
            else MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
            ),
            use_orig_params=args.engine == "fsdp1-orig",
        )
    else:
        return wrap_deepspeed(args, model)
    opt = torch.optim.AdamW(param_groups(module, flat=args.engine == "fsdp1"), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    return module, opt, sched, None


def wrap_deepspeed(args: argparse.Namespace, model: WithValueHead) -> Any:
    import deepspeed

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": int(args.engine[-1])},
        # torch's AdamW: DeepSpeed's CPU Adam kernels keep state no checkpoint holds (see
        # train_gpt_deepspeed.py), so they do not replay bit for bit.
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr, "warmup_num_steps": 5},
        },
    }
    if args.ds_clip:
        config["gradient_clipping"] = args.ds_clip
    engine, opt, _, sched = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, flat=False), config=config
    )
    return engine, opt, sched, engine


def final_state(args: argparse.Namespace, module: Any, opt: Any, ds: Any) -> dict[str, Any]:
    """This rank's whole state as plain tensors: every local shard of the model and the
    optimizer (DeepSpeed: the fp32 master weights in full, the ZeRO partitions and the bit16
    module)."""
    if ds is not None:
        from deepspeed.utils import safe_get_full_fp32_param

        # The full fp32 master weights: a collective at ZeRO-3 (every rank calls it).
        fp32 = {n: safe_get_full_fp32_param(p) for n, p in ds.module.named_parameters()}
        return {
            "fp32_full": tensors_only(fp32),
            "zero": tensors_only(ds.optimizer.state_dict()),
            "module": tensors_only(ds.module.state_dict()),
        }
    if args.engine.startswith("fsdp1"):
        model = dict(module.named_parameters())  # the local flat shards (or their views)
    else:
        model = getattr(module, "module", module).state_dict()
    return {"model": local_shards(model), "optim": local_shards(opt.state_dict())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    ap.add_argument("--engine", choices=ENGINES, default="ddp")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dropout", type=float, default=None, help="GPT-2 dropouts (default 0.1)")
    ap.add_argument("--compile", metavar="BACKEND", help="torch.compile every block")
    ap.add_argument("--fp32", action="store_true", help="FSDP without bf16 mixed precision")
    ap.add_argument("--clip-by-hand", type=float, help="clip_grad_norm_ in the loop")
    ap.add_argument("--ds-clip", type=float, help="DeepSpeed's gradient_clipping")
    ap.add_argument("--policy", help="policy YAML (default: $ORCHESTRATOR_POLICY or defaults)")
    ap.add_argument("--run-dir", help="default: $ORCHESTRATOR_RUN_DIR or ./runs/<time>-<pid>")
    ap.add_argument("--save-final", help="directory for rank<r>.pt with the final state")
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # deepspeed
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("deepspeed", "DeepSpeed", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")  # CPU; on GPUs use nccl and move the model first
    else:  # plain `python train_hf.py`: a group of one (FSDP and DeepSpeed want a group)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    rank = dist.get_rank()

    torch.manual_seed(0)  # same initial weights on every rank
    model, blocks = build_model(args.arch, args.seq_len)
    if args.dropout is not None:
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = args.dropout
    module, opt, sched, ds = wrap(args, model, blocks)
    torch.manual_seed(1234 + rank)  # per-rank dropout streams

    try:
        policy = load_policy(args.policy)
        if ds is not None:
            guard = Guard(policy, engine=ds, run_dir=args.run_dir)
        else:
            guard = Guard(
                policy, model=module, optimizer=opt, scheduler=sched, run_dir=args.run_dir
            )
    except PolicyError as err:
        print(f"[rank {rank}] {err}", file=sys.stderr)
        return 2
    loader = guard.dataloader(
        SyntheticTokens(args.samples, args.seq_len, VOCAB), batch_size=args.batch_size, seed=7
    )
    for batch in guard.batches(loader, max_steps=args.steps):
        logits, value = module(batch[:, :-1])
        loss = loss_of(logits, value, batch)
        guard.backward(loss)
        if args.clip_by_hand:
            if args.engine.startswith("fsdp1"):
                module.clip_grad_norm_(args.clip_by_hand)  # FSDP1's own: shards are flat
            else:
                torch.nn.utils.clip_grad_norm_(module.parameters(), args.clip_by_hand)
        outcome = guard.step()
        if rank == 0 and outcome == "commit" and guard.global_step % 10 == 0:
            print(f"step {guard.global_step:4d}  loss {loss.item():.4f}", flush=True)
    guard.close()

    if args.save_final:
        state = final_state(args, module, opt, ds)
        os.makedirs(args.save_final, exist_ok=True)
        torch.save({**state, "step": guard.global_step}, f"{args.save_final}/rank{rank}.pt")
    dist.barrier()
    return 0


if __name__ == "__main__":
    exit_process(main())
