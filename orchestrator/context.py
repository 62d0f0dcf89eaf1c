"""What every component of a Guard shares: the group, the journal, the run and a clock.

Components take a :class:`Context` and only the policy section(s) they read
(:mod:`orchestrator.factory` builds them in order), so a test can build one alone from a
context and its own section.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.comm import Comm
from orchestrator.journal import Decisions, Journal


@dataclass(frozen=True)
class Clock:
    """The clocks components read: injectable, so a test can drive time."""

    monotonic: Callable[[], float] = time.monotonic  # durations
    wall: Callable[[], float] = time.time  # timestamps that outlive the process


@dataclass(frozen=True)
class Context:
    """One rank's shared context.

    Attributes:
        comm: the group whose ranks decide together.
        journal: this rank's journal of the run.
        decide: journals a collective decision once (rank 0 of the group).
        run_dir: the run directory every rank agreed on.
        attempt: the attempt id every rank agreed on.
        clock: the clocks to read.
    """

    comm: Comm
    journal: Journal
    decide: Decisions
    run_dir: str
    attempt: int
    clock: Clock = field(default_factory=Clock)

    @classmethod
    def open(cls, comm: Comm, run_dir: str, attempt: int, clock: Clock | None = None) -> Context:
        """A context on this rank's journal of ``run_dir`` (opened here), rank 0 of
        ``comm`` journaling the decisions."""
        journal = Journal(run_dir, comm.global_rank, attempt)
        decide = Decisions(journal, comm.rank == 0)
        return cls(comm, journal, decide, run_dir, attempt, clock or Clock())
