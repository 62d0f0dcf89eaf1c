"""How the drill (launch/drill.py) judges a cell's run: its final state against the clean
run's (bytes compared), the time from the fault to the next completed step and the steps
recomputed (from the journal and metrics), and the audit of what it committed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.journal import read_journal, read_metrics
from orchestrator.policy import load_policy


def _same_final(a: Path, b: Path) -> bool:
    """Every rank's final state (whole tensors, bytes compared) is the same in both runs."""
    import torch

    fa, fb = sorted(a.glob("rank*.pt")), sorted(b.glob("rank*.pt"))
    if not fa or [f.name for f in fa] != [f.name for f in fb]:
        return False
    return all(
        _equal(torch.load(x, weights_only=True), torch.load(y, weights_only=True))
        for x, y in zip(fa, fb, strict=True)
    )


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )  # fmt: skip
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple)) and len(a) == len(b)
            and all(_equal(x, y) for x, y in zip(a, b, strict=True))
        )  # fmt: skip
    return bool(a == b)


def _recovery(run_dir: Path) -> tuple[float | None, int | None]:
    """(seconds from the fault to the next completed step, steps recomputed) from the
    journal and metrics; (None, None) for a fault that interrupted nothing."""
    events = list(read_journal(str(run_dir)))
    faults = [e for e in events if e["kind"] == "fault"]
    recovered = [e for e in events if e["kind"] == "recovered"]
    if faults:
        at, step = float(faults[-1]["time"]), int(faults[-1]["step"])
    elif recovered:  # a fault that journals no event of its own (a poison sample)
        inc = recovered[0]["details"]["incident"]
        at, step = float(inc["started_at"]), int(inc["step"])
    else:
        return None, None
    inplace = [e for e in events if e["time"] > at and e["kind"] == "inplace_recovery"]
    if inplace:  # the survivors re-formed in place: the event has the first step's time
        first = float(inplace[0]["details"]["times"]["first_step"])
        return round(first - at, 2), max(0, step - int(inplace[0]["step"]))
    back = [e for e in events if e["time"] > at and e["kind"] in ("rollback", "resume")]
    if not back:
        return None, None
    to = back[0]["details"]["to_step" if back[0]["kind"] == "rollback" else "snapshot_step"]
    # The first step completed after the state was restored (steps a preempted job still
    # finished before it stopped are not a recovery).
    rows = [r for r in read_metrics(str(run_dir)) if float(r["time"]) > back[0]["time"]]
    recovery = round(float(rows[0]["time"]) - at, 2) if rows else None
    return recovery, max(0, step - int(to))


def _audit(run_dir: Path, url: str | None) -> list[str]:
    from orchestrator.audit import audit
    from orchestrator.store import signing_key

    try:
        policy = load_policy(run_dir / "policy.yaml")
        key = signing_key(policy.persist.signing_key_file)
        return audit(str(run_dir), url, policy.quarantine.ledger_url, key)
    except Exception as err:  # the audit itself failed: that is a finding, not a pass
        return [f"audit failed: {err!r}"]


def _in_place(run_dir: Path) -> str:
    """An agent cell's in-place verdict: ``yes: rank R from SOURCE`` per recovery, or ``no:``
    and the agent's reason for its full restart (``no: -`` when none was journaled)."""
    events = list(read_journal(str(run_dir)))
    done = [e["details"] for e in events if e["kind"] == "inplace_recovery"]
    if done:
        sources = [
            f"rank {r} from {s['source']}"
            for d in done
            for r, s in sorted(d["sources"].items())
            if int(r) in d["replaced"]
        ]
        return "yes: " + ", ".join(sources)
    failed = [e["details"]["reason"] for e in events if e["kind"] == "inplace_failed"]
    return f"no: {failed[0] if failed else '-'}"
