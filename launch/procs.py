"""Process plumbing for the supervisor: the launcher's descendants, its output, its end."""

from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Callable
from typing import IO, Any


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


def _prctl() -> Any:
    if sys.platform != "linux":
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


# Resolved here, in the parent: the child between fork and exec (where preexec_fn runs) must
# not load libraries or take locks another thread of the supervisor may have held.
_PRCTL = _prctl()
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` of the launcher: the kernel SIGKILLs it when the supervisor dies, even
    by SIGKILL (Linux ``PR_SET_PDEATHSIG``; a no-op elsewhere). The ranks watch the
    supervisor themselves (orchestrator/lifeline.py)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Handles:
    """Processes seen under an attempt, held by pidfd (Linux): a signal sent through one
    reaches that process or nothing, never a later process that reuses its pid."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    def add(self, pids: set[int]) -> None:
        """Hold the new ``pids``; let go of those that exited (loader workers come and go)."""
        if self._fds:
            gone, _, _ = select.select(list(self._fds.values()), [], [], 0)
            for pid in [p for p, fd in self._fds.items() if fd in gone]:
                os.close(self._fds.pop(pid))
        for pid in pids - self._fds.keys():
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except (OSError, AttributeError):
                continue  # gone already (or no pidfds here): nothing to signal later

    def holds(self, pid: int) -> bool:
        """``pid`` is a process seen under this attempt that has not exited (so its pid
        names it, not a later process's)."""
        fd = self._fds.get(pid)
        if fd is None:
            return False
        gone, _, _ = select.select([fd], [], [], 0)
        return not gone

    def send(self, sig: int, only: set[int] | None = None) -> set[int]:
        """Signal the held processes (those in ``only``); returns the pids reached."""
        reached = set()
        for pid, fd in self._fds.items():
            if only is not None and pid not in only:
                continue
            try:
                signal.pidfd_send_signal(fd, sig)
                reached.add(pid)
            except (OSError, AttributeError):
                pass  # exited meanwhile
        return reached

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


# The states of /proc/<pid>/stat that say why a process cannot answer a signal.
STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible sleep (I/O, a driver)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
}


def proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, D, T, t, Z, ...), None if it is gone
    (or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


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


def tee(src: IO[bytes] | None, log: IO[bytes], at_end: Callable[[], object]) -> None:
    """Copy the child's output to our stdout and its attempt log, chunk by chunk; call
    ``at_end`` at end of file (the launcher and its workers are gone, or going)."""
    if src is None:
        return
    try:
        _copy(src, log)
    finally:
        at_end()


def _copy(src: IO[bytes], log: IO[bytes]) -> None:
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
