"""The policy's sections about an incident: detecting it (``detect`` and its ``spike``,
``replicas`` and ``overflow``), responding to it (``clip``, ``quarantine``, ``adjust``,
``escalation``) and diagnosing it (``diagnose``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from orchestrator.policy_base import _Section


class SpikePolicy(_Section):
    enabled: bool = Field(
        True,
        description="Treat loss / grad-norm spikes as incidents (finite divergence: an LR "
        "blow-up, outlier samples). A loss spike is re-run like a NaN: samples that "
        "reproduce it alone are quarantined; one every sample shows cuts the LR.",
    )
    metrics: list[Literal["loss", "grad_norm"]] = Field(
        default_factory=lambda: ["loss"],  # type: ignore[arg-type]
        description="Which global values are watched.",
    )
    window: int = Field(
        100, ge=8, description="Steps of history for the noise (second differences)."
    )
    min_history: int = Field(20, ge=4, description="No spike decision before this many steps.")
    reference_steps: int = Field(
        5,
        ge=1,
        description="A value is compared with the median of this many last values, moved "
        "along a falling trend (the flattest of the window's median step-to-step change and "
        "two recent slopes): the level now. A value below that median is never a spike.",
    )
    zscore: float = Field(
        7.0,
        gt=0,
        description="Spike when (x - reference) / noise exceeds this; noise from the median "
        "absolute second differences at lags 1 and 2 over the window (their geometric mean, "
        "/ sqrt(6)): neither a trend nor the bend of a flattening loss is noise.",
    )

    @model_validator(mode="after")
    def _history_fits(self) -> SpikePolicy:
        if self.min_history > self.window:
            raise ValueError(
                f"min_history={self.min_history} exceeds window={self.window}: the decision "
                "would never be made; lower min_history or raise window"
            )
        return self


class ReplicasPolicy(_Section):
    enabled: bool = Field(
        True,
        description="Every snapshot carries a digest of the state training changes only in "
        "the optimizer step (parameters, and optimizer state where replicated), computed on "
        "the device. Where ranks hold that state alike (DDP, ZeRO-1/2 parameters) the "
        "replicas compare digests in a second tiny all-reduce at each snapshot step: a "
        "mismatch is a 'divergence' incident (roll back to the newest snapshot the replicas "
        "agreed on). Every engine checks a restored snapshot against its digest.",
    )
    sick_after: int = Field(
        2,
        ge=1,
        description="A rank named as the odd one out of this many divergences within "
        "escalation.window_steps is sick: stop with exit code 72 naming it and its host.",
    )


class OverflowPolicy(_Section):
    max_skips: int | None = Field(
        8,
        ge=1,
        description="A loss scaler skipping this many steps in a row (non-finite gradients "
        "each time) is an incident, 'persistent_overflow', not business as usual: a healthy "
        "scaler finds its scale within a few skips. null: never.",
    )
    min_loss_scale: float | None = Field(
        1.0,
        gt=0,
        description="A loss scale below this after a skip is a 'persistent_overflow' "
        "incident too (gradients overflow even unscaled). null: no floor.",
    )


class DetectPolicy(_Section):
    check_grads: bool = Field(
        True, description="Include the gradients in the finite check (the loss is always checked)."
    )
    spike: SpikePolicy = Field(default_factory=SpikePolicy)  # type: ignore[arg-type]
    replicas: ReplicasPolicy = Field(default_factory=ReplicasPolicy)  # type: ignore[arg-type]
    overflow: OverflowPolicy = Field(default_factory=OverflowPolicy)  # type: ignore[arg-type]


class ClipPolicy(_Section):
    max_norm: float | None = Field(
        None,
        gt=0,
        description="Clip gradients to this global L2 norm when a step commits, by the norm "
        "the finite check already computed (no second norm, no extra collective or host "
        "sync); the journal and metrics keep the norm before clipping. null: no clipping. "
        "DeepSpeed clips by its own gradient_clipping instead.",
    )


class QuarantinePolicy(_Section):
    enabled: bool = Field(True, description="Quarantine the samples of a bad step.")
    scope: Literal["step", "window"] = Field(
        "step",
        description="'step': the bad step's samples; 'window': also the samples of the "
        "window_steps steps before it (PaLM-style skip).",
    )
    window_steps: int = Field(0, ge=0, description="Steps before the bad one, for scope=window.")
    isolate: bool = Field(
        True,
        description="With scope=step, re-run sub-batches of the bad step (bisection) to "
        "quarantine only the samples that reproduce the non-finite value. A step that does not "
        "reproduce is treated as transient and quarantines nothing.",
    )
    ledger_url: str | None = Field(
        None, description="fsspec URL of the JSONL ledger; null means RUN_DIR/quarantine.jsonl."
    )
    max_fraction: float = Field(
        0.01,
        gt=0,
        le=1,
        description="Data budget: give up when the quarantined samples exceed this fraction of "
        "the distinct samples seen so far (more bad data than that says the data set, or the "
        "model on it, is the problem). Incidents explained by data are charged here, not to "
        "escalation.max_incidents.",
    )
    max_step_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="An incident whose isolated culprits are more than this fraction of the "
        "bad step's samples is not explained by data (a model or LR that diverges fails on "
        "every sample): nothing is quarantined and it counts as unexplained.",
    )
    budget_min_samples: int = Field(
        16,
        ge=0,
        description="Quarantining up to this many samples is always within the data budget "
        "(early in a run the fraction of the few samples seen says little).",
    )

    @model_validator(mode="after")
    def _window_has_size(self) -> QuarantinePolicy:
        if self.scope == "window" and self.window_steps < 1:
            raise ValueError("scope=window needs window_steps >= 1 (how many earlier steps)")
        return self


class AdjustPolicy(_Section):
    lr_factor: float = Field(
        0.5, gt=0, le=1, description="Multiply the LR by this on each incident (1.0: off)."
    )
    min_lr_factor: float = Field(
        0.01, gt=0, le=1, description="Floor of the cumulative LR multiplier."
    )
    hold_steps: int = Field(20, ge=0, description="Steps at the cut LR before re-warming.")
    rewarm_steps: int = Field(100, ge=0, description="Steps of linear ramp back to 1.0.")
    loss_scale_factor: float = Field(
        0.5, gt=0, le=1, description="Multiply a GradScaler's scale by this on each incident."
    )
    cut_lr_on_data: bool = Field(
        False,
        description="Cut the LR on incidents explained by data too (bad samples isolated and "
        "quarantined). Off: the cause was the sample, not the optimization.",
    )
    loss_scale_on_data: bool = Field(
        False,
        description="Apply loss_scale_factor on incidents explained by data too.",
    )


class EscalationPolicy(_Section):
    max_incidents: int = Field(
        3,
        ge=0,
        description="Give up when more unexplained incidents than this occur within "
        "window_steps (not reproducible, reproducible on every sample, a spike, or no "
        "isolation); incidents explained by bad samples count against the data budget "
        "(quarantine.max_fraction) instead.",
    )
    window_steps: int = Field(500, ge=1, description="Sliding window for the incident budget.")


Classification = Literal["transient", "deterministic", "precision", "data_or_model"]


Action = Literal["quarantine", "cut_lr", "health"]


def _default_actions() -> dict[Classification, list[Action]]:
    return {
        "transient": ["health"],  # suspect hardware: check it; no sample reproduces it
        "deterministic": ["quarantine", "cut_lr"],
        "precision": ["quarantine", "cut_lr"],
        "data_or_model": ["quarantine", "cut_lr"],
    }


class DiagnosePolicy(_Section):
    rerun: bool = Field(
        False,
        description="On an incident, re-run the failed step: not reproducible -> "
        "'transient'; reproducible -> 'deterministic' (with the first module whose "
        "output or gradient is non-finite), refined for fp16/bf16 models by an fp32 "
        "re-run into 'precision' (finite in fp32) or 'data_or_model'.",
    )
    actions: dict[Classification, list[Action]] = Field(
        default_factory=_default_actions,
        description="What each classification does, besides the rollback: quarantine "
        "(the samples that reproduce it), cut_lr (adjust section), health (run the health "
        "checks if health.on_incident has not already). A classification left out keeps "
        "its default.",
    )

    @field_validator("actions")
    @classmethod
    def _complete(cls, v: dict[Classification, list[Action]]) -> dict[Classification, list[Action]]:
        return {**_default_actions(), **v}
