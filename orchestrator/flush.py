"""Flush at the breakpoint: the node's newest valid shared-memory slots into the durable tier.

When the supervisor stops for good (gave up, crash loop, restarts spent, unhealthy,
preempted, stopped), the node's shared-memory ring is about to be removed, and it may hold
snapshots newer than the newest durable one (``snapshot.every_steps`` is finer than
``persist.every_steps``). The supervisor then runs ``python -m orchestrator.flush`` (a
helper process: the supervisor never imports torch), which writes the newest step that
every rank sealed and whose bytes match their checksums as a durable snapshot, exactly as
the ranks' own writers would have (each rank's part, the manifest, the marker), so the next
job, on any nodes, resumes from it. The helper journals a ``flush`` event either way.

A job on several nodes: each node's ring holds only its own ranks' slots, and every node's
supervisor stops (one end, launch/nodes.py) and runs its helper. Each helper publishes the
steps its ranks hold intact in ``RUN_DIR/flush/<node>.json`` and waits (bounded) until the
nodes' files cover every rank; all then write their ranks' parts of the newest step they
all hold on one timeline, with one nonce, and the node holding rank 0 commits it. A node
that never publishes (lost, or its ring is empty) means nothing is flushed, and the event
names the ranks missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from orchestrator.journal import Journal
from orchestrator.policy import load_policy
from orchestrator.protocol import EVENT_FLUSH, SUPERVISOR_RANK, node_path
from orchestrator.rundir import write_atomic
from orchestrator.shm import ShmSlots, agreeable, node_refusal, verdicts
from orchestrator.snapshot import Snapshot, flatten
from orchestrator.store import DurableStore, default_url, signing_key

FLUSH_DIR = "flush"
Found = dict[int, dict[int, tuple[int, dict[str, Any]]]]  # rank -> step -> (slot, verdict)


def flush(
    shm_dir: str,
    url: str,
    commit_timeout_s: float,
    run_dir: str | None = None,
    node: str = "",
    wait_s: float = 60.0,
    signing: bytes | None = None,
) -> dict[str, Any]:
    """Write the newest flushable step of this node's ranks to ``url``; returns what
    happened (the event). ``run_dir`` and ``node``: where the nodes of a job on several
    nodes agree on the step (``wait_s`` at most)."""
    found = verdicts(shm_dir)
    if not found:
        return {"flushed": False, "reason": "no sealed slot in shared memory"}
    # The ranks of the newest attempt on this node (others' slots may be left from before).
    key = max(int(v["attempt"]) for steps in found.values() for _, v in steps.values())
    found = {r: s for r, s in found.items() if any(v["attempt"] == key for _, v in s.values())}
    world = {int(v["world_size"]) for steps in found.values() for _, v in steps.values()}
    if len(world) != 1:
        return {"flushed": False, "reason": f"the slots hold world sizes {sorted(world)}"}
    world_size = next(iter(world))
    keep = max(slot for steps in found.values() for slot, _ in steps.values()) + 1
    slots = {r: ShmSlots(shm_dir, r, world_size, keep, attempt=-1) for r in found}
    store = DurableStore(url, key=signing)
    committed = store.committed_steps()
    newest_durable = committed[0] if committed else -1
    mine, refused = _intact(found, slots, newest_durable)
    if set(found) != set(range(world_size)):  # the other ranks' slots are on other nodes
        if run_dir is None:
            return {"flushed": False, "reason": "other nodes hold the other ranks' slots"}
        agreed = _agree(run_dir, node, key, sorted(found), mine, world_size, wait_s)
        if isinstance(agreed, str):
            return {"flushed": False, "reason": agreed, "refused": refused}
        mine = agreed
    if not mine:
        why = f"no step newer than durable {newest_durable} is sealed and intact on every rank"
        return {"flushed": False, "reason": why, "refused": refused}
    step = max(mine)
    nonce = f"flush-{key}-{step}"  # alike on every node: one snapshot
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
    said = {"flushed": True, "step": step, "url": url, "bytes": written, "refused": refused,
            "ranks": sorted(found)}  # fmt: skip
    if 0 in found:  # the node holding rank 0 commits, once every rank's part is there
        store.commit(step, world_size, nonce, found[0][step][1]["persist"]["extra"],
                     commit_timeout_s)  # fmt: skip
    else:
        said["committed_by"] = "the node holding rank 0"
    return said


def _intact(
    found: Found, slots: dict[int, ShmSlots], newest_durable: int
) -> tuple[dict[int, str], list[str]]:
    """{step: timeline} of the steps newer than ``newest_durable`` that every rank here
    sealed on one timeline, node parts complete, bytes matching; and why others were not."""
    seen: list[tuple[dict[int, str], list[str]]] = [
        ({s: str(v.get("timeline")) for s, (_, v) in found[r].items()}, []) for r in found
    ]
    order, refused = agreeable(seen, newest_durable + 1)  # strictly newer than durable
    intact: dict[int, str] = {}
    for step in order:
        errors = [
            f"rank {r}: {e}"
            for r in found
            if (e := node_refusal(found, step, found[r][step][1], None))
            or (e := slots[r].check(found[r][step][0]))
        ]
        if errors:
            refused += errors
        else:
            intact[step] = str(found[min(found)][step][1].get("timeline"))
    return intact, refused


def _agree(
    run_dir: str,
    node: str,
    key: int,
    ranks: list[int],
    mine: dict[int, str],
    world_size: int,
    wait_s: float,
) -> dict[int, str] | str:
    """Publish this node's intact steps; wait for the other nodes of the job (their files
    of the same attempt) to cover every rank; the steps all hold on one timeline, or why
    not (a string)."""
    path = node_path(run_dir, FLUSH_DIR, node, ".json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_atomic(path, json.dumps({"attempt": key, "ranks": ranks, "steps": mine}))
    deadline = time.monotonic() + wait_s
    while True:
        nodes = []
        d = os.path.dirname(path)
        for name in sorted(os.listdir(d)):
            try:
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue  # being written
            if doc.get("attempt") == key:
                nodes.append(doc)
        covered = {int(r) for doc in nodes for r in doc["ranks"]}
        if covered >= set(range(world_size)):
            seen: list[tuple[dict[int, str], list[str]]] = [
                ({int(s): t for s, t in doc["steps"].items()}, []) for doc in nodes
            ]
            order, _ = agreeable(seen, -1)
            return {s: mine[s] for s in order if s in mine}
        if time.monotonic() >= deadline:
            missing = sorted(set(range(world_size)) - covered)
            return (
                f"the nodes holding ranks {missing} did not say which steps they hold "
                f"within {wait_s:g} s (lost, or their rings are empty): nothing flushed"
            )
        time.sleep(0.2)  # bounded by the deadline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--shm-dir", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--attempt", type=int, default=0)
    ap.add_argument("--node", default="")
    ap.add_argument("--wait-s", type=float, default=60.0)
    args = ap.parse_args(argv)
    policy = load_policy(args.policy)
    url = policy.persist.url or default_url(args.run_dir)
    journal = Journal(args.run_dir, SUPERVISOR_RANK, args.attempt)
    try:
        key = signing_key(policy.persist.signing_key_file)
        said = flush(args.shm_dir, url, policy.persist.commit_timeout_s, args.run_dir,
                     args.node, args.wait_s, key)  # fmt: skip
    except Exception as err:  # the supervisor reports it and stops anyway
        said = {"flushed": False, "reason": f"failed: {err!r}"}
    journal.write(EVENT_FLUSH, int(said.get("step", -1)), {**said, "node": args.node})
    journal.close()
    print(json.dumps(said))
    return 0 if said["flushed"] else 1


if __name__ == "__main__":
    sys.exit(main())
