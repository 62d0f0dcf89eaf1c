"""LR multiplier after incidents: cut, hold, then ramp linearly back to 1.0.

The multiplier is applied around ``optimizer.step()`` only (the Guard restores the
scheduler's LR right after), so chainable schedulers never see it and a multiplier of 1.0
changes nothing, bit for bit.
"""

from __future__ import annotations

from typing import Any

from orchestrator.policy_sections import AdjustPolicy


class LRAdjuster:
    def __init__(self, policy: AdjustPolicy) -> None:
        self.policy = policy
        self.cut = 1.0  # multiplier right after the latest incident
        self.since = 0  # committed steps since that incident

    def multiplier(self) -> float:
        p = self.policy
        if self.cut >= 1.0 or self.since < p.hold_steps:
            return self.cut
        ramp = self.since - p.hold_steps
        if p.rewarm_steps == 0 or ramp >= p.rewarm_steps:
            return 1.0
        return self.cut + (1.0 - self.cut) * ramp / p.rewarm_steps

    def on_incident(self) -> float:
        """Cut from the current multiplier (cuts compound, down to ``min_lr_factor``)."""
        if self.policy.lr_factor < 1.0:
            self.cut = max(self.multiplier() * self.policy.lr_factor, self.policy.min_lr_factor)
            self.since = 0
        return self.cut

    def on_commit(self) -> str | None:
        """Advance one committed step; return a phase change worth journaling, if any."""
        if self.cut >= 1.0:
            return None
        self.since += 1
        p = self.policy
        if self.since == p.hold_steps and p.rewarm_steps > 0:
            return "rewarm_start"
        if self.since >= p.hold_steps + p.rewarm_steps:
            self.cut, self.since = 1.0, 0
            return "restored"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"cut": self.cut, "since": self.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cut, self.since = float(state["cut"]), int(state["since"])
