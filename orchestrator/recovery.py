"""Recovery: what the Guard does about an incident once it knows what it is.

Opens the incident (origin ranks, evidence, health checks), charges it to the budget its
cause belongs to (data: quarantined samples against the samples seen; unexplained: incidents
per window), and recovers: quarantine, roll back to the newest sealed snapshot old enough,
adjust the LR or loss scale. Gives up (:class:`GaveUp`) when a budget is spent and stops
(:class:`Unhealthy`) when a health check fails; the Guard closes the run on either.

Every decision is identical on every rank: its inputs are agreed by a collective first.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from orchestrator import replicas
from orchestrator.adjust import LRAdjuster
from orchestrator.check import Checked
from orchestrator.context import Context
from orchestrator.cursor import DataCursor
from orchestrator.detect import SpikeBar, grad_norm
from orchestrator.divergence import Divergence
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine
from orchestrator.health import HealthChecker
from orchestrator.heartbeat import Heartbeat
from orchestrator.incident import Incident
from orchestrator.investigate import Investigation, Verdict
from orchestrator.ledgerkeep import LedgerKeeping
from orchestrator.logs import RankLogger
from orchestrator.metrics import Metrics
from orchestrator.quarantine import Entry, Ledger
from orchestrator.recovery_policy import RecoveryPolicy
from orchestrator.snapshot import SnapshotRing
from orchestrator.stateful import UserState
from orchestrator.stops import Stops

logger = logging.getLogger(__name__)


class Recovery(Divergence, LedgerKeeping, Stops):
    """One rank's incident handling (see the module's docstring); every method is
    collective unless it says otherwise.

    Args:
        ctx: the shared context.
        policy: the sections it reads (:meth:`RecoveryPolicy.of` a policy).
        engine: the training engine.
        ring, cursor, adjuster, ledger, durable, metrics, heartbeat, health, user: the
            components it rolls back, quarantines with, adjusts and stops through.
    """

    def __init__(
        self,
        ctx: Context,
        policy: RecoveryPolicy,
        engine: Engine,
        *,
        ring: SnapshotRing,
        cursor: DataCursor,
        adjuster: LRAdjuster,
        ledger: Ledger,
        durable: DurableTier,
        metrics: Metrics,
        heartbeat: Heartbeat,
        health: HealthChecker | None,
        user: UserState | None = None,
    ) -> None:
        comm, journal = ctx.comm, ctx.journal
        self.policy, self.comm, self.engine = policy, comm, engine
        self.user = user if user is not None else UserState()
        self.ring, self.cursor, self.adjuster, self.ledger = ring, cursor, adjuster, ledger
        self.durable, self.metrics, self.heartbeat, self.health = (
            durable,
            metrics,
            heartbeat,
            health,
        )
        self.journal = journal
        self.log = RankLogger(logger, comm.global_rank)
        self.decide = ctx.decide
        self.incidents: list[Incident] = []
        self.rollbacks = 0
        self.open: Incident | None = None  # opened, not yet recovered
        self._evidence: dict[str, Any] = {}  # the open incident's, journaled with its cause
        # Ledger entries a storage failure held back: (ids, step, reason), oldest first.
        self._unwritten: list[Entry] = []
        r = policy.detect.replicas
        self.culprits = replicas.Culprits(r.sick_after, policy.escalation.window_steps)
        self._host_names: list[str] | None = None

    @property
    def previous_step(self) -> int | None:
        """The step of the incident before the open one."""
        return self.incidents[-2].step if len(self.incidents) > 1 else None

    @property
    def step_samples(self) -> int:
        """Samples of the open incident's step, every rank's."""
        return sum(len(ids) for ids in self._evidence["batch_ids"])

    def on_incident(
        self, step: int, c: Checked, loss: torch.Tensor, investigation: Investigation
    ) -> int | None:
        """A bad step: open the incident; start investigating a non-finite one when the
        policy re-runs steps (None: the loop runs the re-runs next), else recover now and
        return the step rolled back to."""
        assert c.reason is not None
        inc = self.open_incident(step, c.reason, c.loss, c.grad_norm, loss, c.spike)
        if c.reason == "divergence":
            return self.act_divergence()
        if c.reason == "persistent_overflow":
            # Not the samples' doing (the scaler skipped step after step, whatever the
            # batch): nothing is quarantined; back to before the first skip, LR cut.
            self.charge("unexplained", why="persistent_overflow")
            return self.recover([], before=c.overflow_since)
        # A loss spike is re-run as a NaN is (its re-runs judged against its bar); a
        # grad-norm spike has no per-sample value to bisect by.
        spike = c.spike if c.spike is not None and c.spike.metric == "loss" else None
        if investigation.reruns and (c.reason.startswith("nonfinite") or spike is not None):
            own = float(loss.detach().float().sum()) / self.engine.loss_divisor
            investigation.start(
                inc, self.cursor.step_ids, self.step_samples, self.previous_step, spike, own
            )
            return None
        return self.act_uninvestigated()

    def act_divergence(self) -> int:
        """The replicas' digests differ: name the odd rank(s) out (a majority's minority
        now; with a tie, the replay decides, see :meth:`replicas_agreed`), stop if one of
        them is sick, else roll back to the newest snapshot they agreed on. Nothing is
        quarantined and the LR is kept: neither the data nor the LR made replicas differ."""
        inc = self.open
        assert inc is not None
        snap = self.ring.at(inc.step)
        mine = int(snap.digest) if snap is not None and snap.digest is not None else -1
        digests: list[int] = self.comm.all_gather_object(mine)
        odd = replicas.minority(digests)
        if odd is None:
            here = replicas.sketch(self.engine.digest_tensors()[0])
            self.culprits.pending[inc.step] = replicas.Tie(digests, here)
        inc.origin_ranks = odd or []
        self._evidence.update(origin_ranks=inc.origin_ranks, digests=digests, tied=odd is None)
        self.charge("divergence", why="majority" if odd else "tied", budget="incidents")
        if odd:
            self._name_culprits(inc.step, odd, "majority")
        return self.recover([], cut_lr=False, scale=False, agreed_only=True)

    def open_incident(
        self,
        step: int,
        reason: str,
        gloss: float,
        gnorm: float,
        loss: torch.Tensor,
        spike: SpikeBar | None = None,
    ) -> Incident:
        """Name the origin ranks, gather the evidence, run the health checks if the policy
        says so. Journaled once its cause is known (:meth:`charge`)."""
        local_grads = self.engine.grads()
        mean = float(loss.detach().float().sum()) / self.engine.loss_divisor
        local = {
            "loss": not bool(torch.isfinite(loss).all()),
            "grads": bool(local_grads) and not bool(torch.isfinite(grad_norm(local_grads))),
            "samples": len(self.cursor.step_ids),
            "mean_loss": mean,
        }
        per_rank: list[dict[str, Any]] = self.comm.all_gather_object(local)
        origin = [r for r, f in enumerate(per_rank) if f["loss"]] or [
            r for r, f in enumerate(per_rank) if f["grads"]
        ]
        if spike is not None and spike.metric == "loss":
            # The ranks whose own mean clears the bar (widened for their share of the
            # step); none alone: every rank's samples are suspects.
            total = max(sum(f["samples"] for f in per_rank), 1)
            origin = [
                r
                for r, f in enumerate(per_rank)
                if f["samples"] and spike.exceeded(f["mean_loss"], f["samples"] / total)
            ] or [r for r, f in enumerate(per_rank) if f["samples"]]
        per_rank = [{"loss": f["loss"], "grads": f["grads"]} for f in per_rank]
        inc = Incident(step, reason, gloss, gnorm, origin, time.time(), per_rank)
        self.incidents.append(inc)
        self.open = inc
        self._evidence = {
            "reason": reason,
            "loss": gloss,
            "grad_norm": gnorm,
            "origin_ranks": origin,
            "per_rank": per_rank,
            "batch_ids": self.comm.all_gather_object(self.cursor.step_ids),
        }
        if self.health is not None and self.policy.health.on_incident:
            self.check_health(
                f"incident at step {step}",
                step,
                before_stop=lambda: self.charge("unexplained", why="unhealthy", budget=None),
            )
        return inc

    def charge(self, cause: str, why: str, budget: str | None = "auto") -> None:
        """Record the open incident's cause (and ``why``: see :class:`Verdict`, or
        ``unhealthy``), journal it with its evidence, and charge it: to the data budget
        (checked once its samples are quarantined) or to the incident budget (checked now:
        may give up)."""
        inc = self.open
        assert inc is not None
        inc.cause = cause
        inc.budget = ("data" if cause == "data" else "incidents") if budget == "auto" else budget
        self.decide("incident", inc.step, **self._evidence, cause=cause, why=why, budget=inc.budget)
        if inc.budget == "incidents":
            self._escalate_if_over_budget()

    def act(self, verdict: Verdict) -> int | None:
        """Recover from an investigated incident. Returns the step rolled back to, or None
        when the investigation goes on first: a spike's culprits are re-run on the oldest
        sealed snapshot, restored here (:attr:`Verdict.confirm`)."""
        inc = self.open
        assert inc is not None
        if verdict.confirm:
            oldest = next((s for s in self.ring.snapshots() if s.sealed), None)
            if oldest is None:
                self._give_up(inc.step, f"no sealed snapshot to roll back to at step {inc.step}")
            assert oldest is not None
            self.engine.restore(oldest, 1.0)
            self.decide("confirm", inc.step, samples=verdict.culprits, on_step=oldest.step)
            return None
        if verdict.health and self.health is not None:
            self.check_health(f"{inc.classification} incident at step {inc.step}", inc.step)
        self.charge(verdict.cause, verdict.why)
        return self.recover(verdict.culprits, cut_lr=verdict.cut_lr, scale=verdict.scale)

    def act_uninvestigated(self) -> int:
        """Recover from an incident that is not re-run (a spike, or isolation and forensics
        off): nothing ties it to samples, so the origin ranks' samples of the step (and of
        the window before it, with ``quarantine.scope: window``) are quarantined whole.
        Returns the step rolled back to."""
        inc = self.open
        assert inc is not None
        self.charge("unexplained", why="not_isolated")
        culprits: list[int] = []
        q = self.policy.quarantine
        # Only the user's word (isolation off, or a PaLM-style window) quarantines samples
        # nothing tied to the incident: a spike of a model or an LR gone wrong is every
        # sample's, and quarantining innocent ones would spend the data budget on nothing.
        if q.enabled and (not q.isolate or q.scope == "window"):
            culprits = self.cursor.step_samples(
                inc.origin_ranks or list(range(self.comm.world_size))
            )
            if q.scope == "window":
                culprits += self.cursor.window_samples(inc.step - q.window_steps)
        return self.recover(culprits)

    def recover(
        self,
        culprits: list[int],
        cut_lr: bool = True,
        scale: bool = True,
        agreed_only: bool = False,
        before: int | None = None,
    ) -> int:
        """Quarantine, roll back, adjust (the LR if ``cut_lr``, a loss scale if ``scale``).
        The snapshot is the newest sealed one old enough before the incident's step (or
        ``before``), with ``agreed_only`` one the replicas agreed on. Identical on every
        rank (inputs are agreed). Returns the step rolled back to."""
        inc = self.open
        assert inc is not None
        self.engine.abandon()
        self._quarantine(inc, culprits)
        scale_factor = (
            self.policy.adjust.loss_scale_factor if scale and self.engine.has_loss_scaler else 1.0
        )
        step = self._roll_back(inc, scale_factor, agreed_only, before)
        self._adjust(inc, step, cut_lr, scale_factor)
        self._close(inc, step)
        return step

    def _quarantine(self, inc: Incident, culprits: list[int]) -> None:
        """Quarantine the open incident's ``culprits`` (journaled, persisted to the ledger)
        and charge the data budget when the incident belongs to it."""
        if culprits:
            # A culprit the data explained may be a window holding a bad token: every
            # window sharing a token with it goes too, as one range (samplers.py).
            singles, spans = self.cursor.quarantine_widened(culprits, inc.cause == "data")
            written = self._ledger_add(singles, inc.step, inc.reason, spans)
            total, seen = len(self.cursor.id_set), self.cursor.samples_seen()
            lost = self.cursor.samples_lost()  # what the data budget charges
            windows = {"ranges": spans, "lost": lost} if self.cursor.id_span else {}
            self.decide(
                "quarantine",
                inc.step,
                samples=culprits,
                reason=inc.reason,
                ledger=self.ledger.url,
                persisted=written,
                total=total,
                samples_seen=seen,
                fraction=lost / seen,
                **windows,
            )
        inc.quarantined = culprits
        if inc.budget == "data":
            self._check_data_budget(inc.step)

    def _roll_back(
        self, inc: Incident, scale_factor: float, agreed_only: bool, before: int | None
    ) -> int:
        """Restore the snapshot :meth:`recover` picks, rewind the data and the user's
        objects to it, drop what came after it (ring, durable tier, the step's metrics) and
        journal the rollback. Returns the step rolled back to."""
        t0 = time.perf_counter()
        scale_before = self.engine.loss_scale()
        target, age_met = self._restore(
            inc.step if before is None else before, scale_factor, agreed_only
        )
        g = target.materialize("guard", clone=False)
        step = int(g["step"])
        data = target.materialize("data", clone=True) if "data" in target.skeleton else None
        self.cursor.rewind(step, g, data)
        self.user.restore(target)  # the user's own objects, with the model
        self.ring.drop_after(target.step)
        self.durable.invalidate_after(target.step)
        self.rollbacks += 1
        self.metrics.drop_update()
        self.metrics.restart_clock()
        self.decide(
            "rollback",
            step,
            from_step=inc.step,
            to_step=target.step,
            min_age_met=age_met,
            restore_ms=round((time.perf_counter() - t0) * 1e3, 3),
            **(
                {"loss_scale_at_incident": scale_before, "loss_scale": self.engine.loss_scale()}
                if scale_before is not None
                else {}
            ),
        )
        inc.rolled_back_to = target.step
        return step

    def _adjust(self, inc: Incident, step: int, cut_lr: bool, scale_factor: float) -> None:
        """Cut the LR (or keep it, without ``cut_lr``) after a rollback to ``step``, and
        journal the adjustment with the loss-scale factor the restore applied."""
        adjust = self.policy.adjust
        inc.lr_multiplier = self.adjuster.on_incident() if cut_lr else self.adjuster.multiplier()
        inc.loss_scale_factor = scale_factor
        self.decide(
            "adjust",
            step,
            phase="cut" if cut_lr else "kept",
            lr_multiplier=inc.lr_multiplier,
            hold_steps=adjust.hold_steps,
            rewarm_steps=adjust.rewarm_steps,
            loss_scale_factor=scale_factor,
        )

    def _close(self, inc: Incident, step: int) -> None:
        """Journal the recovered incident, close it and beat the heartbeat at ``step``."""
        inc.duration_s = time.time() - inc.started_at
        self.decide("recovered", step, incident=inc.to_dict())
        if self.comm.rank == 0:
            self.log.warning("%s", inc.format())
        self.open = None
        self.heartbeat.beat(step, phase="recovered", force=True)

    def _restore(self, bad_step: int, scale_factor: float, agreed_only: bool) -> tuple[Any, bool]:
        """Restore the newest fitting snapshot whose restored state matches the digest it
        was taken with, on every rank (a host buffer gone bad, or a restore that missed a
        tensor, fails that check: the next older snapshot is tried). Gives up when none is
        left. Returns ``(snapshot, age_met)``."""
        inc = self.open
        assert inc is not None
        while True:
            target, age_met = self.ring.pick(
                bad_step, self.policy.snapshot.min_age_steps, agreed_only
            )
            if target is None:
                self._give_up(
                    inc.step,
                    f"no sealed snapshot{' the replicas agreed on' if agreed_only else ''} "
                    f"to roll back to at step {inc.step}",
                )
            assert target is not None
            self.engine.restore(target, scale_factor)
            expected = target.digest
            now = replicas.digest(self.engine.digest_tensors()[0]) if expected is not None else None
            bad = expected is not None and now is not None and not torch.equal(expected, now)
            if not self.comm.all_reduce_max(int(bad)):
                return target, age_met
            self.decide("restore_mismatch", inc.step, snapshot_step=target.step)
            self.ring.discard(target)
