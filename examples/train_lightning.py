"""A standard Lightning script under the Guard: a small MLP on synthetic regression data,
DDP, gradient accumulation, clipping, bf16, an LR scheduler stepped every optimizer step.

    torchrun --nproc-per-node 2 examples/train_lightning.py --steps 8
    torchrun --nproc-per-node 2 examples/train_lightning.py --fsdp 2  # FSDP2 (or 1: FSDP)
    python examples/train_lightning.py --devices 2 --steps 8  # Lightning starts rank 1
    orchestrator launch --nproc-per-node 2 examples/train_lightning.py --steps 8

The whole change to the script is one callback: ``GuardCallback(load_policy())`` in the
Trainer's ``callbacks`` (docs/lightning.md); ``--plain`` runs Lightning alone, the reference a
healthy guarded run equals bit for bit. The policy and the run directory come from
$ORCHESTRATOR_POLICY and $ORCHESTRATOR_RUN_DIR.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.utils.data import DataLoader, Dataset

from orchestrator import exit_process, load_policy
from orchestrator.integrations.lightning import GuardCallback

DIM = 16


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic regression: y = tanh(x @ w) plus noise."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, DIM, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(DIM, 4, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Regressor(L.LightningModule):
    def __init__(self, samples: int) -> None:
        super().__init__()
        self.samples = samples
        self.net = torch.nn.Sequential(
            torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_model(self) -> None:
        # FSDP2 under ModelParallelStrategy: each Linear, then the whole net, sharded over
        # the data-parallel ranks (the strategy calls this on every rank; DDP does nothing).
        if not isinstance(self.trainer.strategy, ModelParallelStrategy):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:  # fmt: skip
        # FSDP1 clips through its root module (Lightning's own clipping refuses it).
        model = self.trainer.model
        if isinstance(model, FullyShardedDataParallel) and gradient_clip_val is not None:
            model.clip_grad_norm_(gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Points(self.samples), batch_size=4, shuffle=True)


class ManualRegressor(Regressor):
    """The same training by hand (manual optimization): 2 micro-batches a step, clipped."""

    def __init__(self, samples: int) -> None:
        super().__init__(samples)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt, sched = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss)
        self.manual_backward(loss / 2)
        if (batch_idx + 1) % 2 == 0:
            self.configure_gradient_clipping(opt, gradient_clip_val=1.0)  # FSDP1 too
            opt.step()
            opt.zero_grad()
            sched.step()  # type: ignore[union-attr]
        return loss


class Curve(Logger):
    """What Lightning logs, kept in memory: (step, name, value) for every logged metric."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, str, float]] = []

    @property
    def name(self) -> str:
        return "curve"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows += [(int(step or 0), k, float(v)) for k, v in sorted(metrics.items())]


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy on CPU ranks (gloo), for tests without a GPU; on GPUs use
    ``strategy="fsdp"``. Lightning refuses ``FSDPStrategy`` itself with a CPU accelerator
    (``_check_strategy_and_fallback`` in ``trainer/connectors/accelerator_connector.py``
    checks ``type(strategy) is FSDPStrategy``), and wraps the model with ``device_id`` the
    device's index, None on CPU, which torch's FSDP refuses ("FSDP needs a non-CPU
    accelerator device"). Here the model is wrapped as Lightning would, on the CPU device;
    Lightning's own wrapping then finds it wrapped and goes on as it does on GPUs."""

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.root_device.type == "cpu":
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self.kwargs,
            )
        return super()._setup_model(model)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--samples", type=int, default=96, help="dataset size")
    ap.add_argument("--plain", action="store_true", help="Lightning alone (no Guard)")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    ap.add_argument("--manual", action="store_true", help="manual optimization")
    ap.add_argument(
        "--fsdp",
        type=int,
        choices=(1, 2),
        help="FSDP1 (FSDPStrategy), FSDP2 (ModelParallelStrategy)",
    )
    ap.add_argument(
        "--devices", type=int, default=1, help="without torchrun: Lightning starts this many"
    )
    ap.add_argument("--save-final", help="directory for rank<r>.pt with the final state")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # entry point: ours
    warnings.filterwarnings("ignore", module="lightning")  # its advice on workers and logs

    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", args.devices))
    curve = Curve()
    accum = 2  # micro-batches per optimizer step
    by_hand = {"grad_accum_steps": accum} if args.manual else {}
    guard = None if args.plain else GuardCallback(load_policy(), **by_hand)
    trainer = L.Trainer(
        accelerator="cpu" if not torch.cuda.is_available() else "auto",
        devices=world,
        strategy=_strategy(world, args.fsdp),
        max_steps=args.steps,
        accumulate_grad_batches=1 if args.manual else accum,  # by hand in manual mode
        gradient_clip_val=None if args.manual else 1.0,
        precision="32-true" if args.fp32 else "bf16-mixed",
        callbacks=[guard] if guard is not None else [],
        logger=curve,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tempfile.mkdtemp(prefix="lightning-"),
    )
    module = (ManualRegressor if args.manual else Regressor)(args.samples)
    trainer.fit(module)

    rank = trainer.global_rank
    if args.save_final:
        model, optim = _final(trainer, module, args.fsdp is not None)
        os.makedirs(args.save_final, exist_ok=True)
        torch.save(
            {
                "model": model,
                "optim": optim,
                "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "curve": curve.rows,
                "global_step": trainer.global_step,
                "batches_that_stepped": trainer.fit_loop.epoch_loop._batches_that_stepped,
                "guard_step": guard.guard.global_step if guard and guard.guard else -1,
                "engine": guard.guard.engine.name if guard and guard.guard else None,
            },
            os.path.join(args.save_final, f"rank{rank}.pt"),
        )
    if rank == 0:
        inner = guard.guard if guard is not None else None
        extra = "" if inner is None else f", {len(inner.incidents)} incident(s)"
        print(f"\ndone: {trainer.global_step} steps{extra}")
    trainer.strategy.barrier()  # every rank's files written before any rank leaves
    return 0


def _final(trainer: L.Trainer, module: L.LightningModule, sharded: bool) -> tuple[Any, Any]:
    """The final model and optimizer state; sharded (FSDP), gathered whole on every rank."""
    optimizer = trainer.optimizers[0]
    if not sharded:
        return module.state_dict(), optimizer.state_dict()
    assert trainer.model is not None
    return get_state_dict(trainer.model, optimizer, options=StateDictOptions(full_state_dict=True))


def _strategy(world: int, fsdp: int | None) -> Any:
    if fsdp == 2:  # FSDP2 over all ranks (no tensor parallelism)
        return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    if fsdp == 1:
        cls = CPUFSDPStrategy if not torch.cuda.is_available() else FSDPStrategy
        return cls(auto_wrap_policy={torch.nn.Linear})  # each layer its own FSDP unit
    return "ddp" if world > 1 else "auto"


if __name__ == "__main__":
    # Without the interpreter's teardown, where gloo can abort a process whose groups are
    # still alive (Lightning leaves them; a Guard fences them at exit, Lightning alone not).
    exit_process(main())
