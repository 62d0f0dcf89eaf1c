"""The node's shared-memory ring goes when its supervisor goes, however it goes.

The supervisor removes the ring when it stops (launch/services.py) and its ranks remove it
when they see it die (orchestrator/lifeline.py). Neither covers a supervisor SIGKILLed while
no rank runs: in its backoff between attempts, or while torchrun and the ranks start. Then
the ring would stay in /dev/shm, holding node memory, until the machine reboots.

This small process covers it. The supervisor starts it in a session of its own (a kill of
the supervisor's process group spares it) with a pipe on its stdin whose only writer is the
supervisor (the pipe is close-on-exec, so torchrun and the ranks never hold it): end of file
means the supervisor exited, by any means; the janitor then removes the ring and ends. It
leaves the ring alone when another live supervisor already holds the node's lock
(launch/lock.py): that one owns the ring now.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from launch.lock import holder
from orchestrator.lifeline import remove_ring

logger = logging.getLogger(__name__)


class Janitor:
    """The janitor of ``ring`` for this supervisor (``lock_path``: the node's lock file)."""

    def __init__(self, ring: str, lock_path: str) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        cmd = [sys.executable, "-m", "launch.janitor", ring, lock_path, str(os.getpid())]
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as err:  # the supervisor still removes the ring when it stops
            logger.warning(
                "cannot start the shared-memory janitor (%s): if this supervisor is "
                "SIGKILLed between attempts, remove %s by hand",
                err,
                ring,
            )

    def close(self, timeout_s: float = 10.0) -> None:
        """The supervisor stops: let the janitor go (it removes what is left) and reap it."""
        if self._proc is None:
            return
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


def _holder_pid(lock_path: str) -> int | None:
    try:
        return int(holder(lock_path).get("pid", ""))
    except ValueError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's: alive
    return True


def main(argv: list[str]) -> int:
    ring, lock_path, supervisor = argv[0], argv[1], int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is for the supervisor, which says when
    while sys.stdin.buffer.read(4096):  # nothing is ever written: this waits for end of file
        pass
    pid = _holder_pid(lock_path)
    if pid is not None and pid != supervisor and _alive(pid):
        return 0  # a new supervisor of this node took over, and with it the ring
    remove_ring(ring)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
