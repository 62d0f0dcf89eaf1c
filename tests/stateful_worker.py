"""A training loop with the user's own state in the Guard: an EMA of the weights and a
counter whose value differs per rank. One rank of tests/test_open_guard.py, or the whole
in-process run (``run`` below):

    torchrun --nproc-per-node 2 tests/stateful_worker.py --steps 40 --save-final DIR

``--save-final DIR`` writes each rank's model, EMA and counter as plain tensors.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from orchestrator import Guard, exit_process, load_policy


class EMA:
    """An exponential moving average of a model's weights, updated in place."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.model, self.decay = model, decay
        # Plain tensors (under FSDP2 this rank's shards): what a snapshot holds as is.
        self.shadow = {k: _local(v).detach().clone() for k, v in model.state_dict().items()}

    def update(self) -> None:
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                self.shadow[k].mul_(self.decay).add_(_local(v), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow, "decay": self.decay}  # references, as torch's do

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, t in self.shadow.items():
            t.copy_(state["shadow"][k])
        self.decay = state["decay"]


class Counter:
    """Commits seen, the sum of this rank's own losses (a per-rank value) and the samples
    its loop body ran (updated before guard.step: a rollback undoes the updates since the
    snapshot, probes included); it keeps the tensors it is given and adds to them in place."""

    def __init__(self, device: str = "cpu") -> None:
        self.commits = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.seen = torch.zeros((), dtype=torch.int64, device=device)

    def state_dict(self) -> dict[str, Any]:
        return {"commits": self.commits, "loss_sum": self.loss_sum, "seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.commits, self.loss_sum, self.seen = state["commits"], state["loss_sum"], state["seen"]


class Data(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.arange(8.0) + 0.1 * torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) tensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def build(engine: str, device: str = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """The model and the Guard's arguments for ``engine`` (ddp, fsdp2 or zero2; one process
    without torch.distributed: plain PyTorch), on ``device``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    model.to(device)
    if engine == "zero2":
        import deepspeed

        ds, *_ = deepspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config={
                "train_micro_batch_size_per_gpu": 8,
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": 2},
                # torch_adam: bit-for-bit replays on CPU (examples/train_gpt_deepspeed.py)
                "optimizer": {"type": "ADAMW", "params": {"lr": 1e-2, "torch_adam": True}},
            },
        )
        return model, {"engine": ds}
    module: nn.Module = model
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        module = fully_shard(model)
    elif dist.is_initialized():
        module = nn.parallel.DistributedDataParallel(model)
    return model, {"model": module, "optimizer": torch.optim.AdamW(module.parameters(), lr=1e-2)}


def run(
    guard_args: dict[str, Any],
    steps: int,
    user: bool = True,
    engine: str = "ddp",
    device: str = "cpu",
) -> tuple[Guard, dict[str, Any]]:
    """Train ``steps`` steps; returns the Guard and the final model, EMA and counter
    (``user=False``: neither is given to the Guard)."""
    model, kw = build(engine, device)
    forward = kw.get("model", kw.get("engine"))  # the wrapper (DDP's all-reduces gradients)
    ema, counter = EMA(model), Counter(device)
    guard = Guard(state={"ema": ema} if user else None, **kw, **guard_args)
    if user:
        guard.register_state("counter", counter)
    loader = guard.dataloader(Data(), batch_size=8, seed=1)
    for x, y in guard.batches(loader, max_steps=steps):
        x, y = x.to(device), y.to(device)
        counter.seen += len(y)  # before the step's fence: its snapshot copy must land first
        out = forward(x.bfloat16() if engine == "zero2" else x)
        loss = F.mse_loss(out.squeeze(-1).float(), y)
        guard.backward(loss)
        if guard.step(loss) == "commit":  # the user's state follows committed steps only
            ema.update()
            counter.commits += 1
            counter.loss_sum += loss.detach().double()  # in place: the tensor it was given
    guard.close()
    final = {
        "model": {k: _local(v).detach().clone() for k, v in model.state_dict().items()},
        "ema": dict(ema.shadow),
        "commits": counter.commits,
        "loss_sum": counter.loss_sum,
        "seen": counter.seen,
        "step": guard.global_step,
    }
    return guard, final


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--engine", choices=("ddp", "fsdp2", "zero2"), default="ddp")
    ap.add_argument("--save-final")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    _, final = run({"policy": load_policy()}, args.steps, engine=args.engine)
    if args.save_final:
        os.makedirs(args.save_final, exist_ok=True)
        torch.save(final, f"{args.save_final}/rank{dist.get_rank()}.pt")
    dist.barrier()
    return 0


if __name__ == "__main__":
    exit_process(main())
