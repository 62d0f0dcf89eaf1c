"""The training step's faults, installed on one Guard: wrappers around the methods of the
components they perturb (the Guard's ``backward``, the engine's ``backward``, ``judge`` and
``commit``, the data cursor's ``open``), and the ``nan_module`` forward hooks.

Each wrapper calls the method it wraps at the point where the step used to call the fault
inline, so every fault fires at the same step and micro-batch, on the same rank, with the
same journal events. A Guard whose policy has no faults holds none of this.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from orchestrator.faults.injector import FaultInjector
from orchestrator.faults.model import poison_hook, poison_local
from orchestrator.faults.parts import corrupt_slot

if TYPE_CHECKING:
    from orchestrator.guard import Guard


class StepFaults:
    """The faults of ``guard``'s step, injected by ``injector``: call :meth:`install` once,
    after the Guard built its components and before its first step."""

    def __init__(self, guard: Guard, injector: FaultInjector, pace: float = 0.0) -> None:
        self.guard, self.injector = guard, injector
        self.pace = pace  # slow_steps: seconds added to each step on this rank
        self.later = False  # a NaN gradient waiting for a local gradient to land in
        self.factor = 1.0  # lr_blowup's factor on the step being judged
        g, e = guard, guard.engine
        self._backward, self._engine_backward = g.backward, e.backward
        self._judge, self._commit, self._open = e.judge, e.commit, g.cursor.open

    def install(self) -> None:
        g, e = self.guard, self.guard.engine
        # Instance attributes shadow the methods: every component holding the engine or
        # the cursor goes through the wrapper as well.
        setattr(g, "backward", self.backward)  # noqa: B010 (a method, shadowed)
        setattr(e, "backward", self.engine_backward)  # noqa: B010
        setattr(e, "judge", self.judge)  # noqa: B010
        setattr(e, "commit", self.commit)  # noqa: B010
        setattr(g.cursor, "open", self.open)  # noqa: B010
        self.injector.install_module_faults(
            e.core, lambda: g.global_step, lambda: g.investigation.incident_step
        )

    def _real(self) -> bool:
        """A real pass of the step (not an isolation re-run, not a crash probe)."""
        return not self.guard.investigation.active and not self.guard._probing

    def open(self, loader: Any, ledger_url: str) -> None:
        """``perturb_params``: at the start of the step, before its snapshot and forward."""
        self._open(loader, ledger_url)
        g = self.guard
        if g._micro == 0:
            self.injector.perturb_params(g.global_step, g.engine.core)

    def backward(self, loss: torch.Tensor) -> None:
        """The loss as the faults make it (poisoned and outlier samples, ``inf_loss``,
        ``crash_sample``) is what the Guard's backward sees; ``guard.step(loss)`` still
        takes the tensor the loop gave."""
        g = self.guard
        if g._phase != "batch":
            self._backward(loss)  # the misuse error, as without faults
            return
        real = self._real()
        g.heartbeat.enter("backward")
        seen = self.injector.on_loss(loss, g.global_step, g._cur_ids, real, g._micro if real else 0)
        try:
            self._backward(seen)
        finally:
            if g._given is seen:
                g._given = loss

    def engine_backward(self, loss: torch.Tensor) -> None:
        """``nan_grad`` / ``broken_grads``: a NaN in one local gradient, before the engine
        reduces them or right after backward (:mod:`orchestrator.faults.model`); between
        micro-batches where no local gradient exists yet, after the next backward."""
        g, e = self.guard, self.guard.engine
        poison = self._real() and self.injector.grad_fault(g.global_step, g._micro)
        poison, self.later = poison or self.later, False
        inside = e._reduces_in_backward
        hook = poison_hook(e) if poison and inside else None
        try:
            self._engine_backward(loss)
        finally:
            if hook is not None:
                hook.remove()
        if poison and not inside and not poison_local(e):
            self.later = True

    def judge(self, lr_multiplier: float) -> list[torch.Tensor]:
        """Before the step is judged: ``slow_steps``, the process faults (``crash``,
        ``exit``, ``preempt``, ``hang``), ``corrupt_shm``, and ``lr_blowup``'s factor on
        this step's LR."""
        g, inj = self.guard, self.injector
        step = g.global_step
        if self.pace:
            time.sleep(self.pace)
        inj.process_faults(step, g.durable.settle)
        if g.shm is not None and inj.corrupt_shm_due(step):
            corrupt_slot(g.shm, g.ring.newest(lambda s: s.sealed))
        self.factor = inj.lr_factor(step)
        return self._judge(lr_multiplier * self.factor)

    def commit(
        self, lr_multiplier: float, clip_coef: float | None = None, overflow: bool | None = None
    ) -> None:
        self._commit(lr_multiplier * self.factor, clip_coef, overflow)
