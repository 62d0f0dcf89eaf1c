"""The policy's sections: one pydantic v2 model per YAML section (the ``faults`` list's
models are in :mod:`orchestrator.fault_kinds`). Each field's description is what
``configs/default.yaml`` says about it.

The models live by subsystem: :mod:`orchestrator.policy_state` (snapshot, persist),
:mod:`orchestrator.policy_incident` (detect, clip, quarantine, adjust, escalation, diagnose)
and :mod:`orchestrator.policy_ops` (health, metrics, supervisor, export, alerts, tune); every
one is importable from here (and from :mod:`orchestrator.policy`) as before.
"""

from __future__ import annotations

from orchestrator.policy_base import _auto, _int_or_auto, _Section
from orchestrator.policy_incident import (
    Action,
    AdjustPolicy,
    Classification,
    ClipPolicy,
    DetectPolicy,
    DiagnosePolicy,
    EscalationPolicy,
    OverflowPolicy,
    QuarantinePolicy,
    ReplicasPolicy,
    SpikePolicy,
)
from orchestrator.policy_ops import (
    AlertOn,
    AlertsPolicy,
    ExportPolicy,
    HealthPolicy,
    MetricsPolicy,
    SupervisorPolicy,
    TunePolicy,
)
from orchestrator.policy_state import PersistPolicy, SnapshotPolicy

__all__ = [
    "Action",
    "AdjustPolicy",
    "AlertOn",
    "AlertsPolicy",
    "Classification",
    "ClipPolicy",
    "DetectPolicy",
    "DiagnosePolicy",
    "EscalationPolicy",
    "ExportPolicy",
    "HealthPolicy",
    "MetricsPolicy",
    "OverflowPolicy",
    "PersistPolicy",
    "QuarantinePolicy",
    "ReplicasPolicy",
    "SnapshotPolicy",
    "SpikePolicy",
    "SupervisorPolicy",
    "TunePolicy",
    "_Section",
    "_auto",
    "_int_or_auto",
]
