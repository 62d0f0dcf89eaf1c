"""The Guard's step internals: the crash probe of a batch, the finite check of a step's
last micro-batch and its commit or incident. :class:`orchestrator.guard.Guard` runs them
from its public step protocol (``batches``, ``backward``, ``step``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from orchestrator.adjust import LRAdjuster
from orchestrator.autotune import AutoTune
from orchestrator.check import Checked, StepCheck
from orchestrator.comm import Comm
from orchestrator.crashes import IN_BODY, CrashProbe, StepMarker, Suspicion
from orchestrator.cursor import DataCursor
from orchestrator.engines import Engine
from orchestrator.errors import UsageError
from orchestrator.heartbeat import Heartbeat
from orchestrator.investigate import Investigation
from orchestrator.journal import Decisions, Journal
from orchestrator.keeper import StateKeeper
from orchestrator.lifecycle import Lifecycle
from orchestrator.metrics import Metrics
from orchestrator.policy import Policy
from orchestrator.recovery import Recovery
from orchestrator.rejoin import Rejoin
from orchestrator.rng import rng_state, set_rng_state
from orchestrator.snapshot import SnapshotRing

# Outcomes of Guard.step.
COMMIT, OVERFLOW_SKIP, ACCUMULATE = "commit", "overflow_skip", "accumulate"
INCIDENT, PROBE = "incident", "probe"


class StepInternals:
    """Part of the Guard: uses the attributes declared here, which the Guard sets."""

    policy: Policy
    comm: Comm
    engine: Engine
    journal: Journal
    _decide: Decisions
    ring: SnapshotRing
    adjuster: LRAdjuster
    cursor: DataCursor
    marker: StepMarker
    heartbeat: Heartbeat
    keeper: StateKeeper
    check: StepCheck
    metrics: Metrics
    investigation: Investigation
    recovery: Recovery
    rejoin: Rejoin
    lifecycle: Lifecycle
    autotune: AutoTune
    global_step: int
    _phase: str
    _micro: int
    _cur_ids: list[int]
    _loss: torch.Tensor | None
    _probing: bool
    _resumed: bool
    _stepped: bool
    _checked: Checked | None
    _suspect: Suspicion | None
    _replicated: bool

    # ------------------------------------------------------------------ the step -------
    def _probe_crash(self, ids: list[int]) -> Iterator[Any]:
        """The previous attempt died in the loop body of this micro-batch: before it runs,
        each rank that was in its loop body runs its samples one at a time (forward only),
        the marker naming each; every rank runs as many (fillers), so collectives inside
        the model stay matched. Returns once all passed (journaled: a death in the batch
        after that quarantines them together)."""
        s = self._suspect
        assert s is not None
        self._suspect = None
        suspects = list(ids) if self.comm.global_rank in s.ranks else []
        probe = CrashProbe(suspects, ids[:1], self.comm.all_reduce_max(len(suspects)))
        self._probing = True
        rng = rng_state()  # the probes' forwards draw (dropout): the real batch must not see it
        try:
            while probe.pending:
                group, sample = probe.next()
                self.marker.set(s.step, s.micro, sample, IN_BODY)
                batch = self.cursor.rerun_batch(group)
                self._begin_batch(group)
                with self.engine.local_grads():
                    yield batch
                self._end_batch()
        finally:
            self._probing = False
        set_rng_state(rng)
        if suspects:
            self.journal.write(
                "crash_probes_clean", s.step, {"micro": s.micro, "samples": suspects}
            )

    def _begin_batch(self, ids: list[int]) -> None:
        self._cur_ids = ids
        self._phase = "batch"

    def _end_batch(self) -> None:
        if self._phase != "stepped":
            raise self._misuse(
                "the loop body must call guard.backward(loss) and guard.step() once per batch"
            )
        self._phase = "idle"

    def _check(self) -> str:
        """The finite check of a real step: one all-reduce, then the same branch everywhere."""
        assert self._loss is not None
        gas = self.engine.micro_steps_per_step
        if self._micro + 1 < gas:
            self.engine.accumulate()
            self._micro += 1
            self.cursor.micro_done()
            return ACCUMULATE
        self.ring.fence()  # snapshot copies in flight must land before anything mutates
        if self.comm.rank == 0 and self.metrics.ratio_due(self.global_step):
            self.metrics.before_update(list(self.engine.core.parameters()))
        snap = self.ring.at(self.global_step)  # taken at this step: its digest is compared
        digest = snap.digest if snap is not None and snap.agreed is None else None
        mult = self.adjuster.multiplier()
        grads = self.engine.judge(mult)
        div = self.engine.loss_divisor
        loss = self._loss if div == 1 else self._loss / div
        ratio = self.metrics.pending()  # the last measured update ratio (rank 0)
        c = self._checked = self.check.run(
            self.global_step, loss, grads, self.lifecycle.signals.requested,
            digest=digest if self._replicated else None, extra=ratio,
        )  # fmt: skip
        if ratio is not None:
            self.metrics.resolve(c.extra)
        if snap is not None and c.agreed is not None:
            snap.agreed = c.agreed
            if c.agreed and c.digest is not None:
                self.recovery.replicas_agreed(self.global_step, c.digest)
        if c.reason is None:
            outcome = self._commit(
                OVERFLOW_SKIP if c.overflow else COMMIT, c.loss, c.grad_norm, mult
            )
        else:
            to = self.recovery.on_incident(self.global_step, c, self._loss, self.investigation)
            if to is not None:
                self._rolled_back(to)
            outcome = INCIDENT
        if c.stop and not self.investigation.active and self.recovery.open is None:
            # Some rank was asked to stop: all stop here, together.
            self._stop()
        return outcome

    def _stop(self) -> None:
        """Stop the run together now: a durable snapshot, then ``Preempted``."""
        self.lifecycle.preempt(self.global_step)

    def _commit(self, outcome: str, loss: float, grad_norm: float, lr_multiplier: float) -> str:
        max_norm, coef = self.policy.clip.max_norm, None
        if max_norm is not None and outcome == COMMIT and grad_norm > max_norm:
            # torch's clip_grad_norm_ formula, by the norm the check all-reduced: every rank
            # scales its own (local or sharded) gradients by the same global factor.
            coef = max_norm / (grad_norm + 1e-6)
        # The check's verdict on the gradients, where it judged them: a loss scaler skips
        # by it (every rank alike, and no host sync of its own).
        overflow = outcome == OVERFLOW_SKIP if self.check.check_grads else None
        self.engine.commit(lr_multiplier, coef, overflow)
        checked = self._checked
        self.metrics.after_step(
            self.global_step, outcome, loss, grad_norm, self._effective_lr, self._loss_scale,
            check_s=checked.seconds if checked is not None else None,
            writing=checked is not None and checked.writing,
        )  # fmt: skip
        self.cursor.commit(self.global_step)
        self._micro = 0
        self.keeper.seal_through(self.global_step, self.recovery.rollbacks)
        if not self._stepped:  # the goodput ledger's end of (re)start: one event per process
            self._stepped = True
            self._event("first_step", resumed=self._resumed)
        self.global_step += 1
        if self.rejoin.pending is not None:  # the first step after an in-place recovery
            self.rejoin.first_step()
        self.autotune.committed(self.global_step, bool(checked and checked.writing))
        self.heartbeat.beat(self.global_step)
        phase = self.adjuster.on_commit()
        if phase is not None:
            self._event("adjust", phase=phase, lr_multiplier=self.adjuster.multiplier())
        return outcome

    def _loss_scale(self) -> float | None:
        """The loss scale for the metrics row: the check's read of it on an overflow step
        (one host sync a step, not two: tests/gpu counts them), else read now."""
        c = self._checked
        return (
            c.loss_scale
            if c is not None and c.loss_scale is not None
            else (self.engine.loss_scale())
        )

    def _rolled_back(self, step: int) -> None:
        self.global_step, self._micro = step, 0
        self.check.rewind(step)
        self.autotune.rolled_back()

    # ------------------------------------------------------------------ helpers --------
    def _misuse(self, what: str) -> UsageError:
        return UsageError(f"[rank {self.comm.global_rank} step {self.global_step}] {what}")

    def _event(self, kind: str, **details: Any) -> None:
        """Journal a collective decision once (rank 0 of the group), at the current step."""
        self._decide(kind, self.global_step, **details)

    def _effective_lr(self) -> float | None:
        """The LR of the next step (first parameter group) times the incident multiplier."""
        lr = self.engine.lr()
        return None if lr is None else lr * self.adjuster.multiplier()
