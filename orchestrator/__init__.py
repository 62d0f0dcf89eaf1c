"""In-process half of the orchestrator: the Guard and its policy.

>>> from orchestrator import Guard, load_policy
"""

from orchestrator.comm import exit_process
from orchestrator.errors import (
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_UNHEALTHY,
    GaveUp,
    OrchestratorError,
    PolicyError,
    Preempted,
    RunStop,
    Unhealthy,
    UsageError,
)
from orchestrator.guard import Guard
from orchestrator.incident import Incident
from orchestrator.journal import read_journal
from orchestrator.policy import Policy, load_policy, parse_policy

__all__ = [
    "EXIT_CRASH_LOOP",
    "EXIT_GAVE_UP",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_RESTARTS_EXHAUSTED",
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
    "exit_process",
    "load_policy",
    "parse_policy",
    "read_journal",
]
