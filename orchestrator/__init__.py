"""In-process half of the orchestrator: the Guard and its policy.

>>> from orchestrator import Guard, load_policy

``Guard`` and ``exit_process`` (which need torch) load on first use, so the launch half
(``orchestrator.protocol``, the policy, the journal) imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from orchestrator.errors import (
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_STOPPED,
    EXIT_UNHEALTHY,
    GaveUp,
    OrchestratorError,
    PolicyError,
    Preempted,
    RunStop,
    Unhealthy,
    UsageError,
)
from orchestrator.incident import Incident
from orchestrator.journal import read_journal
from orchestrator.policy import Policy, load_policy, parse_policy
from orchestrator.value import Value

__all__ = [
    "EXIT_CRASH_LOOP",
    "EXIT_GAVE_UP",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_RESTARTS_EXHAUSTED",
    "EXIT_STOPPED",
    "EXIT_UNHEALTHY",
    "GaveUp",
    "Guard",
    "Incident",
    "OrchestratorError",
    "Policy",
    "PolicyError",
    "Preempted",
    "RunStop",
    "Unhealthy",
    "UsageError",
    "Value",
    "exit_process",
    "load_policy",
    "parse_policy",
    "read_journal",
]

if TYPE_CHECKING:
    from orchestrator.comm import exit_process
    from orchestrator.guard import Guard

_LAZY = {"Guard": "orchestrator.guard", "exit_process": "orchestrator.comm"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
