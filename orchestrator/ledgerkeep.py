"""Recovery's quarantine ledger: what rank 0 writes to it (retrying; a storage failure is
journaled, never fatal, and the entries are tried again later) and the samples a previous
attempt died on, quarantined at start."""

from __future__ import annotations

import logging

from orchestrator.comm import Comm
from orchestrator.crashes import Suspicion
from orchestrator.journal import Decisions, Journal
from orchestrator.logs import RankLogger
from orchestrator.quarantine import Entry, Ledger
from orchestrator.recovery_policy import RecoveryPolicy
from orchestrator.retry import storage_retry

logger = logging.getLogger(__name__)


class LedgerKeeping:
    """Part of :class:`orchestrator.recovery.Recovery` (its quarantine ledger); uses the
    attributes declared here, which Recovery sets."""

    policy: RecoveryPolicy
    comm: Comm
    journal: Journal
    decide: Decisions
    log: RankLogger
    ledger: Ledger
    # Ledger entries a storage failure held back: (ids, step, reason), oldest first.
    _unwritten: list[Entry]

    def quarantine_crashed(self, found: Suspicion) -> None:
        """At start: the previous attempt died on these samples (a probe of one, or the
        batch they make together after each passed alone; orchestrator/crashes.py). They
        are quarantined like a NaN's culprits (the Guard already skips them) and count
        against the data budget from now on."""
        self.decide(
            "incident", found.step, reason="crash", cause="data", why=found.why,
            budget="data", origin_ranks=found.ranks, samples=found.culprits, micro=found.micro,
        )  # fmt: skip
        written = self._ledger_add(found.culprits, found.step, "crash")
        self.decide(
            "quarantine", found.step, samples=found.culprits, reason="crash",
            ledger=self.ledger.url, persisted=written,
        )  # fmt: skip
        if self.comm.rank == 0:
            self.log.warning(
                "the last attempt died on sample(s) %s at step %d (%s): quarantined",
                found.culprits, found.step, found.why,
            )  # fmt: skip

    def _ledger_add(
        self, ids: list[int], step: int, reason: str, ranges: list[list[int]] | None = None
    ) -> bool:
        """Rank 0 appends to the ledger, retrying; a storage failure is journaled, never
        fatal: the quarantine holds in memory for this run either way, and the entries not
        written are tried again with the next ones and at close (:meth:`flush_ledger`)."""
        if self.comm.rank != 0:
            return True
        self._unwritten.append((ids, step, reason, ranges or []))
        return self.flush_ledger(later=False)

    def hold(self, entries: list[Entry]) -> None:
        """Entries an earlier process could not write (rank 0): write them now, or keep
        trying with the next ones and at close."""
        if self.comm.rank == 0 and entries:
            self._unwritten.extend(entries)
            self.flush_ledger()

    def flush_ledger(self, later: bool = True) -> bool:
        """Write the ledger entries a storage failure held back (rank 0); True if none is
        left. Entries written ``later`` than their quarantine event are journaled
        (``ledger_written``), so the journal says what the ledger holds."""
        while self._unwritten:
            ids, step, reason, ranges = self._unwritten[0]
            late = later or len(self._unwritten) > 1  # not the entry just added
            try:
                storage_retry(self.policy.persist)(self.ledger.add, ids, step, reason, ranges)
            except Exception as err:  # an unreachable store raises botocore's own classes
                failed = {"samples": ids, **({"ranges": ranges} if ranges else {})}
                self.journal.write("ledger_failed", step, {**failed, "error": repr(err)})
                self.log.error("quarantine ledger %s not written: %r", self.ledger.url, err)
                return False
            self._unwritten.pop(0)
            if late:
                written = {"samples": ids, **({"ranges": ranges} if ranges else {})}
                self.journal.write("ledger_written", step, written)
        return True
