"""The investigation of a non-finite step: re-runs through the user's own loop, then a
verdict.

A state machine over the re-runs of the bad step (``guard.batches`` yields them and
``guard.step`` judges each, every rank in lockstep):

1. the whole step once more, with forensics hooks (the module where the NaN is born);
2. if it reproduced in a low-precision model, once more in fp32 (precision or data);
3. bisection of each origin rank's samples down to the culprits (:class:`Bisection`).

When no rank has re-runs left, the ranks agree on what they found and :meth:`judge`
returns a :class:`Verdict`: explained by data (a few samples, quarantined) or
unexplained, and what recovery should do. Every decision is identical on every rank: its
inputs are agreed by a collective first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator.context import Context
from orchestrator.detect import SpikeBar, grad_norm
from orchestrator.diagnose import ModuleLocator, full_precision
from orchestrator.engines import Engine
from orchestrator.incident import Incident
from orchestrator.isolate import Bisection
from orchestrator.policy import AdjustPolicy, DiagnosePolicy, HealthPolicy, Policy, QuarantinePolicy


@dataclass
class Verdict:
    """What recovery does about an investigated incident."""

    cause: str  # "data" (explained by the quarantined samples) | "unexplained"
    why: str  # isolated | not_reproduced | not_isolated | not_quarantined | most_samples | recurred
    culprits: list[int]  # samples to quarantine
    cut_lr: bool
    scale: bool  # apply adjust.loss_scale_factor
    health: bool  # the classification's actions ask for the health checks
    # A spike's culprits, to re-run once more on an older state before the verdict is final
    # (recovery restores it, then the investigation goes on: :meth:`Investigation.judge`).
    confirm: bool = False


@dataclass(frozen=True)
class InvestigationPolicy:
    """The policy sections an investigation reads, named as the :class:`Policy`'s:
    ``quarantine`` (isolation), ``diagnose`` (forensics), ``health`` (whether incidents
    already run the checks) and ``adjust`` (a cause's LR cut)."""

    quarantine: QuarantinePolicy
    diagnose: DiagnosePolicy
    health: HealthPolicy
    adjust: AdjustPolicy

    @classmethod
    def of(cls, p: Policy) -> InvestigationPolicy:
        return cls(p.quarantine, p.diagnose, p.health, p.adjust)


class Investigation:
    def __init__(self, ctx: Context, policy: InvestigationPolicy, engine: Engine) -> None:
        self.policy, self.comm, self.engine = policy, ctx.comm, engine
        self._decide = ctx.decide  # journals a collective decision: decide(kind, step, **details)
        self._probe: Bisection | None = None
        self._inc: Incident | None = None
        self._previous: int | None = None  # step of the incident before this one
        self._step_ids: list[int] = []
        self._step_samples = 0
        self._reruns = 0
        self._locator: ModuleLocator | None = None  # forensics hooks for the next re-run
        self._located: dict[str, str] | None = None
        self._fp32_ids: list[int] | None = None  # the fp32 re-run to do next
        self._fp32_running = False
        self._precision: str | None = None  # this rank's fp32 re-run verdict
        self._spike: SpikeBar | None = None  # a loss spike under investigation
        self._rest = (0.0, 0)  # (loss x samples, samples) of the step found clean
        self._confirming: Verdict | None = None  # a spike's data verdict being confirmed
        self._group = 0  # samples in the running re-run on this rank

    @property
    def splits(self) -> bool:
        """Isolation bisects the bad step down to its samples."""
        q = self.policy.quarantine
        return q.enabled and q.scope == "step" and q.isolate

    @property
    def reruns(self) -> bool:
        """A non-finite step is re-run (isolation, forensics, or both)."""
        return self.splits or self.policy.diagnose.rerun

    @property
    def active(self) -> bool:
        return self._probe is not None

    @property
    def incident_step(self) -> int | None:
        """The step under investigation (re-runs see it, e.g. to re-arm a fault)."""
        return self._inc.step if self._probe is not None and self._inc is not None else None

    @property
    def needs_backward(self) -> bool:
        """The running re-run is judged by its gradients too (else by its loss alone)."""
        return not self._fp32_running and self._spike is None and self.engine.rerun_judges_grads

    def start(
        self,
        inc: Incident,
        step_ids: list[int],
        step_samples: int,
        previous: int | None,
        spike: SpikeBar | None = None,
        own_loss: float = 0.0,
    ) -> None:
        """Investigate ``inc``: this rank ran ``step_ids`` in the bad step, all ranks
        ``step_samples``; ``previous`` is the step of the incident before it, if any. With
        ``spike`` (a loss spike), a re-run is bad when its loss clears that bar, widened
        for its share of the step's samples; else when it is non-finite."""
        suspects = list(step_ids) if self.comm.rank in inc.origin_ranks else []
        cap = int(self.policy.quarantine.max_step_fraction * step_samples)
        self._probe = Bisection(suspects, filler=step_ids[:1], split=self.splits, cap=cap)
        self._inc, self._step_ids, self._previous = inc, list(step_ids), previous
        self._step_samples, self._reruns = step_samples, 0
        self._spike, self._group = spike, 0
        # A spike is the data's only if the rest of the step is clean without the culprits:
        # the losses of the groups found clean, and the whole step of the ranks without
        # suspects (what each rank saw in the bad step: ``own_loss``, its mean).
        self._rest = (0.0, 0) if suspects else (own_loss * len(step_ids), len(step_ids))
        self._locator = (
            ModuleLocator(self.engine.core, backward=self.engine.rerun_judges_grads)
            if self.policy.diagnose.rerun and spike is None
            else None
        )
        self.engine.abandon()

    @contextlib.contextmanager
    def rerun(self) -> Iterator[list[int]]:
        """The next re-run: its sample ids, with its hooks active around the loop body."""
        assert self._probe is not None
        fp32, self._fp32_ids = self._fp32_ids, None
        ids = fp32 if fp32 is not None else self._probe.next_group()
        self._group = len(ids)
        # Forensics hooks exist only during the first re-run (the whole step).
        hooks: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if fp32 is not None:
            self._fp32_running = True
            hooks = full_precision(self.engine.core)
        elif self._reruns == 0 and self._locator is not None:
            hooks = self._locator
        with self.engine.local_grads(), hooks:
            yield ids

    def judge(self, loss: torch.Tensor) -> Verdict | None:
        """Judge the re-run just done; None while re-runs are left (on any rank)."""
        assert self._probe is not None
        bad = not bool(torch.isfinite(loss).all())
        own = self._probe.current is not None  # this rank re-ran its own samples
        if self._spike is not None:  # a loss spike: judged by the loss against its bar
            share, value = self._group / max(self._step_samples, 1), float(loss.detach().float())
            bad = self._spike.exceeded(value, share)
            if own and not bad:
                self._rest = (self._rest[0] + value * self._group, self._rest[1] + self._group)
            self._probe.record(bad)
        elif self._fp32_running:  # the fp32 re-run: judged by its loss alone
            self._fp32_running = False
            self._precision = ("data_or_model" if bad else "precision") if own else None
        else:
            if self.engine.rerun_judges_grads:
                grads = self.engine.grads()  # local: the re-run ran without gradient sync
                bad = bad or (bool(grads) and not bool(torch.isfinite(grad_norm(grads))))
            if self._reruns == 0 and self._locator is not None:
                self._located = self._locator.result if own else None
                autocast, self._locator = self._locator.autocast, None
                # A reproducible NaN in a low-precision model or step: once more in fp32
                # (every rank together; the ranks without suspects re-run their filler).
                if self.comm.all_reduce_max(int(bad and own)) and self.engine.can_rerun_fp32(
                    bool(self.comm.all_reduce_max(int(autocast)))
                ):
                    current = self._probe.current
                    self._fp32_ids = current[0] if current is not None else self._probe.filler
            self._probe.record(bad)
        self._reruns += 1
        self.engine.abandon()
        if self.comm.all_reduce_max(int(self._probe.pending or self._fp32_ids is not None)):
            return None
        return self._verdict()

    def _verdict(self) -> Verdict:
        assert self._probe is not None and self._inc is not None
        if self._confirming is not None:
            return self._confirmed(self._confirming)
        mine = list(self._probe.culprits)
        gathered = self.comm.all_gather_object(
            {
                "culprits": self._probe.culprits,
                "reproduced": self._probe.reproduced,
                "located": self._located,
                "precision": self._precision,
                "exceeded": self._probe.exceeded,
                "rest": self._rest,
            }
        )
        spike = self._spike
        rest_spikes = self._rest_spikes(gathered)
        inc = self._inc
        inc.reproduced = any(g["reproduced"] for g in gathered)
        inc.probe_steps = self._reruns
        self._probe, self._located, self._precision, self._spike = None, None, None, None
        actions = {"quarantine", "cut_lr"}  # without forensics: what isolation implies
        if self.policy.diagnose.rerun:
            actions = self._classify(inc, gathered)
        elif not inc.reproduced:
            actions = {"cut_lr"}
        found = sorted({i for g in gathered for i in g["culprits"]})
        quarantine = self.policy.quarantine.enabled and "quarantine" in actions
        health = "health" in actions and not self.policy.health.on_incident
        why = self._not_the_data(inc, gathered, found, quarantine, rest_spikes)
        if why is None:
            return self._data_verdict(mine, spike, found, health)
        # Without bisection (quarantine.isolate off) a reproduced step quarantines its
        # origin ranks' samples whole, as isolation off always has.
        culprits = found if quarantine and not self.splits else []
        return Verdict("unexplained", why, culprits, "cut_lr" in actions, True, health)

    def _rest_spikes(self, gathered: list[dict[str, Any]]) -> bool:
        """Whether the step, without its culprits, still spikes (every rank's rest)."""
        spike, rest_sum, rest_n = self._spike, 0.0, 0
        for g in gathered:
            rest_sum, rest_n = rest_sum + g["rest"][0], rest_n + g["rest"][1]
        # Without its culprits the step still spikes: every sample shows it (an LR or a
        # model gone wrong), some more than others; none of them is the data's doing.
        return (
            spike is not None
            and rest_n > 0
            and spike.exceeded(rest_sum / rest_n, rest_n / max(self._step_samples, 1))
        )

    def _not_the_data(
        self,
        inc: Incident,
        gathered: list[dict[str, Any]],
        found: list[int],
        quarantine: bool,
        rest_spikes: bool,
    ) -> str | None:
        """Why the incident is not the data's doing (the unexplained verdict's reason), or
        None when the samples ``found`` explain it."""
        # Explained by data: bisection reproduced it on a few samples and the rest of the
        # step was clean without them. Reproducible on every sample (or on most) is the
        # model or the LR, not the data: nothing is quarantined then.
        if not inc.reproduced:
            return "not_reproduced"
        if not self.splits:
            return "not_isolated"
        if not quarantine:  # diagnose.actions (or quarantine.enabled) said not to
            return "not_quarantined"
        most = self.policy.quarantine.max_step_fraction * self._step_samples
        if rest_spikes or any(g["exceeded"] for g in gathered) or not (0 < len(found) <= most):
            return "most_samples"
        if self._previous is not None and inc.step <= self._previous:
            # The replay after the last incident failed again before getting past it: a
            # replay is exact and its samples passed before, so the model is what changed
            # (or a bad sample moved into the step as quarantine shifted the order: rare).
            return "recurred"
        return None

    def _data_verdict(
        self, mine: list[int], spike: SpikeBar | None, found: list[int], health: bool
    ) -> Verdict:
        """The data's verdict on the samples ``found``; for a spike, first to be confirmed
        by re-running this rank's culprits (``mine``) on an older state."""
        adjust = self.policy.adjust
        data = Verdict(
            "data", "isolated", found, adjust.cut_lr_on_data, adjust.loss_scale_on_data, health
        )
        if spike is None:
            return data
        # A spike's culprits must spike on an older state too: an outlier sample does
        # whatever the model; one that spiked only because an LR or a model went wrong
        # (the samples it hurt most) does not, and quarantining it would be wrong.
        self._probe = Bisection(mine, filler=self._step_ids[:1], split=False)
        self._spike, self._confirming = spike, data
        return Verdict(**{**data.__dict__, "confirm": True})

    def _confirmed(self, data: Verdict) -> Verdict:
        """The verdict after a spike's culprits were re-run on an older state: the data's
        if some rank's still spiked there (those ranks' culprits), else the model's."""
        assert self._probe is not None and self._inc is not None
        kept: list[list[int]] = self.comm.all_gather_object(self._probe.culprits)
        self._inc.probe_steps = self._reruns
        self._probe, self._spike, self._confirming = None, None, None
        found = sorted({i for ids in kept for i in ids})
        if found:
            return Verdict(**{**data.__dict__, "culprits": found, "confirm": False})
        return Verdict("unexplained", "not_confirmed", [], True, True, data.health)

    def _classify(self, inc: Incident, gathered: list[dict[str, Any]]) -> set[str]:
        """Classify the incident from the re-runs and journal it with the evidence.
        Returns its policy actions."""
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
        actions: set[str] = set(self.policy.diagnose.actions[inc.classification])  # type: ignore[index]
        self._decide(
            "diagnosis",
            inc.step,
            incident_step=inc.step,
            classification=inc.classification,
            actions=sorted(actions),
            located=where,
            origin_ranks=inc.origin_ranks,
            batch_ids=self.comm.all_gather_object(self._step_ids),
        )
        return actions
