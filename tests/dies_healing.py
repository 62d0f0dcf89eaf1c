"""Run a training script whose replacement rank (issue 33) dies while it heals: in attempt
0, a process started in a generation after the first SIGKILLs itself where its Guard would
join the survivors' agreement (``Rejoin.join``). The survivor's agreement then fails, and
the agent falls back to a full restart. The hook wraps what it perturbs; a healthy rank
runs none of it.

    orchestrator launch --nproc-per-node 2 tests/dies_healing.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from orchestrator.inplace_protocol import ENV_GENERATION
from orchestrator.protocol import ENV_ATTEMPT
from orchestrator.rejoin import Rejoin


def _die(self: Rejoin) -> int:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILLed")


if __name__ == "__main__":
    replacement = int(os.environ.get(ENV_GENERATION, "0") or 0) > 0
    if replacement and os.environ.get(ENV_ATTEMPT, "0") == "0":
        Rejoin.join = _die  # type: ignore[method-assign]
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
