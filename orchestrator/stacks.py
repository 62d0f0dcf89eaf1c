"""Every rank's Python stack on a hang, and who the culprit is.

At start each rank registers :mod:`faulthandler` on ``SIGUSR2`` (no Python code runs in
the handler, so it answers even with the GIL held or the main thread blocked in C inside a
collective), writing all its threads' stacks to ``heartbeats/<node>/rank<r>.stack``. On a hang
the supervisor signals every rank of its node, gathers the stacks into
``RUN_DIR/hangs/attempt-<n>/`` and names the culprits. The heartbeats' phases name them first
(``launch/hangs.py``: the ranks behind the others, who wait for them further on); the stacks
are the evidence, and the fallback where the phases cannot tell: when one rank hangs, the
others soon wait inside a collective further on, so the ranks whose training thread is *not*
inside one are the ones to suspect. Torch-free: the supervisor imports it.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import threading
from typing import IO, Any

STACK_SIGNAL = signal.SIGUSR2
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)
# Where a rank waits for the others: torch's collectives and their waits, and the Guard's
# check, whose host sync (``.tolist()`` of the all-reduced flags) is where a rank waits on NCCL
# (the collective itself returns once queued, so no torch.distributed frame is left).
_COLLECTIVE = ("torch/distributed/", "torch/nn/parallel/distributed.py", "orchestrator/check.py")


def arm(path: str) -> IO[str]:
    """Dump all threads' stacks to ``path`` on STACK_SIGNAL (the file stays open: the
    handler writes to its descriptor). Returns the file, which the caller keeps."""
    f = open(path, "w", encoding="utf-8")
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
    return f


def disarm(f: IO[str]) -> None:
    faulthandler.unregister(STACK_SIGNAL)
    f.close()


def main_thread_id() -> str:
    """The training (main) thread's id as faulthandler prints it."""
    ident = threading.main_thread().ident or 0
    return f"0x{ident:016x}"


def frames(text: str, thread: str) -> list[str]:
    """The frames of ``thread`` in a faulthandler dump, innermost first
    (``'File "x.py", line 3 in f'``)."""
    starts = list(_THREAD.finditer(text))
    for i, m in enumerate(starts):
        if m.group(2) == thread:
            end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
            body = text[m.end() : end].splitlines()[1:]
            return [line.strip() for line in body if line.strip().startswith("File ")]
    return []


def in_collective(stack: list[str]) -> bool:
    return any(marker in frame for frame in stack for marker in _COLLECTIVE)


def culprits(stacks: dict[int, list[str]]) -> list[int]:
    """The ranks whose training thread is outside any collective while other ranks wait in
    one; empty when the stacks cannot tell (all inside, or all outside)."""
    outside = [r for r, s in stacks.items() if s and not in_collective(s)]
    inside = [r for r, s in stacks.items() if s and in_collective(s)]
    return sorted(outside) if outside and inside else []


def signal_ranks(beats: list[dict[str, Any]]) -> list[int]:
    """Ask every rank in ``beats`` for its stacks; returns the ranks signalled."""
    asked = []
    for b in beats:
        try:
            os.kill(int(b["pid"]), STACK_SIGNAL)
            asked.append(int(b["rank"]))
        except (KeyError, ProcessLookupError, PermissionError):
            continue
    return asked
