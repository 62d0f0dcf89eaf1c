"""Hugging Face ``transformers.Trainer`` under the Guard (docs/hf-trainer.md).

``GuardedTrainer(..., guard_policy=policy)`` (or ``guarded(SFTTrainer)``) is the Trainer with
every optimizer step judged, refused steps rolled back, poisoned samples quarantined. Trainer
keeps its loop, its backward, DDP ``no_sync``, clipping, bf16, optimizer and scheduler steps,
its counters and its logging, evaluation and saving; the Guard hooks in where Trainer lets a
subclass (docs/dev/issue-32-design.md §1):

- ``get_batch_samples`` returns the step's micro-batches from ``guard.begin_step``: the same
  samples in the same order as Trainer's own prepared loader (a *tap* replays its sampler),
  through the Guard's resumable loader, which rewinds after a rollback and skips quarantined
  samples. It always returns ``gradient_accumulation_steps`` micro-batches, so Trainer's
  ``% GA`` sync phase never shifts; ``set_initial_training_values`` makes Trainer loop until
  ``max_steps`` steps are committed (replays use up iterations).
- ``training_step`` runs each micro-batch between ``begin_micro`` and ``end_micro``; Trainer's
  ``accelerator.backward`` reaches ``guard.backward`` (faults and isolation see the loss).
- The prepared optimizer's ``step`` is the Guard's: ``guard.step()`` judges the step (one
  all-reduce) and applies the inner optimizer, or runs the incident (isolation re-runs nested
  right there, through ``compute_loss``) and rolls back. A refused step is marked skipped, so
  Trainer does not step the scheduler.
- ``GuardCallback.on_step_end`` (right after ``DefaultFlowCallback``) puts Trainer's counters
  back after a refused step (Trainer has counted it), so nothing logs, evaluates or saves it.
- ``TrainerState``'s counters and the loss-logging accumulators ride in every snapshot (user
  state ``trainer``): a rollback or a restart restores them with the model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Sampler
from transformers import Trainer, TrainerCallback

from orchestrator.engines.framework import FrameworkEngine
from orchestrator.errors import UsageError
from orchestrator.guard import COMMIT, INCIDENT, Guard
from orchestrator.policy import Policy, load_policy

__all__ = ["GuardCallback", "GuardTrainerMixin", "GuardedTrainer", "guarded"]


class _Tap(Sampler[int]):
    """This rank's sample indices, epoch by epoch, in the order Trainer's prepared loader
    yields them: its (sharded) batch sampler, told the epoch as Trainer's ``_run_epoch``
    tells it, flattened. Indices only: no sample is loaded here."""

    def __init__(self, loader: Any, batch_size: int) -> None:
        self.loader, self.batch_size, self.epoch = loader, batch_size, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        loader = self.loader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.epoch)
        inner: Any = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(self.epoch)
        for batch in loader.batch_sampler:
            yield from (int(i) for i in batch)

    def __len__(self) -> int:
        return len(self.loader.batch_sampler) * self.batch_size


class _TrainerCounters:
    """Trainer's counters (``TrainerState``) and its loss-logging accumulators, kept in
    every snapshot: without the accumulators a logged mean would include refused steps."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t, s = self.trainer, self.trainer.state
        return {
            "global_step": int(s.global_step),
            "epoch": float(s.epoch or 0.0),
            "total_flos": float(s.total_flos),
            "num_input_tokens_seen": int(s.num_input_tokens_seen),
            "log_history": list(s.log_history),  # the snapshot copies the entries
            "best_metric": s.best_metric,
            "best_global_step": s.best_global_step,
            "best_model_checkpoint": s.best_model_checkpoint,
            "tr_loss": t._tr_loss,
            "globalstep_last_logged": int(t._globalstep_last_logged),
            "total_loss_scalar": float(t._total_loss_scalar),
            "current_flos": float(t.current_flos),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state
        self.apply(state)

    def apply(self, state: dict[str, Any]) -> None:
        t, s = self.trainer, self.trainer.state
        s.global_step, s.epoch = int(state["global_step"]), float(state["epoch"])
        s.total_flos = float(state["total_flos"])
        s.num_input_tokens_seen = int(state["num_input_tokens_seen"])
        s.log_history[:] = [dict(entry) for entry in state["log_history"]]
        s.best_metric, s.best_global_step = state["best_metric"], state["best_global_step"]
        s.best_model_checkpoint = state["best_model_checkpoint"]
        with torch.no_grad():
            t._tr_loss.copy_(state["tr_loss"])  # in place: Trainer's loop holds the tensor
        t._globalstep_last_logged = int(state["globalstep_last_logged"])
        t._total_loss_scalar = float(state["total_loss_scalar"])
        t.current_flos = float(state["current_flos"])


def _scheduled(step: Callable[[], None]) -> Callable[..., None]:
    """``step`` as the prepared optimizer's ``step``, marked as torch's LR scheduler marks
    the step it wraps (else it warns that the step was overridden after it)."""

    def optimizer_step(*args: Any, **kwargs: Any) -> None:
        step()

    optimizer_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return optimizer_step


class GuardCallback(TrainerCallback):
    """Runs right after ``DefaultFlowCallback``: after a refused step it puts Trainer's
    counters back where the rollback left them (Trainer counted the step after the rollback)
    and clears the flags that step raised; after a committed one it sets ``state.epoch``
    from the Guard's data position."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        t = self.trainer
        if t._guard_outcome != COMMIT:
            restored = t._guard_counters.restored
            if restored is not None:
                t._guard_counters.apply(restored)
            state.global_step = t.guard.global_step
            control.should_log = control.should_evaluate = control.should_save = False
            control.should_training_stop = state.global_step >= state.max_steps
            return control
        position = t._guard_loader.batch_sampler  # epoch and samples taken (quarantined too)
        state.epoch = position.epoch + position.raw / max(len(t._guard_tap), 1)
        return control


class GuardTrainerMixin:
    """Trainer's hooks routed through the Guard (module docstring); put it first in the
    bases of a Trainer class (:func:`guarded` does).

    Args (besides the Trainer's):
        guard_policy: a :class:`Policy` (None: :func:`load_policy`). Its ``clip.max_norm``
            must be unset: Trainer clips (``max_grad_norm``).
        guard_run_dir: the run directory (default $ORCHESTRATOR_RUN_DIR, else a fresh one).
        guard_fresh: start a new run even if the run directory holds one.
    """

    def __init__(
        self,
        *args: Any,
        guard_policy: Policy | None = None,
        guard_run_dir: str | None = None,
        guard_fresh: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.guard: Guard | None = None
        self._guard_policy = guard_policy if guard_policy is not None else load_policy()
        self._guard_where = (guard_run_dir, guard_fresh)
        self._guard_outcome = COMMIT
        self._guard_counters = _TrainerCounters(self)
        self._guard_loader: Any = None
        self._guard_tap: _Tap | None = None
        self._guard_undo: list[tuple[Any, str]] = []
        t: Any = self
        callbacks = t.callback_handler.callbacks
        after = next(
            (i + 1 for i, c in enumerate(callbacks) if type(c).__name__ == "DefaultFlowCallback"),
            0,
        )
        callbacks.insert(after, GuardCallback(self))

    # ---------------------------------------------------------------- Trainer's hooks ----
    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint:
            raise UsageError(
                "GuardedTrainer.train(resume_from_checkpoint=...): the Guard resumes by itself "
                "from its run directory's newest durable snapshot (model, optimizer, scheduler, "
                "Trainer's counters and the data position); call train() without it"
            )
        # Each train() call has its own Guard (built at its first step; it resumes from the
        # run directory like a restart would).
        self.guard, self._guard_outcome = None, COMMIT
        try:
            out = super().train(None, *args, **kwargs)  # type: ignore[misc]
        except BaseException as err:
            if self.guard is not None:
                self._guard_release()
                self.guard.__exit__(type(err), err, None)
            raise
        if self.guard is not None:
            self._guard_release()
            self.guard.close()
        return out

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple[Any, ...]:
        # Trainer's counts, but an endless epoch loop that stops at max_steps committed steps
        # (DefaultFlowCallback's stop): replays after a rollback use up iterations.
        values = super().set_initial_training_values(args, dataloader)  # type: ignore[misc]
        _, _, examples, samples, total, _, max_steps = values
        ga = args.gradient_accumulation_steps
        return sys.maxsize, max_steps, examples, samples, total, max_steps * ga, max_steps

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: Any
    ) -> tuple[list[Any], Any]:
        t: Any = self
        guard = self.guard if self.guard is not None else self._guard_start()
        max_steps, probe = t.state.max_steps, self._guard_rerun
        batches = guard.begin_step(self._guard_loader, num_batches, max_steps, probe)
        return batches, t._get_num_items_in_batch(batches, device)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        guard = self.guard
        assert guard is not None
        guard.begin_micro()
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        if not guard.last_micro:
            guard.step()  # "accumulate"; the last micro-batch's step is the optimizer's
            guard.end_micro()
        return loss

    # ---------------------------------------------------------------- the Guard ---------
    def _guard_start(self) -> Guard:
        """Build the Guard at the first fetch, once Trainer has prepared the model, the
        optimizer, the scheduler and the loader, and hook it into them."""
        t: Any = self
        policy, acc = self._guard_policy, t.accelerator
        if policy.clip.max_norm is not None:
            raise UsageError(
                "GuardedTrainer: the policy's clip.max_norm is set, but Trainer clips "
                "(TrainingArguments.max_grad_norm); drop clip.max_norm from the policy"
            )
        if t.is_deepspeed_enabled or t.is_fsdp_enabled or acc.scaler is not None:
            raise UsageError(
                "GuardedTrainer supports DDP or a single process, in fp32 or bf16; DeepSpeed, "
                "FSDP and fp16 (a GradScaler) are not supported yet (docs/hf-trainer.md)"
            )
        loader, ga = t.callback_handler.train_dataloader, t.args.gradient_accumulation_steps
        backward = acc.backward
        engine = FrameworkEngine(
            t.model_wrapped,
            t.optimizer,
            t.lr_scheduler,
            backward=lambda loss: backward(loss, **self._guard_backward_kwargs),
            grad_accum_steps=ga,
            loss_divided=True,  # training_step divides (or normalises by the step's tokens)
        )
        run_dir, fresh = self._guard_where
        guard = Guard(
            policy,
            engine=engine,
            run_dir=run_dir,
            fresh=fresh,
            state={"trainer": self._guard_counters},
        )
        self.guard = guard
        self._guard_backward_kwargs: dict[str, Any] = {}
        self._guard_tap = _Tap(loader, t._train_batch_size)
        self._guard_loader = guard.dataloader(
            loader.dataset,
            t._train_batch_size,
            sampler=self._guard_tap,
            collate_fn=loader.collate_fn,
            num_workers=t.args.dataloader_num_workers,
        )
        self._guard_hook(acc, "backward", self._guard_backward)
        self._guard_hook(t.optimizer, "step", _scheduled(self._guard_optimizer_step))
        return guard

    def _guard_hook(self, obj: Any, name: str, fn: Any) -> None:
        setattr(obj, name, fn)  # an instance attribute shadows the method
        self._guard_undo.append((obj, name))

    def _guard_release(self) -> None:
        for obj, name in self._guard_undo:
            if name in vars(obj):
                delattr(obj, name)
        self._guard_undo = []

    def _guard_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``accelerator.backward`` during training: through the Guard (which calls
        Accelerate's own with these arguments)."""
        assert self.guard is not None
        self._guard_backward_kwargs = kwargs
        self.guard.backward(loss)

    def _guard_optimizer_step(self) -> None:
        """The prepared optimizer's ``step``: judge the step; commit applies the inner
        optimizer, an incident is investigated here and rolled back. A refused step reads as
        skipped to Trainer (``optimizer_step_was_skipped``): no scheduler step."""
        guard, t = self.guard, self
        assert guard is not None
        outcome = guard.step()
        if outcome == INCIDENT:
            guard.run_reruns(self._guard_rerun)
        guard.end_micro()
        t._guard_outcome = outcome
        opt: Any = getattr(self, "optimizer")  # noqa: B009 (the mixin's Trainer attribute)
        opt._is_overflow = outcome != COMMIT
        opt._opt_called = True  # what torch's scheduler wrapper records of a step

    def _guard_rerun(self, batch: Any) -> torch.Tensor:
        """One isolation re-run: Trainer's forward of some of the bad step's samples, as
        ``training_step`` runs it; its mean loss, the scale of the step's mean the Guard
        checked (the sum of training_step's divided losses)."""
        t: Any = self
        inputs = t._prepare_inputs(batch)
        with t.compute_loss_context_manager():
            loss: torch.Tensor = t.compute_loss(t.model_wrapped, inputs)
        return loss


class GuardedTrainer(GuardTrainerMixin, Trainer):
    """``transformers.Trainer`` under the Guard: Trainer's arguments plus ``guard_policy``
    (and ``guard_run_dir``, ``guard_fresh``); see :class:`GuardTrainerMixin`."""


def guarded(cls: type) -> type:
    """A Trainer subclass (``SFTTrainer``, your own) under the Guard:
    ``guarded(SFTTrainer)(model=..., args=..., guard_policy=policy).train()``."""
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise UsageError(f"guarded({cls!r}): needs a transformers.Trainer subclass")
    return type("Guarded" + cls.__name__, (GuardTrainerMixin, cls), {})
