"""A standard Hugging Face Accelerate script with the Guard in it (docs/accelerate.md).

Gradient accumulation 2, clipping, bf16 autocast, an LR schedule, Accelerate's own loader:
the loop is Accelerate's; three lines add the Guard (marked ``# Guard``). Runs as
``python examples/train_accelerate.py``, ``torchrun --nproc-per-node 2 ...`` or
``accelerate launch ...`` (gloo on CPU, NCCL on GPU), and under ``orchestrator launch``.

``--plain`` runs the same loop without the Guard (Accelerate alone: the reference a healthy
guarded run equals bit for bit). ``--save-final DIR`` writes each rank's final state.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn

from orchestrator import exit_process, load_policy
from orchestrator.integrations.accelerate import guard_accelerate


class Regression(torch.utils.data.Dataset):
    """Sample i: features and a noisy linear target drawn from a generator seeded by i."""

    def __init__(self, n: int, dim: int, first: int = 0) -> None:
        self.n, self.dim, self.first = n, dim, first
        self.w = torch.randn(dim, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.first + i)
        x = torch.randn(self.dim, generator=g)
        return {"x": x, "y": (x @ self.w + 0.1 * torch.randn((), generator=g)).reshape(1)}


@dataclasses.dataclass
class Output:
    loss: torch.Tensor


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Output:
        return Output(F.mse_loss(self.net(x).float(), y))


def train_step(accelerator: Accelerator, model: nn.Module, opt: Any, sched: Any, batch: Any) -> Any:
    """The loop body of a standard Accelerate script: unchanged under the Guard."""
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    return loss.detach()


def evaluate(accelerator: Accelerator, model: nn.Module, loader: Iterable[Any]) -> torch.Tensor:
    """The mean loss over the evaluation set, gathered from every rank."""
    model.eval()
    with torch.no_grad():
        losses = [accelerator.gather_for_metrics(model(**b).loss.reshape(1)) for b in loader]
    model.train()
    return torch.cat(losses).mean()


def plain_batches(accelerator: Accelerator, loader: Iterable[Any], steps: int) -> Any:
    """Accelerate alone: epochs of the prepared loader until ``steps`` optimizer steps."""
    done = 0
    while done < steps:
        for batch in loader:
            yield batch
            done += accelerator.sync_gradients
            if done >= steps:
                return


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank and micro-batch")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--mixed-precision", default="bf16", choices=["no", "bf16"])
    ap.add_argument("--eval-every", type=int, default=10, help="optimizer steps")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    ap.add_argument("--plain", action="store_true", help="Accelerate alone, no Guard")
    ap.add_argument("--save-final", help="directory for rank<r>.pt with the final state")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        mixed_precision=args.mixed_precision,
        cpu=not torch.cuda.is_available(),  # torchrun on CPU: gloo (as `accelerate launch --cpu`)
        # The order of each epoch a function of the seed and the epoch: replayable.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(0)  # the same initial weights and data order on every rank
    model = MLP(16, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    data = Regression(args.samples, 16)
    loader = torch.utils.data.DataLoader(
        data, batch_size=args.batch_size, shuffle=True, num_workers=args.workers
    )
    held_out = torch.utils.data.DataLoader(Regression(32, 16, first=10**6), batch_size=8)
    model, opt, loader, held_out, sched = accelerator.prepare(model, opt, loader, held_out, sched)

    losses: list[torch.Tensor] = []
    evals: list[tuple[int, torch.Tensor]] = []  # (step, evaluation loss) every --eval-every
    if args.plain:
        steps = 0
        for batch in plain_batches(accelerator, loader, args.steps):
            losses.append(train_step(accelerator, model, opt, sched, batch))
            steps += accelerator.sync_gradients
            if accelerator.sync_gradients and steps % args.eval_every == 0:
                evals.append((steps, evaluate(accelerator, model, held_out)))
    else:
        guard = guard_accelerate(accelerator, load_policy())  # Guard
        for batch in guard.batches(loader, max_steps=args.steps):  # Guard: was `in loader`
            losses.append(train_step(accelerator, model, opt, sched, batch))
            # Guard: evaluate, log and save on committed steps (was: on sync_gradients)
            if guard.outcome == "commit" and guard.global_step % args.eval_every == 0:
                evals.append((guard.global_step, evaluate(accelerator, model, held_out)))
        guard.close()  # Guard
        steps = guard.global_step
        if accelerator.is_main_process:
            print(
                f"done: {steps} steps, {len(guard.incidents)} incident(s), "
                f"{guard.rollbacks} rollback(s), quarantined {sorted(guard.quarantined)}"
            )
    if args.save_final:
        save_final(args.save_final, accelerator, model, opt, sched, (losses, evals), steps)
    return 0


def save_final(
    where: str, accelerator: Accelerator, model: Any, opt: Any, sched: Any, losses: Any, steps: int
) -> None:
    os.makedirs(where, exist_ok=True)
    state = {
        "model": accelerator.unwrap_model(model).state_dict(),
        "optim": opt.state_dict(),
        "sched": sched.state_dict(),
        "losses": torch.stack(losses[0]) if losses[0] else torch.empty(0),
        "evals": [(step, value) for step, value in losses[1]],
        "steps": steps,
        "accelerator_step": accelerator.step,  # Accelerate's micro-batch counter
    }
    torch.save(state, os.path.join(where, f"rank{accelerator.process_index}.pt"))


if __name__ == "__main__":
    exit_process(main())
