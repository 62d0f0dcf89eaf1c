"""One supervisor per node of a run directory.

Two supervisors on one run directory and node would restart each other's attempts and
interleave their journals. Each holds ``RUN_DIR/supervisors/<node>.lock`` with ``flock``
(released by the kernel when the process dies, even by SIGKILL, so a stale lock cannot
block a restart); the file says who holds it, for the message the second one prints.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

from orchestrator.protocol import SUPERVISORS_DIR


class Locked(Exception):
    """Another supervisor holds the lock; the message says which and what to do."""


def lock_path(run_dir: str, node: str) -> str:
    return os.path.join(os.path.abspath(run_dir), SUPERVISORS_DIR, f"{node}.lock")


class SupervisorLock:
    def __init__(self, run_dir: str, node: str) -> None:
        self.path = lock_path(run_dir, node)
        self.node = node
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise :class:`Locked` at once (never waits)."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise Locked(
                f"{self.path} is held by the supervisor pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')} (since {holder.get('since', '?')}): a supervisor "
                f"already runs node {self.node!r} of this run directory. Stop that one first, "
                "or give this run another --run-dir (or another ORCHESTRATOR_NODE when "
                "simulating several nodes on one machine)"
            ) from None
        os.ftruncate(fd, 0)
        info = {
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "node": self.node,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None


def holder(path: str) -> dict[str, str]:
    """Who holds (or last held) the lock file ``path``: pid, host, node, since; {} if none."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return _read(fd)
    finally:
        os.close(fd)


def _read(fd: int) -> dict[str, str]:
    try:
        return dict(json.loads(os.pread(fd, 4096, 0) or b"{}"))
    except (OSError, ValueError):
        return {}
