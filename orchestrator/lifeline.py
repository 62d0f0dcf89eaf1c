"""A rank ends itself when its supervisor is gone.

``orchestrator launch`` starts the launcher with a parent-death signal (launch/procs.py), so
a SIGKILLed supervisor takes torchrun with it; torchrun's workers would still be orphans,
holding GPUs and the rendezvous port while the next attempt starts. So every rank watches
the supervisor itself: a pidfd opened at start (it names that process, never a later one
with a recycled pid) becomes readable when the supervisor exits, and a daemon thread then
kills this rank. Linux only (pidfd_open, kernel >= 5.3); elsewhere nothing is watched.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import threading

from orchestrator.protocol import ENV_SHM_DIR, ENV_SUPERVISOR_PID

logger = logging.getLogger(__name__)


def watch_supervisor() -> bool:
    """Start watching the supervisor named by $ORCHESTRATOR_SUPERVISOR_PID, if any. Returns
    whether a watch runs. Safe to call more than once (one watch per process)."""
    global _watching
    raw = os.environ.get(ENV_SUPERVISOR_PID)
    if not raw or _watching or not hasattr(os, "pidfd_open"):
        return _watching
    try:
        fd = os.pidfd_open(int(raw))
    except (OSError, ValueError):
        # Already gone (or not ours to see): this rank outlived it already.
        logger.error("the supervisor (pid %s) is gone: ending this rank", raw)
        os.kill(os.getpid(), signal.SIGKILL)
        return False

    def wait() -> None:
        select.select([fd], [], [])
        logger.error("the supervisor (pid %s) died: ending this rank", raw)
        # Its shared-memory ring would outlive everyone (nobody is left to remove it).
        remove_ring(os.environ.get(ENV_SHM_DIR))
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="orchestrator-lifeline", daemon=True).start()
    _watching = True
    return True


_watching = False


def remove_ring(root: str | None) -> None:
    """Remove the ring folder ``root`` while this rank's training thread may still write
    into it. Renamed away first, so the thread's next file under ``root`` fails instead of
    landing in a folder rmtree already walked (which then stays); a thread that recreates
    ``root`` itself (its very first slot) is caught by looking again."""
    if not root:
        return
    for _ in range(5):
        gone = f"{root}.gone-{os.getpid()}"
        try:
            os.rename(root, gone)
        except OSError:
            gone = root  # already gone, or renamed by another rank of the node
        shutil.rmtree(gone, ignore_errors=True)
        if not os.path.exists(root):
            return
