"""The Guard's incident pipeline (the cold path: may cost seconds, never runs in a healthy
step): name the origin ranks, run the health checks, re-run the bad step through the user's
own loop (isolation by bisection, forensics: classification, the module where the NaN is
born, the fp32 re-run), decide the cause (explained by data, or unexplained) and charge the
budget it belongs to, quarantine, roll back, adjust.

A mixin of :class:`orchestrator.guard.Guard`: the state it reads and writes is the Guard's
(declared below for the type checker only); every decision here is identical on every rank
because its inputs are agreed by a collective first.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from orchestrator.detect import grad_norm
from orchestrator.diagnose import ModuleLocator, low_precision
from orchestrator.engines import TorchEngine
from orchestrator.errors import GaveUp, Unhealthy
from orchestrator.incident import Incident
from orchestrator.isolate import Bisection
from orchestrator.logs import RankLogger
from orchestrator.policy import NanModuleFault
from orchestrator.store import storage_retry

if TYPE_CHECKING:
    from orchestrator.adjust import LRAdjuster
    from orchestrator.comm import Comm
    from orchestrator.data import GuardBatchSampler
    from orchestrator.durable import DurableTier
    from orchestrator.engines import Engine
    from orchestrator.faults import FaultInjector
    from orchestrator.health import HealthChecker
    from orchestrator.heartbeat import Heartbeat
    from orchestrator.journal import Journal
    from orchestrator.metrics import Metrics
    from orchestrator.policy import Policy
    from orchestrator.quarantine import Ledger
    from orchestrator.snapshot import SnapshotRing

logger = logging.getLogger(__name__)

# Outcomes of Guard.step that the pipeline returns.
INCIDENT, PROBE = "incident", "probe"


class IncidentPipeline:
    if TYPE_CHECKING:  # the Guard's state, as the pipeline uses it
        policy: Policy
        comm: Comm
        engine: Engine
        journal: Journal
        ring: SnapshotRing
        adjuster: LRAdjuster
        ledger: Ledger
        health: HealthChecker | None
        faults: FaultInjector
        durable: DurableTier
        heartbeat: Heartbeat
        metrics: Metrics
        incidents: list[Incident]
        rollbacks: int
        global_step: int
        _sampler: GuardBatchSampler | None
        _pos: tuple[int, int]
        _recent: deque[tuple[int, list[tuple[int, int]]]]
        _step_ids: list[int]
        _step_positions: list[tuple[int, int]]
        _loss: torch.Tensor | None
        _probe: Bisection | None
        _probe_steps: int
        _open: Incident | None
        _locator: ModuleLocator | None
        _located: dict[str, str] | None
        _fp32_ids: list[int] | None
        _fp32_running: bool
        _precision: str | None
        _reset_iter: bool

        @property
        def _probe_judges_grads(self) -> bool: ...

        _evidence: dict[str, Any]
        log: RankLogger

        def _event(self, kind: str, **details: Any) -> None: ...
        def _samples_seen(self) -> int: ...
        def _new_step(self) -> None: ...
        def close(self, persist: bool = True) -> None: ...

    def _incident(self, reason: str, gloss: float, gnorm: float) -> str:
        local_grads = self.engine.grads()
        local = {
            "loss": not bool(torch.isfinite(self._loss).all()),  # type: ignore[arg-type]
            "grads": bool(local_grads) and not bool(torch.isfinite(grad_norm(local_grads))),
        }
        per_rank: list[dict[str, bool]] = self.comm.all_gather_object(local)
        origin = [r for r, f in enumerate(per_rank) if f["loss"]] or [
            r for r, f in enumerate(per_rank) if f["grads"]
        ]
        inc = Incident(self.global_step, reason, gloss, gnorm, origin, time.time(), per_rank)
        self.incidents.append(inc)
        self._open = inc
        # Journaled once the cause is known (after isolation, where there is one), so the
        # event says which budget the incident was charged to.
        self._evidence = {
            "reason": reason,
            "loss": gloss,
            "grad_norm": gnorm,
            "origin_ranks": origin,
            "per_rank": per_rank,
            "batch_ids": self.comm.all_gather_object(self._step_ids),
        }
        if self.health is not None and self.policy.health.on_incident:
            self._check_health(
                f"incident at step {self.global_step}",
                before_stop=lambda: self._charge("unexplained", why="unhealthy", budget=None),
            )

        if self._isolates and reason.startswith("nonfinite"):
            suspects = list(self._step_ids) if self.comm.rank in origin else []
            self._probe = Bisection(suspects, filler=self._step_ids[:1], split=self._splits)
            self._probe_steps = 0
            self._locator = (
                ModuleLocator(self.engine.core, backward=self._probe_judges_grads)
                if self.policy.diagnose.rerun
                else None
            )
            self.engine.abandon()
            return INCIDENT
        # Not re-run (a spike, or isolation and forensics off): nothing ties it to samples.
        self._charge("unexplained", why="not_isolated")
        culprits: list[int] = []
        q = self.policy.quarantine
        if q.enabled:
            ranks = origin or list(range(self.comm.world_size))
            assert self._sampler is not None
            sampler = self._sampler
            culprits = [
                i
                for pos in self._step_positions
                for r in ranks
                for i in sampler.batch_at(*pos, rank=r)[0]
            ]
            if q.scope == "window":
                for step, positions in self._recent:
                    if step >= self.global_step - q.window_steps:
                        culprits += [i for p in positions for i in sampler.global_batch_at(*p)]
        self._recover(culprits)
        return INCIDENT

    def _probe_step(self) -> str:
        assert self._probe is not None and self._loss is not None
        bad = not bool(torch.isfinite(self._loss).all())
        own = self._probe.current is not None  # this rank re-ran its own samples
        if self._fp32_running:  # the forensics fp32 re-run: judged by its loss alone
            self._fp32_running = False
            self._precision = ("data_or_model" if bad else "precision") if own else None
            self._probe_steps += 1
            return self._probe_continue()
        if self._probe_judges_grads:
            grads = self.engine.grads()  # local: the re-run ran without gradient sync
            bad = bad or (bool(grads) and not bool(torch.isfinite(grad_norm(grads))))
        if self._probe_steps == 0 and self._locator is not None:
            self._located = self._locator.result if own else None
            self._locator = None
            # A reproducible NaN in a low-precision model: once more in fp32 (every rank
            # together; the ranks without suspects re-run their filler).
            if self.comm.all_reduce_max(int(bad and own)) and self._fp32_capable():
                current = self._probe.current
                self._fp32_ids = current[0] if current is not None else self._probe.filler
        self._probe.record(bad)
        self._probe_steps += 1
        return self._probe_continue()

    def _fp32_capable(self) -> bool:
        """An fp32 copy of the model can run here: plain PyTorch or DDP (not sharded state,
        whose dtype the engine owns), with fp16/bf16 parameters."""
        return type(self.engine) is TorchEngine and low_precision(self.engine.core)

    def _probe_continue(self) -> str:
        assert self._probe is not None
        self.engine.abandon()
        if self.comm.all_reduce_max(int(self._probe.pending or self._fp32_ids is not None)):
            return PROBE
        gathered = self.comm.all_gather_object(
            {
                "culprits": self._probe.culprits,
                "reproduced": self._probe.reproduced,
                "located": self._located,
                "precision": self._precision,
            }
        )
        inc = self._open
        assert inc is not None
        inc.reproduced = any(g["reproduced"] for g in gathered)
        inc.probe_steps = self._probe_steps
        self._probe, self._located, self._precision = None, None, None
        actions = {"quarantine", "cut_lr"}  # without forensics: what isolation implies
        if self.policy.diagnose.rerun:
            actions = self._diagnosis(inc, gathered)
        elif not inc.reproduced:
            actions = {"cut_lr"}
        found = sorted({i for g in gathered for i in g["culprits"]})
        quarantine = self.policy.quarantine.enabled and "quarantine" in actions
        step_samples = sum(len(ids) for ids in self._evidence["batch_ids"])
        # Explained by data: bisection reproduced it on a few samples and the rest of the
        # step was clean without them. Reproducible on every sample (or on most) is the
        # model or the LR, not the data: nothing is quarantined then.
        prev = self.incidents[-2] if len(self.incidents) > 1 else None
        if not inc.reproduced:
            why = "not_reproduced"
        elif not self._splits:
            why = "not_isolated"
        elif not quarantine:  # diagnose.actions (or quarantine.enabled) said not to
            why = "not_quarantined"
        elif not 0 < len(found) <= self.policy.quarantine.max_step_fraction * step_samples:
            why = "most_samples"
        elif prev is not None and inc.step <= prev.step:
            # The replay after the last incident failed again before getting past it: a
            # replay is exact and its samples passed before, so the model is what changed
            # (or a bad sample moved into the step as quarantine shifted the order: rare).
            why = "recurred"
        else:
            self._charge("data", why="isolated")
            adjust = self.policy.adjust
            self._recover(found, cut_lr=adjust.cut_lr_on_data, scale=adjust.loss_scale_on_data)
            return PROBE
        self._charge("unexplained", why=why)
        # Without bisection (quarantine.isolate off) a reproduced step quarantines its
        # origin ranks' samples whole, as isolation off always has.
        self._recover(found if quarantine and not self._splits else [], cut_lr="cut_lr" in actions)
        return PROBE

    @property
    def _splits(self) -> bool:
        """Isolation bisects the bad step down to its samples."""
        q = self.policy.quarantine
        return q.enabled and q.scope == "step" and q.isolate

    @property
    def _isolates(self) -> bool:
        """The bad step is re-run (isolation, forensics, or both)."""
        return self._splits or self.policy.diagnose.rerun

    def _charge(self, cause: str, why: str, budget: str | None = "auto") -> None:
        """Record the incident's cause (and ``why``: isolated, not_reproduced, most_samples,
        recurred, not_isolated, not_quarantined, unhealthy), journal it with its evidence,
        and charge it: to the data budget (checked once its samples are quarantined) or to
        the incident budget (checked now: may give up)."""
        inc = self._open
        assert inc is not None
        inc.cause = cause
        inc.budget = ("data" if cause == "data" else "incidents") if budget == "auto" else budget
        self._event("incident", **self._evidence, cause=cause, why=why, budget=inc.budget)
        if inc.budget == "incidents":
            self._escalate_if_over_budget()

    def _diagnosis(self, inc: Incident, gathered: list[dict[str, Any]]) -> set[str]:
        """Classify the incident from the re-runs and journal it with the evidence; run the
        health checks if its policy actions say so. Returns its actions."""
        verdicts = {g["precision"] for g in gathered} - {None}
        inc.classification = (
            "transient"
            if not inc.reproduced
            # fp32 re-run: still non-finite somewhere -> the data or the model itself
            else "data_or_model"
            if "data_or_model" in verdicts
            else "precision"  # finite in fp32: the low-precision format overflowed
            if verdicts
            else "deterministic"
        )
        where = [
            {**g["located"], "rank": r} for r, g in enumerate(gathered) if g["located"] is not None
        ]
        if where:
            inc.origin_module = where[0]["module"]
        self._event(
            "diagnosis",
            incident_step=inc.step,
            classification=inc.classification,
            actions=sorted(self.policy.diagnose.actions[inc.classification]),  # type: ignore[index]
            located=where,
            origin_ranks=inc.origin_ranks,
            batch_ids=self.comm.all_gather_object(self._step_ids),
        )
        actions: set[str] = set(self.policy.diagnose.actions[inc.classification])  # type: ignore[index]
        if "health" in actions and self.health is not None and not self.policy.health.on_incident:
            self._check_health(f"{inc.classification} incident at step {inc.step}")
        return actions

    def _nan_armed(self, f: NanModuleFault) -> bool:
        rerun_of = self._open.step if self._probe is not None and self._open else None
        return self.faults.nan_module_armed(f, self.global_step, rerun_of)

    def _recover(self, culprits: list[int], cut_lr: bool = True, scale: bool = True) -> None:
        """Quarantine, roll back, adjust (the LR if ``cut_lr``, a loss scale if ``scale``).
        Identical on every rank (inputs are agreed)."""
        inc = self._open
        assert inc is not None and self._sampler is not None
        self.engine.abandon()
        if culprits:
            self._sampler.quarantine(culprits)
            written = self._ledger_add(culprits, inc.step, inc.reason)
            total, seen = len(self._sampler.quarantined), self._samples_seen()
            self._event(
                "quarantine",
                samples=culprits,
                ledger=self.ledger.url,
                persisted=written,
                total=total,
                samples_seen=seen,
                fraction=total / seen,
            )
        inc.quarantined = culprits
        if inc.budget == "data":
            self._check_data_budget()

        target, age_met = self.ring.pick(inc.step, self.policy.snapshot.min_age_steps)
        if target is None:
            self._give_up(f"no sealed snapshot to roll back to at step {inc.step}")
        assert target is not None
        adjust = self.policy.adjust
        t0 = time.perf_counter()
        scale_factor = adjust.loss_scale_factor if scale and self.engine.has_loss_scaler else 1.0
        scale_before = self.engine.loss_scale()
        self.engine.restore(target, scale_factor)
        g = target.materialize("guard", clone=False)
        self.global_step, self._pos = g["step"], (g["epoch"], g["offset"])
        self._new_step()
        self.ring.drop_after(target.step)
        self.durable.invalidate_after(target.step)
        # Steps after the target belong to the abandoned timeline: forget their positions.
        while self._recent and self._recent[-1][0] >= target.step:
            self._recent.pop()
        self._reset_iter = True
        self.rollbacks += 1
        self.metrics.drop_update()
        self.metrics.restart_clock()
        self._event(
            "rollback",
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
        inc.lr_multiplier = self.adjuster.on_incident() if cut_lr else self.adjuster.multiplier()
        inc.loss_scale_factor = scale_factor
        self._event(
            "adjust",
            phase="cut" if cut_lr else "kept",
            lr_multiplier=inc.lr_multiplier,
            hold_steps=adjust.hold_steps,
            rewarm_steps=adjust.rewarm_steps,
            loss_scale_factor=scale_factor,
        )
        inc.duration_s = time.time() - inc.started_at
        self._event("recovered", incident=inc.to_dict())
        if self.comm.rank == 0:
            self.log.warning("%s", inc.format())
        self._open = None
        self.heartbeat.beat(self.global_step, phase="recovered", force=True)

    def _ledger_add(self, ids: list[int], step: int, reason: str) -> bool:
        """Rank 0 appends to the ledger, retrying; a storage failure is journaled, never
        fatal: the quarantine holds in memory for this run either way."""
        if self.comm.rank != 0:
            return True
        try:
            storage_retry(self.policy.persist)(self.ledger.add, ids, step, reason)
            return True
        except (OSError, TimeoutError) as err:
            self.journal.write("ledger_failed", step, {"samples": ids, "error": repr(err)})
            self.log.error("quarantine ledger %s not written: %r", self.ledger.url, err)
            return False

    def _check_health(self, reason: str, before_stop: Callable[[], None] | None = None) -> None:
        """Run the health checks (every rank); on a failure journal the ranks and hosts
        (after ``before_stop``) and stop with exit code 72, so the supervisor or scheduler
        can exclude the node.

        Raises:
            Unhealthy: a check failed on some rank (or timed out).
        """
        assert self.health is not None
        report = self.health.run(reason)
        self._event("health", **report.to_dict())
        if report.healthy:
            return
        if before_stop is not None:
            before_stop()
        named = report.bad_hosts()
        self._event(
            "unhealthy",
            reason=reason,
            ranks=sorted(report.bad),
            hosts=sorted(set(named.values())),
            failed={str(r): checks for r, checks in sorted(report.bad.items())},
        )
        # Every rank has the same report unless a collective timed out; then each stops on
        # what it saw, and the journal of whichever rank 0 is left says the rest.
        if self.comm.rank == 0 or report.ranks[0]["rank"] != 0:
            self.log.error(
                "UNHEALTHY (%s): %s. Exclude these nodes and restart.",
                reason,
                "; ".join(f"rank {r} on {h}: {report.bad[r]}" for r, h in named.items()),
            )
        self.close(persist=False)
        raise Unhealthy(
            f"health check failed ({reason}): ranks {sorted(report.bad)} on "
            f"{sorted(set(named.values()))}"
        )

    def _escalate_if_over_budget(self) -> None:
        """The incident budget: unexplained incidents per window."""
        e = self.policy.escalation
        step = self.incidents[-1].step
        recent = [
            i for i in self.incidents if i.budget == "incidents" and i.step > step - e.window_steps
        ]
        if len(recent) > e.max_incidents:
            self._give_up(
                f"{len(recent)} unexplained incidents within {e.window_steps} steps (steps "
                f"{[i.step for i in recent]}), over escalation.max_incidents={e.max_incidents}",
                budget="incidents",
            )

    def _check_data_budget(self) -> None:
        """The data budget: quarantined samples against the distinct samples seen."""
        assert self._sampler is not None
        q = self.policy.quarantine
        total, seen = len(self._sampler.quarantined), self._samples_seen()
        if total <= max(q.max_fraction * seen, q.budget_min_samples):
            return
        self._give_up(
            f"{total} samples quarantined, {total / seen:.2%} of the {seen} distinct samples "
            f"seen, over quarantine.max_fraction={q.max_fraction:g} (budget_min_samples="
            f"{q.budget_min_samples}). The ledger {self.ledger.url} lists them: inspect the "
            "data (or the model on it); if this much bad data is expected, raise "
            "quarantine.max_fraction",
            budget="data",
            fraction=total / seen,
            samples_seen=seen,
            ledger=self.ledger.url,
        )

    def _give_up(self, why: str, **evidence: Any) -> None:
        summary = {
            **evidence,
            "why": why,
            "incidents": [i.to_dict() for i in self.incidents],
            "quarantined": sorted(self._sampler.quarantined) if self._sampler else [],
            "rollbacks": self.rollbacks,
        }
        self._event("gave_up", **summary)
        if self.comm.rank == 0:
            self.log.error(
                "GAVE UP: %s. Journal: %s (gave_up and the incidents before it).",
                why,
                self.journal.path,
            )
        self.close(persist=False)
        raise GaveUp(f"gave up at step {self.global_step}: {why}")
