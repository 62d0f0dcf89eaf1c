"""What a run lost that it promised to keep, from its journal and its storage.

A committed durable snapshot may leave the store only by retention (``persist_prune``) or
because a rollback abandoned its timeline (``persist_invalidate``); both are journaled
before anything is deleted. So replaying the journal gives the snapshots that must still be
there and valid, and every quarantined sample the journal says was written to the ledger
must still be in it. The fault drills (``orchestrator drill``) and the tests call
:func:`audit` after every fault; it must find nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from orchestrator.events import (
    Fault,
    Flush,
    LedgerWritten,
    Persist,
    PersistInvalidate,
    PersistPrune,
    Quarantine,
    typed,
)
from orchestrator.journal import read_events
from orchestrator.protocol import LEDGER_NAME
from orchestrator.quarantine import Ledger
from orchestrator.store import DurableStore, default_url

# Faults that damage a committed snapshot on purpose: the drill expects it refused, not kept.
_DAMAGING = ("truncate_snapshot", "corrupt_manifest")


def expected_snapshots(events: Iterable[Any], url: str) -> set[int]:
    """The committed steps under ``url`` that the journal says must still be there
    (``events``: the protocol's, or the journal's dicts)."""
    kept: set[int] = set()
    for e in typed(events).events:  # in time order
        r = e.record
        if e.details.get("url", url) != url:
            continue  # another store (the node-local tier)
        if isinstance(r, Persist):
            kept.add(e.step)
        elif isinstance(r, Flush) and r.flushed and r.step is not None and r.committed_by is None:
            kept.add(r.step)
        elif isinstance(r, PersistPrune):
            kept -= set(r.deleted_steps)
        elif isinstance(r, PersistInvalidate):
            kept -= set(r.uncommitted_steps)
        elif isinstance(r, Fault) and r.fault.get("kind") in _DAMAGING:
            kept.discard(e.step)
    return kept


def audit(
    run_dir: str, url: str | None = None, ledger_url: str | None = None, key: bytes | None = None
) -> list[str]:
    """Every committed snapshot or ledger entry the run lost (empty: nothing lost).

    Args:
        run_dir: the run directory (its journal).
        url: the durable store (default: the run directory's snapshots).
        ledger_url: the quarantine ledger (default: the run directory's).
        key: the manifest signing key, if the run signed its manifests.
    """
    events = read_events(run_dir).events
    url = (url or default_url(run_dir)).rstrip("/")
    store = DurableStore(url, key=key)
    lost = []
    cands = {c.step: c for c in store.candidates()}
    for step in sorted(expected_snapshots(events, url)):
        cand = cands.get(step)
        why = "gone" if cand is None else store.check(cand)
        if why is not None:
            lost.append(f"committed snapshot {step} under {url}: {why}")
    records = [
        e.record
        for e in events
        if (isinstance(e.record, Quarantine) and e.record.persisted)
        or isinstance(e.record, LedgerWritten)
    ]
    written = {s for r in records for s in r.samples}
    spans = sorted({(lo, hi) for r in records for lo, hi in r.ranges})
    if written or spans:
        in_ledger = Ledger(ledger_url or os.path.join(run_dir, LEDGER_NAME)).load()
        lost += [
            f"quarantined sample {s} is missing from the ledger"
            for s in sorted(s for s in written if s not in in_ledger)
        ]
        lost += [
            f"quarantined range [{lo}, {hi}) is missing from the ledger"
            for lo, hi in spans
            if in_ledger.count_in(lo, hi) < hi - lo
        ]
    return lost
