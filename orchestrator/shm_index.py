"""What a shared-memory ring folder holds (orchestrator/shm.py), read without torch: the
supervisor reads it (launch/replica.py), and never imports torch.

A folder holds ``slot<k>/rank<r>.json``, the verdict of rank ``r``'s snapshot in slot ``k``,
beside the bytes it describes; a node part's verdicts name the ranks that share it.
"""

from __future__ import annotations

import json
import os
from typing import Any


def agreeable(
    seen: list[tuple[dict[int, str], list[str]]], newest_durable: int
) -> tuple[list[int], list[str]]:
    """From every rank's ({step: timeline}, refusals): the steps a restart may try, newest
    first (sealed on every rank, all from one timeline, not older than the newest durable
    snapshot), and why the others were refused, by rank."""
    refused = [f"rank {r}: {why}" for r, (_, said) in enumerate(seen) for why in said]
    order = []
    for step in sorted(set.intersection(*(set(s) for s, _ in seen)), reverse=True):
        if step < newest_durable:
            break
        timelines = sorted({s[step] for s, _ in seen})
        if len(timelines) > 1:
            refused.append(
                f"step {step}: the ranks' slots come from different attempts or rollbacks "
                f"({', '.join(timelines)})"
            )
            continue
        order.append(step)
    return order, refused


def verdicts(root: str) -> dict[int, dict[int, tuple[int, dict[str, Any]]]]:
    """Every rank's verdicts in ``root``: rank -> step -> (slot, verdict)."""
    out: dict[int, dict[int, tuple[int, dict[str, Any]]]] = {}
    for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not d.startswith("slot"):
            continue
        for name in os.listdir(os.path.join(root, d)):
            if not (name.startswith("rank") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(root, d, name), encoding="utf-8") as f:
                    v = json.load(f)
            except (OSError, ValueError):
                continue  # withdrawn or being replaced
            out.setdefault(int(v["rank"]), {})[int(v["step"])] = (int(d.removeprefix("slot")), v)
    return out


def node_refusal(
    found: dict[int, dict[int, tuple[int, dict[str, Any]]]],
    step: int,
    verdict: dict[str, Any],
    node_ranks: list[int] | None,
) -> str | None:
    """Why ``verdict``'s node part (the state kept once per node) is incomplete at ``step``:
    a rank that wrote a share has no verdict for it, or one of another node file or
    timeline, or other ranks run on the node now (``node_ranks``; None: do not ask)."""
    node = verdict.get("node")
    if node is None:
        return None
    ranks = [int(r) for r in node["ranks"]]
    if node_ranks is not None and ranks != node_ranks:
        return (
            f"step {step}: its node part was written by ranks {ranks}, this node runs "
            f"ranks {node_ranks} now"
        )
    for r in ranks:
        other = found.get(r, {}).get(step)
        if other is None:
            return f"step {step}: rank {r}'s share of the node part has no verdict"
        theirs = other[1]
        if (theirs.get("node") or {}).get("file") != node["file"] or theirs.get(
            "timeline"
        ) != verdict.get("timeline"):
            return f"step {step}: rank {r}'s share is of another node file or timeline"
    return None
