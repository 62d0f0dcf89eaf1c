"""Plain PyTorch: one process, or DDP (``DistributedDataParallel``) under torchrun."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.amp.grad_scaler import OptState
from torch.nn.parallel import DistributedDataParallel

from orchestrator.diagnose import low_precision
from orchestrator.engines.base import Engine
from orchestrator.engines.inplace import Copier, copy_module, copy_optimizer
from orchestrator.engines.rebind_ddp import ddp_unsupported, mirror_ddp
from orchestrator.engines.registry import EngineArgs
from orchestrator.errors import UsageError
from orchestrator.rng import rng_state, set_rng_state
from orchestrator.snapshot import Snapshot


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class TorchEngine(Engine):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        *,
        refuse_foreign: bool = True,
    ) -> None:
        self.model = model
        # State is taken from the unwrapped module, so keys carry no DDP "module." prefix and
        # a snapshot from a DDP run loads into a single-process run and back.
        self.core = model.module if isinstance(model, DistributedDataParallel) else model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self._unscaled = False
        # The Guard steps the optimizer; a step it did not make would double every update,
        # or leave the check judging zeroed gradients. Refused loudly (released at close).
        self._applying = False
        self._foreign = (
            optimizer.register_step_pre_hook(self._refuse_foreign_step) if refuse_foreign else None
        )
        if scheduler is None and hasattr(optimizer.step, "_wrapped_by_lr_sched"):
            warnings.warn(
                "an LR scheduler is attached to this optimizer but was not passed to the Guard: "
                "it will not be rolled back with the model (nor stepped by the Guard); pass "
                "Guard(scheduler=...)",
                UserWarning,
                stacklevel=4,
            )

    @classmethod
    def from_args(cls, args: EngineArgs) -> TorchEngine:
        """From ``model=``, ``optimizer=`` and the optional scheduler and scaler; with
        ``grad_accum_steps`` micro-batches per optimizer step."""
        if args.model is None or args.optimizer is None:
            raise UsageError("Guard needs model= and optimizer= (or engine= for DeepSpeed)")
        from orchestrator.engines.framework import unwrap_optimizer, unwrap_scheduler

        # A framework's wrapped optimizer (Accelerate's, Lightning's) holds the torch one; the
        # Guard steps that, and the wrapper's own step is refused with the rest.
        optimizer, scheduler = unwrap_optimizer(args.optimizer), unwrap_scheduler(args.scheduler)
        adapter = cls(args.model, optimizer, scheduler, args.scaler)
        adapter.micro_steps_per_step = args.grad_accum_steps or 1
        return adapter

    def _refuse_foreign_step(self, *_: Any) -> None:
        if not self._applying:
            raise UsageError(
                "optimizer.step() was called outside the Guard: guard.step() steps the "
                "optimizer, the scheduler and the GradScaler and zeroes the gradients; remove "
                "optimizer.step() (and zero_grad(), scheduler.step(), scaler.step()) from the loop"
            )

    def rebind_unsupported(self) -> str | None:
        return ddp_unsupported(self.model)

    def rebind(self) -> None:
        mirror_ddp(self.model)

    def release(self) -> None:
        if self._foreign is not None:
            self._foreign.remove()

    @property
    def has_loss_scaler(self) -> bool:
        return self.scaler is not None

    def lr(self) -> float | None:
        return float(self.optimizer.param_groups[0]["lr"])

    def loss_scale(self) -> float | None:
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def can_rerun_fp32(self, autocast: bool = False) -> bool:
        # Plain PyTorch or DDP with fp16/bf16 parameters, or fp32 ones under the loop's
        # autocast (sharded engines own their dtype).
        return autocast or low_precision(self.core)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.micro_steps_per_step > 1:
            loss = loss / self.micro_steps_per_step  # the step's gradient is the mean
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        # DDP decides in forward whether backward all-reduces: what DDP.no_sync() sets.
        return self.local_grads()

    def grads(self) -> list[torch.Tensor]:
        self._unscale()
        return [p.grad for p in self._params() if p.grad is not None]

    def _unscale(self) -> None:
        """Unscale the gradients once per step, unless the loop already did (to clip by
        hand: ``scaler.unscale_(optimizer)`` then ``clip_grad_norm_``); a second
        ``unscale_`` would raise."""
        if self.scaler is None or self._unscaled:
            return
        # GradScaler keeps no public record of it; this is the one unscale_ itself checks.
        stage = self.scaler._per_optimizer_states[id(self.optimizer)]["stage"]
        if stage is not OptState.UNSCALED:
            self.scaler.unscale_(self.optimizer)
        self._unscaled = True

    def _apply(self, lr_multiplier: float, overflow: bool | None = None) -> None:
        self._optimizer_step(lr_multiplier, overflow)
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self, lr_multiplier: float, overflow: bool | None) -> None:
        """The optimizer's step (through the scaler, if any) with the LR times
        ``lr_multiplier`` for this step only."""
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        if lr_multiplier != 1.0:
            for g in groups:
                g["lr"] = g["lr"] * lr_multiplier
        self._applying = True
        try:
            if self.scaler is None:
                self.optimizer.step()
            elif overflow is None:
                self.scaler.step(self.optimizer)  # skips on its own (local) found_inf
                self.scaler.update()
            else:
                self._scaler_step(overflow)
        finally:
            self._applying = False
            for g, lr in zip(groups, saved, strict=True):
                g["lr"] = lr
        self._unscaled = False

    def _scaler_step(self, overflow: bool) -> None:
        """The GradScaler's step and update, gated by the check's all-reduced verdict.

        ``scaler.step`` skips by this rank's own ``found_inf``: one ``.item()`` per step
        (a host sync, besides the check's) with a non-fused optimizer, and under FSDP1,
        whose gradients are local shards, a verdict of this rank's shard alone: one rank
        skips while another steps, and their scales part ways. The check already
        all-reduced whether any rank's gradients are non-finite; that flag becomes every
        ``found_inf`` the update reads (filled on the device, no sync), and the optimizer
        steps only when it says finite, identically on every rank."""
        assert self.scaler is not None
        self._unscale()  # judge did; clipping by hand may not have
        state = self.scaler._per_optimizer_states[id(self.optimizer)]
        for found_inf in state["found_inf_per_device"].values():
            found_inf.fill_(1.0 if overflow else 0.0)
        if not overflow:
            # Gradients are unscaled already: a fused optimizer needs no grad_scale either.
            self.optimizer.step()
        self.scaler.update()

    def abandon(self) -> None:
        if self.scaler is not None and self._unscaled:
            self.scaler.update()  # clears the scaler's per-step record; restore resets scale
        self._unscaled = False
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _model_state(self) -> dict[str, Any]:
        """The model's part of a snapshot: references to its tensors."""
        return self.core.state_dict()

    def state(self) -> dict[str, Any]:
        return {
            "model": self._model_state(),
            "optim": self.optimizer.state_dict(),
            "sched": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": rng_state(),
        }

    def restore(self, snap: Snapshot, loss_scale_factor: float) -> None:
        # Into the live tensors, from the host buffers (orchestrator/engines/inplace.py):
        # every parameter, buffer and optimizer-state tensor keeps its object and storage.
        copier = Copier()
        self._restore_model(snap, copier)
        self._restore_optim(snap, copier)
        copier.finish()
        self._restore_rest(snap, loss_scale_factor)

    def _restore_model(self, snap: Snapshot, copier: Copier) -> None:
        saved = snap.host("model")
        if not copy_module(self.core.state_dict(), saved, copier):
            # Keys or shapes differ (a resume into another model): load_state_dict says
            # which, and copies what it takes from the host buffers in place too.
            self.core.load_state_dict(saved)

    def _restore_optim(self, snap: Snapshot, copier: Copier) -> None:
        """The optimizer's state, copied into its own tensors. Where the snapshot has state
        the live optimizer lacks (a resume into a fresh process), ``load_state_dict``
        creates it, from host copies (it keeps what it is given); state the snapshot lacks
        (taken before the first step) is dropped, as ``load_state_dict`` would."""
        params = self._params()
        opt = self.optimizer
        live = {i: opt.state[p] for i, p in enumerate(params) if p in opt.state}
        fresh = copy_optimizer(live, snap.host("optim"), opt.param_groups, copier)
        if fresh is None:
            copier.finish()  # before load_state_dict replaces tensors a copy may write
            opt.load_state_dict(snap.host("optim", clone=True))
            return
        for i in fresh:
            del opt.state[params[i]]  # no state at the snapshot: created by its next step

    def _restore_rest(self, snap: Snapshot, loss_scale_factor: float) -> None:
        """Scheduler, loss scaler (its scale times the factor) and RNG: the same for every
        engine built on this one."""
        if self.scheduler is not None:
            self.scheduler.load_state_dict(snap.materialize("sched", clone=True))
        if self.scaler is not None:
            scaler_state = snap.materialize("scaler", clone=True)
            scaler_state["scale"] = scaler_state["scale"] * loss_scale_factor
            self.scaler.load_state_dict(scaler_state)
        set_rng_state(snap.materialize("rng", clone=True))

    def digest_tensors(self) -> tuple[list[torch.Tensor], bool]:
        tensors: list[torch.Tensor] = list(self.core.parameters())
        for p in self._params():  # the optimizer's order, not its state's insertion order
            state = self.optimizer.state.get(p, {})
            tensors += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
        return tensors, self._grads_replicated

    def estimate_state_bytes(self) -> int:
        model = _tensor_bytes(self.core.state_dict().values())
        optim = sum(_tensor_bytes(s.values()) for s in self.optimizer.state.values())
        if not self.optimizer.state:
            # Lazy optimizers (Adam & co.) create their state on the first step; assume two
            # tensors the size of each parameter, the common case.
            optim = 2 * _tensor_bytes(self._params())
        return model + optim

    @contextlib.contextmanager
    def local_grads(self) -> Iterator[None]:
        ddp = self.model if isinstance(self.model, DistributedDataParallel) else None
        if ddp is None:
            yield
            return
        before = ddp.require_backward_grad_sync
        ddp.require_backward_grad_sync = False  # what DDP.no_sync() sets, held across yield
        try:
            yield
        finally:
            ddp.require_backward_grad_sync = before
