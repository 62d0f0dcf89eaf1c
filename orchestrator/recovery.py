"""The Guard's incident pipeline (the cold path: may cost seconds, never runs in a healthy
step): name the origin ranks, run the health checks, check the incident budget, re-run the
bad step through the user's own loop (isolation by bisection, forensics: classification,
the module where the NaN is born, the fp32 re-run), quarantine, roll back, adjust.

A mixin of :class:`orchestrator.guard.Guard`: the state it reads and writes is the Guard's
(declared below for the type checker only); every decision here is identical on every rank
because its inputs are agreed by a collective first.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from orchestrator.detect import grad_norm
from orchestrator.diagnose import ModuleLocator, low_precision
from orchestrator.engines import TorchEngine
from orchestrator.errors import GaveUp, Unhealthy
from orchestrator.incident import Incident
from orchestrator.isolate import Bisection
from orchestrator.persist import storage_retry
from orchestrator.policy import NanModuleFault

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
        def _event(self, kind: str, **details: Any) -> None: ...
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
        self._event(
            "incident",
            reason=reason,
            loss=gloss,
            grad_norm=gnorm,
            origin_ranks=origin,
            per_rank=per_rank,
            batch_ids=self.comm.all_gather_object(self._step_ids),
        )
        if self.health is not None and self.policy.health.on_incident:
            self._check_health(f"incident at step {self.global_step}")
        self._escalate_if_over_budget()

        q = self.policy.quarantine
        isolate = q.enabled and q.scope == "step" and q.isolate
        rerun = self.policy.diagnose.rerun
        if (isolate or rerun) and reason.startswith("nonfinite"):
            suspects = list(self._step_ids) if self.comm.rank in origin else []
            self._probe = Bisection(suspects, filler=self._step_ids[:1], split=isolate)
            self._probe_steps = 0
            self._locator = (
                ModuleLocator(self.engine.core, backward=self._probe_judges_grads)
                if rerun
                else None
            )
            self.engine.abandon()
            return INCIDENT
        culprits: list[int] = []
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
        culprits: list[int] = []
        if self.policy.quarantine.enabled and "quarantine" in actions:
            culprits = sorted({i for g in gathered for i in g["culprits"]})
        self._recover(culprits, cut_lr="cut_lr" in actions)
        return PROBE

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

    def _recover(self, culprits: list[int], cut_lr: bool = True) -> None:
        """Quarantine, roll back, adjust. Identical on every rank (inputs are agreed)."""
        inc = self._open
        assert inc is not None and self._sampler is not None
        self.engine.abandon()
        if culprits:
            self._sampler.quarantine(culprits)
            written = self._ledger_add(culprits, inc.step, inc.reason)
            self._event("quarantine", samples=culprits, ledger=self.ledger.url, persisted=written)
        inc.quarantined = culprits

        target, age_met = self.ring.pick(inc.step, self.policy.snapshot.min_age_steps)
        if target is None:
            self._give_up(f"no sealed snapshot to roll back to at step {inc.step}")
        assert target is not None
        adjust = self.policy.adjust
        t0 = time.perf_counter()
        scale_factor = adjust.loss_scale_factor if self.engine.has_loss_scaler else 1.0
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
            logger.warning("%s", inc.format())
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
            logger.error("quarantine ledger %s not written: %r", self.ledger.url, err)
            return False

    def _check_health(self, reason: str) -> None:
        """Run the health checks (every rank); on a failure journal the ranks and hosts
        and stop with exit code 72, so the supervisor or scheduler can exclude the node.

        Raises:
            Unhealthy: a check failed on some rank (or timed out).
        """
        assert self.health is not None
        report = self.health.run(reason)
        self._event("health", **report.to_dict())
        if report.healthy:
            return
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
            logger.error(
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
        e = self.policy.escalation
        step = self.incidents[-1].step
        recent = [i for i in self.incidents if i.step > step - e.window_steps]
        if len(recent) > e.max_incidents:
            self._give_up(
                f"{len(recent)} incidents within {e.window_steps} steps (steps "
                f"{[i.step for i in recent]}), over escalation.max_incidents={e.max_incidents}"
            )

    def _give_up(self, why: str) -> None:
        summary = {
            "why": why,
            "incidents": [i.to_dict() for i in self.incidents],
            "quarantined": sorted(self._sampler.quarantined) if self._sampler else [],
            "rollbacks": self.rollbacks,
        }
        self._event("gave_up", **summary)
        if self.comm.rank == 0:
            logger.error(
                "GAVE UP at step %d: %s. Journal: %s. Look at the incidents above, fix the "
                "data or lower the LR, then start again.",
                self.global_step,
                why,
                self.journal.path,
            )
        self.close(persist=False)
        raise GaveUp(f"gave up at step {self.global_step}: {why}")
