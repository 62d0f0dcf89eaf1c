"""Hang forensics: before a hung attempt is killed, every rank's Python stack goes into
``RUN_DIR/hangs/attempt-<n>/rank<r>.txt`` and the culprits are named, with the ranks that
could not answer (a frozen process: its /proc state). NCCL's flight recorder dumps found in
that folder's ``nccl/`` stay with them.

The culprits come from the heartbeats' phases first (:func:`orchestrator.heartbeat.suspects`:
the ranks behind the others, which wait for them in a collective further on), each with its
innermost frame as evidence; from the stacks only where the phases cannot tell
(:func:`orchestrator.stacks.culprits`). On NCCL the stacks alone often cannot: a collective
returns once queued, and the waiting ranks sit in the Guard's host sync, outside any
``torch.distributed`` frame."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from launch.procs import STATES
from orchestrator.heartbeat import suspects
from orchestrator.protocol import HEARTBEAT_DIR, node_path
from orchestrator.stacks import culprits, frames

HANGS_DIR = "hangs"


def collect(
    run_dir: str,
    attempt: int,
    node: str,
    beats: list[dict[str, Any]],
    ask: Callable[[list[dict[str, Any]]], list[int]],
    every_rank: list[dict[str, Any]] | None = None,
    wait_s: float = 3.0,
    state: Callable[[int], str | None] | None = None,
) -> tuple[str, list[dict[str, Any]], dict[int, str | None]]:
    """Ask this ``node``'s ranks (``beats``) for their stacks (``ask`` signals them and returns
    the ranks it reached), keep the dumps under ``hangs/attempt-<n>/``, and name the
    culprits (:func:`name_culprits`) among every rank (``every_rank``: all nodes' beats of
    the attempt; the other nodes' supervisors, seeing the same hang, put their stacks
    beside within ``wait_s``). A rank of this node that gives no stack (stopped, in
    uninterruptible sleep, gone) is a culprit too, with its /proc state (``state(pid)``),
    when another rank answered or its state says it cannot. Returns that folder, the
    culprits (rank, host, phase, step, ``by``: ``phase`` or ``stacks``, innermost frame of
    the training thread, or ``answered: false`` and the state) and this node's ranks'
    states."""
    out = os.path.join(run_dir, HANGS_DIR, f"attempt-{attempt}")
    with contextlib.suppress(OSError):  # a full disk: the stacks are read where they are
        os.makedirs(out, exist_ok=True)
    asked = set(ask(beats))
    src = {
        r: os.path.join(node_path(run_dir, HEARTBEAT_DIR, node), f"rank{r}.stack") for r in asked
    }
    deadline = time.monotonic() + wait_s
    texts = _own_stacks(src, out, deadline)
    everyone = {int(b["rank"]): b for b in (every_rank or beats)}
    while time.monotonic() < deadline and not all(  # the other nodes' dumps
        r in texts or _size(os.path.join(out, f"rank{r}.txt")) for r in everyone
    ):
        time.sleep(0.2)
    stacks: dict[int, list[str]] = {}
    for rank, b in everyone.items():
        path = os.path.join(out, f"rank{rank}.txt")
        text = texts.get(rank) or (_read(path) if _size(path) else "")
        if text:
            stacks[rank] = frames(text, str(b.get("thread", "")))
    states = {int(b["rank"]): state(int(b.get("pid", -1))) if state else None for b in beats}
    named = name_culprits(list(everyone.values()), stacks, states)
    # Ours that gave no stack: a stopped or stuck process cannot run its signal handler.
    for b in beats:
        r = int(b["rank"])
        if r in stacks or any(c["rank"] == r for c in named):
            continue
        if stacks or states.get(r) not in ("R", "S"):
            named.append(_culprit(b, stacks, states, "stacks"))
    return out, sorted(named, key=lambda c: int(c["rank"])), states


def _own_stacks(src: dict[int, str], out: str, deadline: float) -> dict[int, str]:
    """This node's ranks' dumps (rank -> its ``.stack`` file), once written (until
    ``deadline``, monotonic), copied into ``out``: rank -> the text."""
    sizes: dict[int, int] = {}
    while time.monotonic() < deadline:  # bounded: a rank may be past answering
        now = {r: _size(p) for r, p in src.items()}
        if all(now.values()) and now == sizes:
            break  # every dump written and no longer growing
        sizes = now
        time.sleep(0.2)
    texts: dict[int, str] = {}
    for rank, path in src.items():
        if _size(path):
            texts[rank] = _read(path)
            try:
                shutil.copyfile(path, os.path.join(out, f"rank{rank}.txt"))
            except OSError:
                pass  # kept in memory: the culprits are still named
    return texts


def name_culprits(
    beats: list[dict[str, Any]],
    stacks: dict[int, list[str]],
    states: dict[int, str | None] | None = None,
) -> list[dict[str, Any]]:
    """The culprits of a hang among the ranks of ``beats`` (every rank's latest heartbeat),
    by rank. First from the phases (``by: phase``): the ranks behind the others in the step
    (an older step, or an earlier phase of it: data and forward, backward), which the others
    (in the step's check, or further on) wait for. Where the phases cannot tell (every rank
    at the same place, or one outside the step), from the ``stacks`` (rank -> frames,
    innermost first; ``by: stacks``): the ranks outside any collective while others wait in
    one. Each culprit's innermost frame (``frame``), when its stack is there, is the
    evidence; ``states`` (rank -> /proc state) says what a rank without a stack is."""
    by_rank = {int(b["rank"]): b for b in beats}
    behind = suspects(beats)
    how, ranks = ("phase", behind) if behind else ("stacks", culprits(stacks))
    return [_culprit(by_rank[r], stacks, states or {}, how) for r in ranks if r in by_rank]


def _culprit(
    beat: dict[str, Any], stacks: dict[int, list[str]], states: dict[int, str | None], how: str
) -> dict[str, Any]:
    r = int(beat["rank"])
    stack = stacks.get(r)
    c = {"rank": r, "host": beat.get("host"), "node": beat.get("node"), "step": beat.get("step"),
         "phase": beat.get("phase"), "by": how, "frame": stack[0] if stack else None,
         "answered": r in stacks, "state": states.get(r)}  # fmt: skip
    if r not in stacks:
        c["pid"] = beat.get("pid")
    return c


def culprit_words(c: dict[str, Any]) -> str:
    """A culprit of a hang event, for a person."""
    where = f"rank {c['rank']} on {c.get('host')}"
    if c.get("answered", True):
        if c.get("by") == "phase":
            return (f"{where} is behind the others (step {c.get('step')}, {c.get('phase')}), "
                    f"at {c.get('frame')}")  # fmt: skip
        return f"{where} is outside the collective, at {c.get('frame')}"
    if c.get("state") is None and c.get("by") == "phase":
        return f"{where} is behind the others (step {c.get('step')}, {c.get('phase')})"
    state = c.get("state")
    how = f"is {STATES.get(state, state)} (/proc state {state})" if state else "is gone"
    return f"{where} did not answer the stack request: pid {c.get('pid')} {how}"


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
