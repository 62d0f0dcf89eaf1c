"""Run a training script as one without the in-place rank side (a script from before the
Guard healed in place): the rank does not see the agent's in-place environment, so a
survivor dies of its peer's death and the agent falls back to a full restart.

    orchestrator launch --nproc-per-node 2 tests/no_rank_side.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import os
import runpy
import sys

from orchestrator.inplace_protocol import ENV_INPLACE

if __name__ == "__main__":
    os.environ.pop(ENV_INPLACE, None)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
