"""The small GPT of ``train_gpt.py``, trained with DeepSpeed (ZeRO-2, bf16 by default) under
the Guard. The loop is DeepSpeed's: ``guard.backward`` calls ``engine.backward`` and
``guard.step`` calls ``engine.step``.

    torchrun --nproc-per-node 2 examples/train_gpt_deepspeed.py
    deepspeed --num_gpus 2 examples/train_gpt_deepspeed.py --deepspeed_config ds.json
    orchestrator launch --nproc 2 -- examples/train_gpt_deepspeed.py --zero-stage 3

On CPU DeepSpeed uses gloo and compiles a small shared-memory op on first use (cached under
$TORCH_EXTENSIONS_DIR). ``--fp16`` on a CPU without native fp16 kernels (DeepSpeed refuses
those) runs DeepSpeed's fp16 path anyway, on torch's emulated fp16 kernels, so the loss
scaler can be exercised without a GPU; the program says so when it does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_gpt import SyntheticTokens, TinyGPT, demo_policy

from orchestrator import Guard, PolicyError, exit_process, load_policy, read_journal

DEFAULT_CONFIG = Path(__file__).resolve().parent / "ds_zero2_bf16.json"


def ds_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads(Path(args.deepspeed_config).read_text())
    if args.zero_stage is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = args.zero_stage
    if args.gas is not None:
        cfg["gradient_accumulation_steps"] = args.gas
        cfg.pop("train_batch_size", None)  # DeepSpeed derives it
    if not torch.cuda.is_available():
        # DeepSpeed's CPU Adam kernels keep Adam's bias-correction product beta^t in C++
        # state that no checkpoint holds; after a rollback they recompute it with pow(),
        # which differs in the last bit from the running product. torch's AdamW is
        # stateless in that sense, so CPU runs replay bit for bit (the CUDA FusedAdam is too).
        cfg.setdefault("optimizer", {}).setdefault("params", {}).setdefault("torch_adam", True)
    if args.fp16:
        cfg.pop("bf16", None)
        # A long window keeps the scale still unless something overflows: easy to follow.
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": 12,
            "loss_scale_window": 1000,
            "hysteresis": 1,  # every overflow halves the scale (DeepSpeed's default waits 2)
        }
    return cfg


def allow_cpu_fp16() -> None:
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu" and not acc.is_fp16_supported():
        print(
            "note: this CPU has no native fp16 kernels; running DeepSpeed's fp16 path on "
            "torch's emulated ones (slow, numerically the same format)",
            file=sys.stderr,
        )
        type(acc).is_fp16_supported = lambda self: True  # type: ignore[method-assign]


def tensors_only(tree: Any) -> Any:
    """Plain tensors and numbers of a state tree (drops objects such as the loss scaler)."""
    if isinstance(tree, dict):
        out = {k: tensors_only(v) for k, v in tree.items()}
        return {k: v for k, v in out.items() if v is not None}
    if isinstance(tree, (list, tuple)):
        return [tensors_only(v) for v in tree]
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    for plain in (bool, int, float, str):  # enums derived from these become plain values
        if isinstance(tree, plain):
            return plain(tree)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--deepspeed_config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--zero-stage", type=int, choices=[1, 2, 3])
    ap.add_argument("--gas", type=int, help="gradient_accumulation_steps")
    ap.add_argument("--fp16", action="store_true", help="fp16 with DeepSpeed's loss scaler")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps")
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--policy", help="policy YAML (default: $ORCHESTRATOR_POLICY or defaults)")
    ap.add_argument("--demo", action="store_true", help="inject a NaN and a poisoned sample")
    ap.add_argument("--run-dir", help="default: $ORCHESTRATOR_RUN_DIR or ./runs/<time>-<pid>")
    ap.add_argument("--save-final", help="directory for rank<r>.pt with the final state")
    ap.add_argument(
        "--load-checkpoint", help="engine.load_checkpoint(DIR) before training (tests use it)"
    )
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # deepspeed
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for name in ("deepspeed", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import deepspeed

    if "RANK" not in os.environ:  # plain `python train_gpt_deepspeed.py`: one process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
    if args.fp16:
        allow_cpu_fp16()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank = torch.distributed.get_rank()

    vocab = 64
    torch.manual_seed(0)  # same initial weights on every rank
    model = TinyGPT(vocab, args.seq_len, args.d_model, args.layers, heads=4)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(args)
    )
    if args.load_checkpoint:
        path, _ = engine.load_checkpoint(args.load_checkpoint)
        assert path is not None, f"no DeepSpeed checkpoint under {args.load_checkpoint}"
    torch.manual_seed(1234 + rank)  # per-rank dropout streams

    try:
        policy = demo_policy(engine.world_size) if args.demo else load_policy(args.policy)
        guard = Guard(policy, engine=engine, run_dir=args.run_dir)
    except PolicyError as err:
        print(f"[rank {rank}] {err}", file=sys.stderr)
        return 2
    loader = guard.dataloader(
        SyntheticTokens(args.samples, args.seq_len, vocab),
        batch_size=engine.train_micro_batch_size_per_gpu(),
        seed=7,
    )
    for batch in guard.batches(loader, max_steps=args.steps):
        batch = batch.to(engine.device)
        logits = engine(batch[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
        guard.backward(loss)
        outcome = guard.step()
        if rank == 0 and outcome == "commit" and guard.global_step % 25 == 0:
            print(f"step {guard.global_step:4d}  loss {loss.item():.4f}", flush=True)
    guard.close()

    if args.save_final:
        from deepspeed.utils import safe_get_full_fp32_param

        os.makedirs(args.save_final, exist_ok=True)
        zero = engine.optimizer.state_dict()
        # The full fp32 master weights (a collective at ZeRO-3: every rank calls it).
        fp32 = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        torch.save(
            {
                "fp32_full": tensors_only(fp32),
                "zero": tensors_only(zero),
                "module": tensors_only(engine.module.state_dict()),
                "loss_scale": float(engine.optimizer.loss_scale),
                "ds_global_steps": engine.global_steps,
                "ds_skipped_steps": engine.skipped_steps,
                "step": guard.global_step,
            },
            os.path.join(args.save_final, f"rank{rank}.pt"),
        )
    if rank == 0:
        events = list(read_journal(guard.run_dir))
        kinds = [e["kind"] for e in events]
        print(
            f"\ndone: {guard.global_step} steps, {len(guard.incidents)} incident(s), "
            f"{guard.rollbacks} rollback(s), {kinds.count('snapshot')} snapshots; "
            f"journal: {guard.run_dir}/journal/"
        )
    torch.distributed.barrier()  # every rank is done: nothing is in flight any more
    return 0


if __name__ == "__main__":
    # Exits with main()'s code; a plain return would end the run as safely (docs/loop.md).
    exit_process(main())
