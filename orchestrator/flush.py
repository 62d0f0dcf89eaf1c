"""Flush at the breakpoint: the node's newest valid shared-memory slot into the durable tier.

When the supervisor stops for good (gave up, crash loop, restarts spent, unhealthy,
preempted, stopped), the node's shared-memory ring is about to be removed, and it may hold
snapshots newer than the newest durable one (``snapshot.every_steps`` is finer than
``persist.every_steps``). The supervisor then runs ``python -m orchestrator.flush`` (a
helper process: the supervisor never imports torch), which writes the newest step that
every rank sealed and whose bytes match their checksums as a durable snapshot, exactly as
the ranks' own writers would have (each rank's part, the manifest, the marker), so the next
job, on any nodes, resumes from it. The helper journals a ``flush`` event either way.

One node only for now: when the job spans nodes, each node holds only its own ranks' slots
and nothing is flushed (the event says so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from orchestrator.journal import Journal
from orchestrator.policy import load_policy
from orchestrator.protocol import EVENT_FLUSH, SUPERVISOR_RANK
from orchestrator.shm import ShmSlots, agreeable, node_refusal, verdicts
from orchestrator.snapshot import Snapshot, flatten
from orchestrator.store import DurableStore, default_url


def flush(shm_dir: str, url: str, commit_timeout_s: float) -> dict[str, Any]:
    """Write the newest flushable slot to ``url``; returns what happened (the event)."""
    found = verdicts(shm_dir)  # rank -> {step: (slot, verdict)}
    if not found:
        return {"flushed": False, "reason": "no sealed slot in shared memory"}
    world = {int(v["world_size"]) for steps in found.values() for _, v in steps.values()}
    if len(world) != 1 or set(found) != set(range(next(iter(world)))):
        return {
            "flushed": False,
            "reason": f"the slots hold ranks {sorted(found)} of world size(s) {sorted(world)}: "
            "only a job whose ranks all run on this node is flushed (not yet across nodes)",
        }
    world_size = next(iter(world))
    keep = max(slot for steps in found.values() for slot, _ in steps.values()) + 1
    slots = {r: ShmSlots(shm_dir, r, world_size, keep, attempt=-1) for r in found}
    store = DurableStore(url)
    committed = store.committed_steps()
    newest_durable = committed[0] if committed else -1
    seen: list[tuple[dict[int, str], list[str]]] = [
        ({s: str(v.get("timeline")) for s, (_, v) in found[r].items()}, []) for r in sorted(found)
    ]
    order, refused = agreeable(seen, newest_durable + 1)  # strictly newer than durable
    for step in order:
        errors = [
            f"rank {r}: {e}"
            for r in found
            if (e := node_refusal(found, step, found[r][step][1], None))
            or (e := slots[r].check(found[r][step][0]))
        ]
        if errors:
            refused += errors
            continue
        nonce = f"flush-{os.getpid()}"
        written = 0
        for r in sorted(found):
            slot, verdict = found[r][step]
            plan = verdict["persist"]
            leaves: list[Any] = []
            skeleton = flatten(slots[r].load(slot), leaves)
            snap = Snapshot(step, sealed=True, skeleton=skeleton, buffers=leaves)
            written += store.write_part(
                snap, r, world_size, plan["keys"], nonce, plan["native"], plan["texts"]
            )
        store.commit(step, world_size, nonce, found[0][step][1]["persist"]["extra"],
                     commit_timeout_s)  # fmt: skip
        return {"flushed": True, "step": step, "url": url, "bytes": written, "refused": refused}
    why = f"no step newer than durable {newest_durable} is sealed and intact on every rank"
    return {"flushed": False, "reason": why, "refused": refused}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--shm-dir", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--attempt", type=int, default=0)
    args = ap.parse_args(argv)
    policy = load_policy(args.policy)
    url = policy.persist.url or default_url(args.run_dir)
    journal = Journal(args.run_dir, SUPERVISOR_RANK, args.attempt)
    try:
        said = flush(args.shm_dir, url, policy.persist.commit_timeout_s)
    except Exception as err:  # the supervisor reports it and stops anyway
        said = {"flushed": False, "reason": f"failed: {err!r}"}
    journal.write(EVENT_FLUSH, int(said.get("step", -1)), said)
    journal.close()
    print(json.dumps(said))
    return 0 if said["flushed"] else 1


if __name__ == "__main__":
    sys.exit(main())
