"""The watcher's judgement of every node, from one read of their counters and records
(launch/store_peers.py publishes it as the store's ``view`` key, which every node reads).

The same rules as launch/nodes.py's reading of the files, judged once for the job instead of
by every node: a node is alive while its beat counter keeps changing (on the watcher's
clock, so the hosts' clocks never matter); the attempt is agreed when every node is alive
and at the highest attempt any live node proposes or runs; the job has lost a node when
fewer than ``nnodes`` have been alive for ``node_timeout_s``, counted from the last beat of
the node that went quiet (a node that never started counts from when the watching began).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launch.nodes import RUNNING

NAMED = 8  # nodes named in a verdict; the rest are counted
QUIET_NAMED = 64  # quiet nodes listed in the view (the flush at the breakpoint names them)


@dataclass
class Watching:
    """What the watcher remembers between looks (on its own monotonic clock)."""

    since: float  # when this node began watching
    seen: dict[str, tuple[int, float]] = field(default_factory=dict)  # node -> (beat, changed)
    moved: set[str] = field(default_factory=set)  # nodes seen beating while watched
    complete_at: float | None = None  # the last look at which every node was alive
    seq: int = 0


def judge(
    w: Watching,
    now: float,
    beats: dict[str, int],
    recs: dict[str, dict[str, Any]],
    *,
    nnodes: int,
    stale_s: float,
    quiet_s: float,
    watcher: str,
) -> dict[str, Any]:
    """One look: the view every node reads. ``beats``/``recs``: every member's counter and
    record (a member without a record yet is left out)."""
    w.seq += 1
    silent: dict[str, float] = {}
    for node, beat in beats.items():
        last = w.seen.get(node)
        if last is None or last[0] != beat:
            w.seen[node] = (beat, now)
            if last is not None:
                w.moved.add(node)
        silent[node] = now - w.seen[node][1]
    alive = [
        n for n, r in recs.items() if r.get("state") == RUNNING and silent.get(n, 0) <= stale_s
    ]
    attempts = {n: int(recs[n].get("attempt", -1)) for n in alive}
    top_node = max(attempts, key=lambda n: (attempts[n], n), default="")
    top = attempts.get(top_node, -1)
    down = sorted(n for n in recs if n not in alive)
    view: dict[str, Any] = {
        "seq": w.seq,
        "watcher": watcher,
        "alive": len(alive),
        "members": len(recs),
        "top": top,
        "top_node": top_node,
        "top_host": recs[top_node].get("host") if top_node else None,
        "agreed": len(alive) >= nnodes and all(a == top for a in attempts.values()),
        "down": down[:QUIET_NAMED],
        "quiet": _quiet({n: s for n, s in silent.items() if n in w.moved}, recs, quiet_s),
        "quiet_beats": {},  # their counters: a new watcher carries their silence on (resume)
        "incomplete_for": -1.0,  # seconds fewer than nnodes were alive; -1: complete
        "missing": None,  # who is missing, said in full (the lost-node verdict's words)
    }
    view["quiet_beats"] = {n: beats[n] for n in view["quiet"]}
    if len(alive) >= nnodes:
        w.complete_at = now
        return view
    # Incomplete since the first missing node's last beat; for a node that never started,
    # since the last look at which every node was alive, or since the watching began.
    since = [w.seen[n][1] for n in down if n in w.seen]
    if len(recs) < nnodes:
        since.append(w.complete_at if w.complete_at is not None else w.since)
    waited = now - min(since) if since else 0.0
    view["incomplete_for"] = round(waited, 3)
    view["missing"] = _missing(view, recs, silent, nnodes)
    return view


def resume(
    view: dict[str, Any],
    read_at: float,
    now: float,
    beats: dict[str, int],
    *,
    old_watcher_since: float | None,
) -> Watching:
    """A new watcher's memory, from the last view it read (at ``read_at``, on its clock):
    the silences that view counted carry on, so a change of watcher (the old one lost, or
    too slow to look) does not restart the lost-node clock. Never early: a silence is
    counted from when this node read it, and only for a node whose counter has not moved
    since. The old watcher itself is silent at least since ``old_watcher_since``, when this
    node last saw the view change (it beats just before each view it writes)."""
    w = Watching(since=now, seq=int(view.get("seq", 0)))
    counted = view.get("quiet_beats", {})
    for node, quiet in view.get("quiet", {}).items():
        if node in beats and counted.get(node) == beats[node]:
            w.seen[node] = (beats[node], read_at - float(quiet))
            w.moved.add(node)
    old = view.get("watcher")
    if old_watcher_since is not None and old in beats and old not in w.seen:
        w.seen[old] = (beats[old], old_watcher_since)
    waited = float(view.get("incomplete_for", -1.0))
    if waited >= 0:  # incomplete since then at least (a node that never started: judge())
        w.complete_at = read_at - waited
    return w


def _quiet(
    silent: dict[str, float], recs: dict[str, dict[str, Any]], quiet_s: float
) -> dict[str, float]:
    """The running nodes quiet for longer than ``quiet_s``, quietest first (bounded)."""
    quiet = [(n, round(s, 1)) for n, s in silent.items()
             if s > quiet_s and recs.get(n, {}).get("state") == RUNNING]  # fmt: skip
    return dict(sorted(quiet, key=lambda kv: -kv[1])[:QUIET_NAMED])


def _missing(
    view: dict[str, Any], recs: dict[str, dict[str, Any]], silent: dict[str, float], nnodes: int
) -> str:
    down = view["down"]
    named = [
        f"{n} (host {recs[n].get('host')}, pid {recs[n].get('pid')}, {recs[n].get('state')}, "
        f"unchanged for {silent.get(n, 0):.0f} s)"
        for n in down[:NAMED]
    ]
    more = len(down) - len(named)
    never = nnodes - len(recs)
    return (
        f"{view['alive']} of {nnodes} nodes have a live supervisor"
        + (f"; not alive: {', '.join(named)}" if named else "")
        + (f" and {more} more" if more > 0 else "")
        + (f"; {never} node(s) never started one in this job" if never > 0 else "")
    )
