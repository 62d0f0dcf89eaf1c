"""Test shim, never on a production path: steps the wall clock of every Python process
started with this folder on PYTHONPATH, as an NTP step or a VM's clock set after a pause
does, without touching the host's clock.

``time.time()`` returns the real time plus the number of seconds written in the file named
by ``$ORCHESTRATOR_TEST_CLOCK_STEP_FILE`` (re-read at most every 50 ms; no file: no step).
The monotonic clock is left alone, as the kernel leaves it on a wall-clock step. Loaded
by Python's ``site`` at start-up (``sitecustomize``), before any other module.
"""

import os
import time

_FILE = os.environ.get("ORCHESTRATOR_TEST_CLOCK_STEP_FILE")

if _FILE:
    _real_time = time.time
    _read_at = [-1.0]
    _offset = [0.0]

    def _stepped_time() -> float:
        now = time.monotonic()
        if now - _read_at[0] > 0.05:
            _read_at[0] = now
            try:
                with open(_FILE, encoding="ascii") as f:
                    _offset[0] = float(f.read().strip() or 0)
            except (OSError, ValueError):
                pass  # not stepped yet
        return _real_time() + _offset[0]

    time.time = _stepped_time
