"""Recovery's stops: the health check that ends a run on a sick node (exit 72) and the
budgets that give up (exit 71): unexplained incidents per window, quarantined samples
against the samples seen."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from orchestrator import events
from orchestrator.comm import Comm
from orchestrator.cursor import DataCursor
from orchestrator.errors import GaveUp, Unhealthy
from orchestrator.health import HealthChecker
from orchestrator.incident import Incident
from orchestrator.journal import Decisions, Journal
from orchestrator.logs import RankLogger
from orchestrator.protocol import EVENT_UNHEALTHY
from orchestrator.quarantine import Ledger
from orchestrator.recovery_policy import RecoveryPolicy

logger = logging.getLogger(__name__)


class Stops:
    """Part of :class:`orchestrator.recovery.Recovery` (its health and budget stops); uses
    the attributes declared here, which Recovery sets."""

    policy: RecoveryPolicy
    comm: Comm
    journal: Journal
    decide: Decisions
    log: RankLogger
    ledger: Ledger
    cursor: DataCursor
    health: HealthChecker | None
    incidents: list[Incident]
    rollbacks: int

    def check_health(
        self, reason: str, step: int, before_stop: Callable[[], None] | None = None
    ) -> None:
        """Run the health checks (every rank); on a failure journal the ranks and hosts
        (after ``before_stop``) and stop with exit code 72, so the supervisor or scheduler
        can exclude the node.

        Raises:
            Unhealthy: a check failed on some rank (or timed out).
        """
        assert self.health is not None
        report = self.health.run(reason)
        # A collective that failed leaves each rank its own view: each journals it (rank 0
        # may be the one that never came).
        partial = len(report.ranks) < self.comm.world_size
        decide = Decisions(self.journal, writer=True) if partial else self.decide
        decide("health", step, **report.to_dict())
        if report.healthy:
            return
        if before_stop is not None:
            before_stop()
        named = report.bad_hosts()
        decide(
            EVENT_UNHEALTHY,
            step,
            reason=reason,
            ranks=sorted(report.bad),
            hosts=sorted(set(named.values())),
            failed={str(r): checks for r, checks in sorted(report.bad.items())},
        )
        # Every rank has the same report unless a collective timed out; then each stops on
        # what it saw, and the journal of whichever rank 0 is left says the rest.
        if self.comm.rank == 0 or report.ranks[0]["rank"] != 0:
            self.log.error(
                "UNHEALTHY (%s): %s. Exclude these nodes and restart.",
                reason,
                "; ".join(f"rank {r} on {h}: {report.bad[r]}" for r, h in named.items()),
            )
        raise Unhealthy(
            f"health check failed ({reason}): ranks {sorted(report.bad)} on "
            f"{sorted(set(named.values()))}"
        )

    def _escalate_if_over_budget(self) -> None:
        """The incident budget: unexplained incidents per window."""
        e = self.policy.escalation
        step = self.incidents[-1].step
        recent = [
            i for i in self.incidents if i.budget == "incidents" and i.step > step - e.window_steps
        ]
        if len(recent) > e.max_incidents:
            self._give_up(
                step,
                f"{len(recent)} unexplained incidents within {e.window_steps} steps (steps "
                f"{[i.step for i in recent]}), over escalation.max_incidents={e.max_incidents}",
                budget="incidents",
            )

    def _check_data_budget(self, step: int) -> None:
        """The data budget: quarantined samples against the distinct samples seen (for
        windows of a token stream, the draws seen that the quarantine takes away:
        :meth:`~orchestrator.cursor.DataCursor.samples_lost`)."""
        q = self.policy.quarantine
        total, seen = self.cursor.samples_lost(), self.cursor.samples_seen()
        if total <= max(q.max_fraction * seen, q.budget_min_samples):
            return
        share = f"{total / seen:.2%} of the {seen}"
        what = (
            f"{int(total)} samples quarantined, {share} distinct samples seen"
            if self.cursor.id_span is None
            else f"{len(self.cursor.id_set)} windows quarantined (those overlapping bad ones), "
            f"{share} draws seen from the token stream"
        )
        self._give_up(
            step,
            f"{what}, over quarantine.max_fraction={q.max_fraction:g} (budget_min_samples="
            f"{q.budget_min_samples}). The ledger {self.ledger.url} lists them: inspect the "
            "data (or the model on it); if this much bad data is expected, raise "
            "quarantine.max_fraction",
            budget="data",
            fraction=total / seen,
            samples_seen=seen,
            ledger=self.ledger.url,
        )

    def _give_up(self, step: int, why: str, ledger: str | None = None, **evidence: Any) -> None:
        self.decide.emit(
            step,
            events.GaveUp(why=why, ledger=ledger, rollbacks=self.rollbacks),
            skip_none=True,  # reason and line are the unreadable ledger's (startup.py)
            **evidence,
            incidents=[i.to_dict() for i in self.incidents],
            quarantined=sorted(self.cursor.quarantined),
        )
        if self.comm.rank == 0:
            self.log.error(
                "GAVE UP: %s. Journal: %s (gave_up and the incidents before it).",
                why,
                self.journal.path,
            )
        raise GaveUp(f"gave up at step {step}: {why}")
