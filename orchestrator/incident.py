"""The record of one incident, and its one-screen account."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Incident:
    step: int
    reason: str  # nonfinite_loss | nonfinite_grads | spike_loss | spike_grad_norm
    loss: float
    grad_norm: float
    origin_ranks: list[int]
    started_at: float
    per_rank: list[dict[str, bool]] = field(default_factory=list)
    reproduced: bool | None = None  # None: not re-run (isolation off or not applicable)
    classification: str | None = None  # transient | deterministic (diagnose.rerun)
    # "data": isolation reproduced it on a few samples, quarantined them, and the rest of
    # the step was clean; "unexplained": anything else (not reproduced, every sample bad, a
    # spike, no isolation). The budget it was charged to: "data" or "incidents".
    cause: str | None = None
    budget: str | None = None
    origin_module: str | None = None  # first module with a non-finite output / gradient
    quarantined: list[int] = field(default_factory=list)
    rolled_back_to: int | None = None
    lr_multiplier: float = 1.0
    loss_scale_factor: float = 1.0
    probe_steps: int = 0
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        """A few lines a person reads at 3 a.m.: what, where, what was done."""
        origin = ", ".join(map(str, self.origin_ranks)) or "not attributable (global)"
        if self.reproduced is None:
            verdict = "not re-run"
        elif self.reproduced:
            verdict = "reproducible: the data (or the model on it) produces it"
        else:
            verdict = "did not reproduce: transient (suspect hardware or a one-off)"
        lines = [
            f"INCIDENT at step {self.step}: {self.reason}",
            f"  global loss {self.loss:.6g}, grad norm {self.grad_norm:.6g}; "
            f"origin rank(s): {origin}",
            f"  re-run of the step ({self.probe_steps} probe passes): {verdict}"
            + (f"; born in {self.origin_module}" if self.origin_module else ""),
            f"  cause: {self.cause} (charged to the {self.budget} budget)",
            f"  quarantined samples: {self.quarantined if self.quarantined else 'none'}",
            f"  rolled back to step {self.rolled_back_to}; LR multiplier now {self.lr_multiplier:g}"
            + (f", loss scale x{self.loss_scale_factor:g}" if self.loss_scale_factor != 1 else ""),
            f"  recovered in {self.duration_s:.2f} s",
        ]
        return "\n".join(lines)
