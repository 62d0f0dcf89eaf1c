"""The policy sections recovery reads, and only those (a test builds one from them alone)."""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.policy import (
    AdjustPolicy,
    DetectPolicy,
    EscalationPolicy,
    HealthPolicy,
    PersistPolicy,
    Policy,
    QuarantinePolicy,
    SnapshotPolicy,
)


@dataclass(frozen=True)
class RecoveryPolicy:
    """Named as the :class:`Policy`'s sections: ``detect`` (its replicas), ``quarantine``
    and ``escalation`` (the budgets), ``adjust`` (the LR cut), ``snapshot`` (the rollback's
    minimum age), ``health`` (checks on an incident) and ``persist`` (ledger retries)."""

    detect: DetectPolicy
    quarantine: QuarantinePolicy
    escalation: EscalationPolicy
    adjust: AdjustPolicy
    snapshot: SnapshotPolicy
    health: HealthPolicy
    persist: PersistPolicy

    @classmethod
    def of(cls, p: Policy) -> RecoveryPolicy:
        return cls(p.detect, p.quarantine, p.escalation, p.adjust, p.snapshot, p.health, p.persist)
