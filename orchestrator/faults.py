"""Fault injection for drills and tests (policy ``faults``; empty by default).

A poisoned sample makes the loss of every batch holding it non-finite, every time it is
seen. Every other fault fires once per run directory: firing is journaled (``fault``) by the
rank it fires on, and a Guard starting in the same run directory reads those events back, so
a replay after a rollback or a restart does not fire it again.
"""

from __future__ import annotations

from collections.abc import Iterable

from orchestrator.journal import Journal, read_journal
from orchestrator.policy import Fault, InfLossFault, NanGradFault, PoisonSampleFault


def fault_key(f: Fault) -> str:
    if isinstance(f, PoisonSampleFault):
        return f"poison_sample:{f.sample}"
    return f"{f.kind}@{f.step}:r{f.rank}"


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int, run_dir: str, journal: Journal) -> None:
        self.rank = rank
        self.journal = journal
        mine = [f for f in faults if isinstance(f, PoisonSampleFault) or f.rank == rank]
        fired = {
            e["details"].get("key")
            for e in read_journal(run_dir)
            if e.get("kind") == "fault" and e.get("rank") == rank
        }
        self._pending = [f for f in mine if not isinstance(f, PoisonSampleFault)]
        self._pending = [f for f in self._pending if fault_key(f) not in fired]
        self.poisoned = frozenset(f.sample for f in faults if isinstance(f, PoisonSampleFault))

    @property
    def active(self) -> bool:
        return bool(self._pending or self.poisoned)

    def _take(self, cls: type, step: int) -> bool:
        for f in self._pending:
            if isinstance(f, cls) and f.step == step:
                self._pending.remove(f)
                self.journal.write("fault", step, {"key": fault_key(f), "fault": f.model_dump()})
                return True
        return False

    def loss_fault(self, step: int, sample_ids: Iterable[int], one_shot: bool) -> str | None:
        """``"poison"`` (make the loss NaN), ``"inf"`` (add inf to the loss) or None.

        ``one_shot=False`` during re-runs of a step: only the poison applies there.
        """
        if self.poisoned and not self.poisoned.isdisjoint(sample_ids):
            return "poison"
        if one_shot and self._take(InfLossFault, step):
            return "inf"
        return None

    def grad_fault(self, step: int) -> bool:
        """True when a NaN must be written into a gradient after backward."""
        return self._take(NanGradFault, step)
