"""Process plumbing for the supervisor: the launcher's descendants, its output, its end."""

from __future__ import annotations

import os
import signal
import sys
from typing import IO


def describe(returncode: int, killed_by_us: bool = False) -> str:
    """How the launcher ended, for a person; ``killed_by_us``: the supervisor stopped it
    (a hang, a signal it forwarded), so a SIGKILL is not someone else's."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        if killed_by_us:
            return f"killed by the supervisor ({name})"
        hint = " (the OOM killer?)" if name == "SIGKILL" else ""
        return f"killed by {name}{hint}"
    return f"exit {returncode}"


def descendants(root: int) -> set[int]:
    """Every live process under ``root`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", encoding="ascii", errors="replace") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(name))
    except OSError:
        return set()
    out: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def tee(src: IO[bytes] | None, log: IO[bytes]) -> None:
    """Copy the child's output to our stdout and its attempt log, chunk by chunk."""
    if src is None:
        return
    out = sys.stdout.buffer
    for chunk in iter(lambda: src.read1(65536), b""):  # type: ignore[attr-defined]
        try:
            log.write(chunk)
            log.flush()
        except (OSError, ValueError):
            pass  # a full disk must not stop the draining, or the workers block on print
        try:
            out.write(chunk)
            out.flush()
        except (BrokenPipeError, ValueError):
            pass
