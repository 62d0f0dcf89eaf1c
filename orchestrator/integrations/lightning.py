"""Lightning (``lightning.pytorch``) under the Guard (docs/lightning.md).

``Trainer(..., callbacks=[GuardCallback(policy)])`` is the Lightning fit with every optimizer
step judged, refused steps rolled back, poisoned samples quarantined. Lightning keeps its
loop, its automatic optimization (closures), DDP ``no_sync`` (or FSDP, FSDP2: the engine
snapshots each rank's shards), ``accumulate_grad_batches``,
``gradient_clip_val``, bf16, its optimizer and scheduler steps, its counters, callbacks and
logging; the callback hooks in at the start of training (docs/dev/issue-32-design.md §3):

- Lightning iterates *tickets*: its fetcher (which reads one ahead) takes placeholders, and
  each one becomes, when Lightning runs it, the next micro-batch of ``guard.begin_step``:
  the samples Lightning's own prepared loader gives, in its order (a *tap* replays its
  sampler), through the Guard's resumable loader, which rewinds after a rollback and skips
  quarantined samples. Lightning sees one endless epoch and stops at ``max_steps``.
- Lightning's backward (``strategy.backward``) goes through ``guard.backward``.
- The optimizer's ``step(closure)``, which Lightning calls on the last micro-batch, runs the
  closure (training step, backward, ``on_before_optimizer_step``, clipping), then
  ``guard.step()``: a commit applies the optimizer; an incident is investigated right there
  (isolation re-runs through Lightning's ``training_step``) and rolled back.
- Manual optimization (``GuardCallback(grad_accum_steps=N)``): the same, with the user's
  ``opt.step()`` inside ``training_step`` judged, and re-runs of ``training_step`` whose
  ``manual_backward`` loss the Guard takes (``lightning_parts._Manual``).
- After a refused step Lightning's scheduler step and its logging of the step are skipped,
  and its counters (``global_step``, ``batch_progress``, ``_batches_that_stepped``, …) are put
  back in ``on_train_batch_end`` where the rollback left them (Lightning counted the step);
  they ride in every snapshot (user state ``lightning``), so a restart resumes them too.
- SIGTERM is the Guard's during the fit (all ranks stop together at a step boundary).
"""

from __future__ import annotations

import signal
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.strategies import (
    DDPStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.combined_loader import CombinedLoader

from orchestrator.engines.framework import FrameworkEngine, framework_engine
from orchestrator.errors import UsageError
from orchestrator.guard import COMMIT, INCIDENT, Guard
from orchestrator.integrations.lightning_parts import (
    _Counters,
    _follow_epoch,
    _Manual,
    _Tap,
    _Ticket,
    _Tickets,
)
from orchestrator.policy import Policy, load_policy

__all__ = ["GuardCallback"]

_ABSENT = object()  # an attribute the object did not hold itself (a method of its class)


class GuardCallback(Callback):
    """The Guard in a Lightning fit (module docstring): pass it in ``callbacks``; it runs
    first at every hook (it moves itself to the front).

    Args:
        policy: a :class:`Policy` (None: :func:`load_policy`). Its ``clip.max_norm`` must be
            unset: Lightning clips (``gradient_clip_val``).
        run_dir: the run directory (default $ORCHESTRATOR_RUN_DIR, else a fresh one).
        fresh: start a new run even if the run directory holds one.
        grad_accum_steps: manual optimization only: the micro-batches (``training_step``
            calls) per optimizer step, the last of which calls ``opt.step()``.
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        run_dir: str | None = None,
        fresh: bool = False,
        grad_accum_steps: int | None = None,
    ) -> None:
        self.policy = policy if policy is not None else load_policy()
        self.where = (run_dir, fresh)
        self.accum = grad_accum_steps  # manual optimization: micro-batches per step
        self._manual: _Manual | None = None
        self.guard: Guard | None = None
        self.outcome = COMMIT
        self._trainer: Any = None
        self._loader: Any = None
        self._tap: Any = None
        self._queue: list[Any] = []
        self._backward_args: tuple[Any, ...] = ()
        self._undo: list[tuple[Any, str, Any]] = []
        self._counters: _Counters | None = None
        self._logged_to = 0  # the logger steps logged so far (never logged twice)

    # ---------------------------------------------------------------- Lightning's hooks --
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # First at every hook: after a refused step the counters are back before any other
        # callback's on_train_batch_end reads them. (Removing and inserting before the
        # running hook's position leaves the positions after it unchanged.)
        callbacks = trainer.callbacks
        if callbacks and callbacks[0] is not self:
            callbacks.remove(self)
            callbacks.insert(0, self)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.ckpt_path:
            raise UsageError(
                f"GuardCallback: fit(ckpt_path={trainer.ckpt_path!r}): the Guard resumes by "
                "itself from its run directory's newest durable snapshot (model, optimizer, "
                "scheduler, Lightning's counters and the data position); drop ckpt_path"
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._check(trainer, pl_module)
        self._trainer = trainer
        self._start(trainer)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.outcome == COMMIT or self._counters is None:
            return
        restored = self._counters.restored
        if restored is not None:
            # Lightning counted the refused step after the rollback; it counts one more
            # completed batch (and one stepped) after this hook.
            self._counters.apply(restored, counted=1)
        if self._manual is not None:
            self._manual.after_refused()  # the scheduler step training_step took after it
        trainer.fit_loop.epoch_loop._skip_next_val = True  # validated at the count already

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._release()
        if self.guard is not None:
            self.guard.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._release()
        if self.guard is not None:
            self.guard.__exit__(type(exception), exception, None)

    # ---------------------------------------------------------------- the Guard ---------
    def _check(self, trainer: Any, pl_module: Any) -> None:
        if pl_module.automatic_optimization and self.accum not in (None, 1):
            raise UsageError(
                f"GuardCallback(grad_accum_steps={self.accum}) is for manual optimization; "
                "with automatic optimization set Trainer(accumulate_grad_batches=...)"
            )
        if self.policy.clip.max_norm is not None:
            raise UsageError(
                "GuardCallback: the policy's clip.max_norm is set, but Lightning clips "
                "(Trainer(gradient_clip_val=...)); drop clip.max_norm from the policy"
            )
        if trainer.max_steps is None or trainer.max_steps < 1:
            raise UsageError(
                "GuardCallback needs Trainer(max_steps=N): the Guard replays refused steps, "
                "so the fit runs until N steps are committed"
            )
        _check_strategy(trainer)
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise UsageError("GuardCallback supports one optimizer and at most one LR scheduler")
        loaders = trainer.fit_loop._combined_loader.flattened
        if len(loaders) != 1 or getattr(loaders[0], "batch_sampler", None) is None:
            raise UsageError(
                "GuardCallback needs one train DataLoader over a map-style dataset (its sample "
                "ids are the dataset's indices); an IterableDataset or several loaders are not "
                "supported yet (docs/lightning.md)"
            )

    def _start(self, trainer: Any) -> None:
        """Build the Guard once Lightning has set up the model, the optimizer, the scheduler
        and the train loader, and hook it into them."""
        fit = trainer.fit_loop
        (loader,) = fit._combined_loader.flattened
        optimizer = trainer.optimizers[0]
        configs = trainer.lr_scheduler_configs
        strategy = trainer.strategy
        backward = strategy.backward
        self._backward_args = (optimizer,)
        scheduler = configs[0].scheduler if configs else None
        engine = framework_engine(
            strategy.model,
            optimizer,
            scheduler,
            backward=lambda loss: backward(loss, *self._backward_args),
            grad_accum_steps=self.accum or trainer.accumulate_grad_batches,
            # Automatic optimization divides each loss by accumulate_grad_batches (its
            # closure); a manual training_step's own scale is kept, as its re-runs take it.
            loss_divided=trainer.lightning_module.automatic_optimization,
        )
        _own_sigterm(trainer)
        self._counters = _Counters(trainer)
        if not trainer.lightning_module.automatic_optimization:
            self._manual = _Manual(trainer, self._counters, optimizer, scheduler)
        run_dir, fresh = self.where
        guard = Guard(
            self.policy,
            engine=engine,
            run_dir=run_dir,
            fresh=fresh,
            state={"lightning": self._counters},
        )
        self.guard = guard
        self._tap = _Tap(loader)
        self._loader = guard.dataloader(
            loader.dataset,
            int(loader.batch_size),
            sampler=self._tap,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
        )
        # Lightning iterates tickets from here on (one endless epoch; max_steps ends it).
        self._hook(fit, "_combined_loader", CombinedLoader(_Tickets(), "max_size_cycle"))
        fit._data_fetcher.setup(fit._combined_loader)
        iter(fit._data_fetcher)
        self._hook(fit, "max_batches", float("inf"))
        self._hook(trainer.precision_plugin, "convert_input", self._convert_input)
        self._hook(strategy, "backward", self._backward)
        self._hook(optimizer, "step", _scheduled(optimizer.step, self._optimizer_step, engine))
        loop = fit.epoch_loop
        self._hook(loop, "update_lr_schedulers", _unless_refused(self, loop.update_lr_schedulers))
        connector = trainer._logger_connector
        self._hook(connector, "update_train_step_metrics", self._log_step)

    def _hook(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name`` until the fit ends (an instance attribute shadows a method)."""
        self._undo.append((obj, name, vars(obj).get(name, _ABSENT)))
        setattr(obj, name, value)

    def _release(self) -> None:
        """Lightning's objects as they were (the train loader Lightning prepared too)."""
        for obj, name, before in reversed(self._undo):
            if before is not _ABSENT:
                setattr(obj, name, before)
            elif name in vars(obj):
                delattr(obj, name)
        self._undo = []

    def _convert_input(self, batch: Any) -> Any:
        """Lightning's first touch of a fetched batch: a ticket becomes the next micro-batch
        of the Guard's step (the whole step is fetched at its first)."""
        original = type(self._trainer.precision_plugin).convert_input
        if not isinstance(batch, _Ticket):
            return original(self._trainer.precision_plugin, batch)
        guard = self.guard
        assert guard is not None
        if not self._queue:
            trainer = self._trainer
            n, max_steps = guard.engine.micro_steps_per_step, trainer.max_steps
            self._queue = guard.begin_step(self._loader, n, max_steps, self._rerun)
            self.outcome = COMMIT
            _follow_epoch(trainer.fit_loop.epoch_progress, self._tap.epoch)
        guard.begin_micro()
        return original(self._trainer.precision_plugin, self._queue.pop(0))

    def _log_step(self) -> None:
        """Lightning's logging of a step's metrics (logger step ``_batches_that_stepped``),
        skipped for a refused step and for a replay of a step logged before the rollback:
        loggers get each step once, in order."""
        trainer = self._trainer
        loop = trainer.fit_loop.epoch_loop
        step = int(loop._batches_that_stepped)
        if self.outcome != COMMIT or step < self._logged_to:
            return
        type(trainer._logger_connector).update_train_step_metrics(trainer._logger_connector)
        if not loop._should_accumulate():
            self._logged_to = step + 1

    def _backward(self, loss: torch.Tensor, optimizer: Any = None, *args: Any, **kw: Any) -> Any:
        """``strategy.backward`` during training: through the Guard (which calls Lightning's
        own with these arguments); a micro-batch before the last is done after it."""
        guard = self.guard
        assert guard is not None
        if self._manual is not None and self._manual.rerunning:
            return self._manual.took(loss)  # the Guard runs the re-run's backward
        self._backward_args = (optimizer, *args)
        guard.backward(loss)
        if not guard.last_micro:
            guard.step()  # "accumulate"
            guard.end_micro()
        return loss

    def _optimizer_step(self, closure: Callable[[], Any] | None) -> Any:
        """The optimizer's ``step(closure)`` as Lightning calls it on the last micro-batch:
        the closure, then ``guard.step()`` (commit applies the optimizer; an incident is
        investigated here and rolled back, and Lightning's step is then refused)."""
        guard, manual = self.guard, self._manual
        assert guard is not None
        result = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        if manual is not None and manual.rerunning:
            return result  # a re-run's opt.step() in training_step: the Guard judges it
        # Manual optimization steps inside training_step, under its autocast: the Guard's
        # own arithmetic (health checks) runs without it, the re-runs under their own.
        device = self._trainer.strategy.root_device.type
        with torch.autocast(device, enabled=False):
            outcome = guard.step()
            if outcome == INCIDENT:
                guard.run_reruns(self._rerun)
        guard.end_micro()
        self.outcome = outcome
        if manual is not None and outcome != COMMIT:
            manual.rolled_back()
        return result

    def _rerun(self, batch: Any) -> torch.Tensor:
        """One isolation re-run: Lightning's training step of some of the bad step's samples,
        as its automatic optimization runs it; its mean loss, the scale of the step's mean
        the Guard checked (the sum of the closure's divided losses)."""
        trainer = self._trainer
        plugin = trainer.precision_plugin
        batch = type(plugin).convert_input(plugin, batch)
        batch = trainer.lightning_module._on_before_batch_transfer(batch, dataloader_idx=0)
        batch = call._call_strategy_hook(trainer, "batch_to_device", batch, dataloader_idx=0)
        loop = trainer.fit_loop.epoch_loop
        kwargs = loop._build_kwargs(OrderedDict(), batch, loop.batch_idx)
        if self._manual is not None:
            return self._manual.rerun(kwargs.values())
        out = call._call_strategy_hook(trainer, "training_step", *kwargs.values())
        loss: torch.Tensor = out["loss"] if isinstance(out, dict) else out
        return loss


def _check_strategy(trainer: Any) -> None:
    """Refuse, with what to do, a strategy or precision the Guard cannot snapshot and undo."""
    strategy = trainer.strategy
    # DDP's own subclasses (DeepSpeed's) are not DDP to the Guard; FSDP's are FSDP.
    known = type(strategy) in (DDPStrategy, SingleDeviceStrategy) or isinstance(
        strategy, (FSDPStrategy, ModelParallelStrategy)
    )
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if not known or scaler is not None:
        raise UsageError(
            "GuardCallback supports the DDP, single-device, FSDP and ModelParallelStrategy "
            f"(FSDP2) strategies in fp32 or bf16; {type(strategy).__name__}"
            f"{' with fp16 (a GradScaler)' if scaler is not None else ''} is not supported "
            "yet (docs/lightning.md)"
        )
    tensor_parallel = getattr(strategy, "_tensor_parallel_size", 1)
    if isinstance(strategy, ModelParallelStrategy) and tensor_parallel != 1:
        raise UsageError(
            f"GuardCallback: ModelParallelStrategy(tensor_parallel_size={tensor_parallel}): "
            "the Guard snapshots FSDP2 shards over the data-parallel ranks alone; set "
            "tensor_parallel_size=1 (data_parallel_size=the world size)"
        )


def _scheduled(
    original: Callable[..., Any], step: Callable[[Any], Any], engine: FrameworkEngine
) -> Callable[..., Any]:
    """The optimizer's ``step``: Lightning's call goes to ``step(closure)``; the Guard's
    commit (the engine applying the step) to the original. Marked as torch's LR scheduler
    marks the step it wraps (else it warns that the step was overridden after it)."""

    def optimizer_step(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if getattr(engine, "_applying", False):
            return original()
        return step(closure)

    optimizer_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    return optimizer_step


def _own_sigterm(trainer: Any) -> None:
    """SIGTERM back to the handler before Lightning's, which the Guard's then chains: the
    Guard stops all ranks together at a step boundary (a durable snapshot, ``Preempted``).
    Lightning's handler would stop the signalled rank alone, after a broadcast of its own
    from inside the handler (collectives out of step with the other ranks: a hang).
    Lightning puts its original handlers back at its teardown."""
    if threading.current_thread() is not threading.main_thread():
        return
    original = trainer._signal_connector._original_handlers.get(signal.SIGTERM)
    if original is not None:
        signal.signal(signal.SIGTERM, original)


def _unless_refused(callback: GuardCallback, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, skipped after a refused step (Lightning's scheduler step, its logging)."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if callback.outcome != COMMIT:
            return None
        return fn(*args, **kwargs)

    return guarded
