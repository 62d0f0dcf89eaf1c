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
from typing import Any

from orchestrator.journal import read_journal
from orchestrator.protocol import LEDGER_NAME
from orchestrator.quarantine import Ledger
from orchestrator.store import DurableStore, default_url

# Faults that damage a committed snapshot on purpose: the drill expects it refused, not kept.
_DAMAGING = ("truncate_snapshot", "corrupt_manifest")


def expected_snapshots(events: list[dict[str, Any]], url: str) -> set[int]:
    """The committed steps under ``url`` that the journal says must still be there."""
    kept: set[int] = set()
    for e in sorted(events, key=lambda e: e["time"]):
        d = e.get("details", {})
        if d.get("url", url) != url:
            continue  # another store (the node-local tier)
        if e["kind"] == "persist":
            kept.add(int(e["step"]))
        elif e["kind"] == "flush" and d.get("flushed") and "committed_by" not in d:
            kept.add(int(d["step"]))
        elif e["kind"] == "persist_prune":
            kept -= {int(s) for s in d.get("deleted_steps", [])}
        elif e["kind"] == "persist_invalidate":
            kept -= {int(s) for s in d.get("uncommitted_steps", [])}
        elif e["kind"] == "fault" and d.get("fault", {}).get("kind") in _DAMAGING:
            kept.discard(int(e["step"]))
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
    events = list(read_journal(run_dir))
    url = (url or default_url(run_dir)).rstrip("/")
    store = DurableStore(url, key=key)
    lost = []
    cands = {c.step: c for c in store.candidates()}
    for step in sorted(expected_snapshots(events, url)):
        cand = cands.get(step)
        why = "gone" if cand is None else store.check(cand)
        if why is not None:
            lost.append(f"committed snapshot {step} under {url}: {why}")
    written = {
        int(s)
        for e in events
        if (e["kind"] == "quarantine" and e["details"].get("persisted", True))
        or e["kind"] == "ledger_written"
        for s in e["details"].get("samples", [])
    }
    if written:
        in_ledger = Ledger(ledger_url or os.path.join(run_dir, LEDGER_NAME)).load()
        lost += [
            f"quarantined sample {s} is missing from the ledger"
            for s in sorted(written - in_ledger)
        ]
    return lost
