"""The integrations' overhead per step against the framework alone (issue 32): the same
script, the same model and data, with and without the Guard's few lines, interleaved round
by round in one run (drift on a shared machine hits both alike), reported as medians and
ratios.

    python benchmarks/bench_integrations.py                      # 3 rounds, 2 ranks
    python benchmarks/bench_integrations.py --rounds 5 --frameworks accelerate

Each run is a fresh ``torchrun`` of this file (``--worker``) training the example GPT
(``benchmarks/_common.py``) with gradient accumulation 2 and clipping for ``--steps``
optimizer steps; rank 0 times every optimizer step after ``--warmup``. ``median`` is the
typical step (the check's all-reduce included, snapshots mostly not); ``mean`` includes
the snapshot copies and durable writes the default policy makes. ``check_ms`` is the
Guard's own measure of its check (the one all-reduce and its host sync), per step: the
issue's target is ``median ratio <= 1.01`` plus that.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SEQ, VOCAB, TinyGPT, init_dist, loss_of, report, spawn

SIZES = {"10M": (256, 12), "1M": (96, 8)}
FRAMEWORKS = ("accelerate", "trainer", "lightning")
GA, BATCH = 2, 8


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sample i: SEQ + 1 tokens drawn from a generator seeded by i (no files)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"tokens": torch.randint(0, VOCAB, (SEQ + 1,), generator=g)}


class StepClock:
    """Times between optimizer steps on this rank, after ``warmup`` of them."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.steps, self.times = warmup, 0, [time.perf_counter()]

    def tick(self) -> None:
        self.steps += 1
        self.times.append(time.perf_counter())

    def seconds(self) -> list[float]:
        t = self.times[self.warmup :]
        return [b - a for a, b in itertools.pairwise(t)]


def _check_ms(run_dir: str, steps: int) -> float | None:
    """The Guard's own check time per step, from its metrics rows (each row sums the
    checks since the row before)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists() or not steps:
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return 1000 * sum(r.get("check_s") or 0.0 for r in rows) / steps


# --- Accelerate ---------------------------------------------------------------------------------
def accelerate_worker(args: argparse.Namespace, run_dir: str) -> StepClock:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed

    from orchestrator import load_policy
    from orchestrator.integrations.accelerate import guard_accelerate

    accelerator = Accelerator(
        gradient_accumulation_steps=GA,
        cpu=not torch.cuda.is_available(),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(0)
    d, layers = SIZES[args.size]
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, SEQ, d, layers, heads=4)  # Accelerate wraps it in DDP
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    loader = torch.utils.data.DataLoader(
        Tokens(BATCH * GA * (args.steps + 1) * 2), batch_size=BATCH, shuffle=True
    )
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    clock = StepClock(args.warmup)

    def body(batch: dict[str, torch.Tensor]) -> bool:
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(model, batch["tokens"]))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        return bool(accelerator.sync_gradients)

    if args.mode == "alone":
        for batch in _epochs(loader):
            if body(batch):
                clock.tick()
                if clock.steps >= args.steps:
                    break
        return clock
    os.environ["ORCHESTRATOR_RUN_DIR"] = run_dir
    guard = guard_accelerate(accelerator, load_policy())
    for batch in guard.batches(loader, max_steps=args.steps):
        body(batch)
        if guard.outcome == "commit":
            clock.tick()
    guard.close()
    return clock


def _epochs(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


# --- transformers.Trainer -----------------------------------------------------------------------
class LMTokens(Tokens):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        t = super().__getitem__(i)["tokens"][:SEQ]
        return {"input_ids": t, "labels": t}


def trainer_worker(args: argparse.Namespace, run_dir: str) -> StepClock:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from orchestrator import load_policy
    from orchestrator.integrations.hf import GuardedTrainer

    clock = StepClock(args.warmup)

    class Tick(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *_: Any, **__: Any) -> None:
            clock.tick()

    d, layers = SIZES[args.size]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=int(2.75 * d), num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
    )  # fmt: skip
    targs = TrainingArguments(
        output_dir=os.path.join(run_dir, "out"), max_steps=args.steps, seed=0,
        per_device_train_batch_size=BATCH, gradient_accumulation_steps=GA, max_grad_norm=1.0,
        learning_rate=1e-3, logging_steps=10, save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True,
    )  # fmt: skip
    common = {
        "model": LlamaForCausalLM(config),
        "args": targs,
        "train_dataset": LMTokens(BATCH * GA * (args.steps + 1) * 2),
        "callbacks": [Tick()],
    }
    if args.mode == "alone":
        Trainer(**common).train()
    else:
        GuardedTrainer(**common, guard_policy=load_policy(), guard_run_dir=run_dir).train()
    return clock


# --- Lightning ----------------------------------------------------------------------------------
def lightning_worker(args: argparse.Namespace, run_dir: str) -> StepClock:
    import lightning as L

    from orchestrator import load_policy
    from orchestrator.integrations.lightning import GuardCallback

    clock = StepClock(args.warmup)
    d, layers = SIZES[args.size]
    n = BATCH * GA * (args.steps + 1) * 2

    class GPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = TinyGPT(VOCAB, SEQ, d, layers, heads=4)
            self.seen = 0

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return loss_of(self.gpt, batch["tokens"])

        def on_train_batch_end(self, *_: Any) -> None:
            if self.trainer.global_step > self.seen:  # an optimizer step was committed
                self.seen = self.trainer.global_step
                clock.tick()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(Tokens(n), batch_size=BATCH, shuffle=True)

    callbacks = [] if args.mode == "alone" else [GuardCallback(load_policy(), run_dir=run_dir)]
    trainer = L.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=int(os.environ.get("WORLD_SIZE", "1")), strategy="ddp", max_steps=args.steps,
        accumulate_grad_batches=GA, gradient_clip_val=1.0, callbacks=callbacks, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(GPT())
    return clock


WORKERS: dict[str, Callable[[argparse.Namespace, str], StepClock]] = {
    "accelerate": accelerate_worker,
    "trainer": trainer_worker,
    "lightning": lightning_worker,
}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = args.run_dir
    clock = WORKERS[args.framework](args, run_dir)
    secs = clock.seconds()
    return {
        "framework": args.framework,
        "mode": args.mode,
        "steps": clock.steps,
        "median_ms": 1000 * statistics.median(secs),
        "mean_ms": 1000 * statistics.fmean(secs),
        "check_ms": _check_ms(run_dir, clock.steps) if args.mode == "guard" else None,
    }


# --- the driver ---------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--framework", default="accelerate", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["alone", "guard"], default="alone", help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--size", choices=sorted(SIZES), default="10M")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--md", help="also write the table to this file")
    return ap.parse_args(argv)


def table(rows: dict[str, dict[str, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    lines = [
        f"**The integrations' overhead per step** ({args.size} GPT, {args.nproc} ranks, "
        f"GA {GA}, clipping, {args.steps} steps after {args.warmup} warm-up, {args.rounds} "
        "interleaved rounds, medians; target: median ratio <= 1.01 plus the check)",
        "",
        "| framework | alone: median / mean ms | with the Guard: median / mean ms "
        "| median ratio | mean ratio | the Guard's check, ms/step |",
        "|---|---|---|---|---|---|",
    ]
    for fw, by_mode in rows.items():
        a, g = by_mode["alone"], by_mode["guard"]
        am, gm = (statistics.median(r["median_ms"] for r in x) for x in (a, g))
        aa, ga = (statistics.median(r["mean_ms"] for r in x) for x in (a, g))
        check = [r["check_ms"] for r in g if r["check_ms"] is not None]
        lines.append(
            f"| {fw} | {am:.1f} / {aa:.1f} | {gm:.1f} / {ga:.1f} | {gm / am:.3f}x "
            f"| {ga / aa:.3f}x | {statistics.median(check) if check else float('nan'):.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        init_dist()
        report(measure(args))
    common = ["--size", args.size, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for r in range(args.rounds):
        for fw in args.frameworks.split(","):
            # Alternate which goes first: a machine warming up favours neither.
            for mode in ("alone", "guard") if r % 2 == 0 else ("guard", "alone"):
                run_dir = tempfile.mkdtemp(prefix="bench-integrations-")
                extra = ["--framework", fw, "--mode", mode, "--run-dir", run_dir, *common]
                res = spawn(__file__, args.nproc, extra)
                rows.setdefault(fw, {}).setdefault(mode, []).append(res)
                print(json.dumps({"round": r, **res}), flush=True)
    text = table(rows, args)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
