"""Exceptions and the worker exit-code protocol.

Two families, kept apart on purpose:

* :class:`OrchestratorError` (an ``Exception``): something is wrong and the caller can act on
  it (a bad policy, an API used out of order). The message says where and what to do.
* :class:`RunStop` (a ``SystemExit``): the run must end now and must not be retried blindly
  (the incident budget is spent, a rank is unhealthy). Uncaught, the interpreter exits with
  the documented code below and no traceback, which is what the supervisor and torchrun read.
"""

from __future__ import annotations

# Worker exit codes (orchestrator.protocol; README "Exit codes"), re-exported here.
from orchestrator.protocol import (
    EXIT_CANNOT_START,
    EXIT_CRASH_LOOP,
    EXIT_GAVE_UP,
    EXIT_LOCKED,
    EXIT_NODE_LOST,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_RESTARTS_EXHAUSTED,
    EXIT_STOPPED,
    EXIT_UNHEALTHY,
)

__all__ = [
    "EXIT_CANNOT_START",
    "EXIT_CRASH_LOOP",
    "EXIT_GAVE_UP",
    "EXIT_LOCKED",
    "EXIT_NODE_LOST",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_RESTARTS_EXHAUSTED",
    "EXIT_STOPPED",
    "EXIT_UNHEALTHY",
    "GaveUp",
    "LedgerError",
    "LedgerUnreadable",
    "OrchestratorError",
    "PersistError",
    "PolicyError",
    "Preempted",
    "PreemptedUnsaved",
    "RunStop",
    "Unhealthy",
    "UsageError",
]


class OrchestratorError(Exception):
    """Base class of every recoverable error raised by this library."""


class PersistError(OrchestratorError):
    """A durable snapshot could not be written or is not valid."""


class PolicyError(OrchestratorError):
    """The policy (YAML or in-code) is invalid or cannot be met on this machine."""


class UsageError(OrchestratorError):
    """The Guard API was called out of order (e.g. ``step`` before ``backward``)."""


class LedgerError(OrchestratorError):
    """A line of the quarantine ledger is not an entry (``url``, ``line``: where)."""

    def __init__(self, message: str, url: str, line: int) -> None:
        super().__init__(message)
        self.url, self.line = url, line


class RunStop(SystemExit):
    """Terminal: the run stops with a protocol exit code. Catch it only to clean up."""

    exit_code: int = 1

    def __init__(self, message: str) -> None:
        super().__init__(self.exit_code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Preempted(RunStop):
    """Stopped on SIGTERM/SIGINT at a step boundary, after a durable snapshot."""

    exit_code = EXIT_PREEMPTED


class PreemptedUnsaved(Preempted):
    """Stopped on SIGTERM/SIGINT at a step boundary, but the durable snapshot could not be
    written (the ``preempted`` event says how many steps are lost): exit 143, never 73."""

    exit_code = EXIT_STOPPED


class GaveUp(RunStop):
    """More incidents than ``escalation.max_incidents`` within ``escalation.window_steps``."""

    exit_code = EXIT_GAVE_UP


class LedgerUnreadable(GaveUp):
    """The quarantine ledger does not parse: a restart cannot fix it, so the run stops with
    the gave-up code (the supervisor does not restart) and the journal's ``gave_up`` event
    names the file and line."""


class Unhealthy(RunStop):
    """A health check failed: the journal's ``unhealthy`` event names the ranks and hosts."""

    exit_code = EXIT_UNHEALTHY
