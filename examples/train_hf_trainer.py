"""A standard ``transformers.Trainer`` script under the Guard: a tiny Llama (random init,
nothing downloaded) on synthetic tokens, gradient accumulation, clipping, bf16, evaluation
every 4 steps.

    torchrun --nproc-per-node 2 examples/train_hf_trainer.py --steps 8
    orchestrator launch --nproc-per-node 2 examples/train_hf_trainer.py --steps 8

The whole change to the script is the class: ``GuardedTrainer`` for ``Trainer`` (or
``guarded(SFTTrainer)`` for a subclass) and a ``guard_policy``; ``--plain`` runs Trainer
alone, the reference a healthy guarded run equals bit for bit (docs/hf-trainer.md).
The policy and the run directory come from $ORCHESTRATOR_POLICY and $ORCHESTRATOR_RUN_DIR.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Trainer,
    TrainingArguments,
)

from orchestrator import load_policy
from orchestrator.integrations.hf import GuardedTrainer

VOCAB, SEQ = 101, 16


class Tokens(Dataset[dict[str, torch.Tensor]]):
    """Synthetic sequences with some structure to learn (each token follows from the last)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model(arch: str = "llama") -> PreTrainedModel:
    """Llama (no dropout) or GPT-2 (dropout 0.1: each replay must draw the masks the run
    it replays drew)."""
    torch.manual_seed(0)
    if arch == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ)
        )
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--samples", type=int, default=96, help="dataset size")
    ap.add_argument("--plain", action="store_true", help="Trainer alone (no Guard)")
    ap.add_argument("--arch", choices=["llama", "gpt2"], default="llama")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    ap.add_argument("--save-final", help="directory for rank<r>.pt with the final state")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # entry point: ours

    training = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-trainer-"),
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        bf16=not args.fp32,
        seed=0,
        disable_tqdm=True,
    )
    common: dict[str, Any] = {"model": model(args.arch), "args": training}
    common["train_dataset"], common["eval_dataset"] = Tokens(args.samples), Tokens(16)
    if args.plain:
        trainer: Trainer = Trainer(**common)
    else:
        trainer = GuardedTrainer(**common, guard_policy=load_policy())
    trainer.train()

    rank = int(os.environ.get("RANK", "0"))
    guard = getattr(trainer, "guard", None)
    if args.save_final:
        os.makedirs(args.save_final, exist_ok=True)
        inner: Any = trainer.optimizer
        torch.save(
            {
                "model": trainer.model.state_dict(),
                "optim": getattr(inner, "optimizer", inner).state_dict(),
                "log_history": [
                    {k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
                    for e in trainer.state.log_history
                ],
                "global_step": trainer.state.global_step,
                "guard_step": guard.global_step if guard is not None else -1,
            },
            os.path.join(args.save_final, f"rank{rank}.pt"),
        )
    if rank == 0:
        extra = "" if guard is None else f", {len(guard.incidents)} incident(s)"
        print(f"\ndone: {trainer.state.global_step} steps{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
