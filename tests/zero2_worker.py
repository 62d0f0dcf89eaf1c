"""The DeepSpeed example (examples/train_gpt_deepspeed.py), run as it is, with what
tests/test_inplace_zero2.py needs around it: each process writes its pid when it starts
and when it ends (``$ORCHESTRATOR_RUN_DIR/pids/``), so a test sees that a survivor kept its
process.

    orchestrator launch --nproc-per-node 2 tests/zero2_worker.py [--lose-shm]
        [--die-in-heal] <the example's arguments>

``--lose-shm``: a replacement (generation > 0) deletes its rank's shared-memory slots
before it starts, as if the node's memory of the dead process were gone.
``--die-in-heal``: in attempt 0 the replacement SIGKILLs itself when its Guard joins the
survivor's agreement (it ran ``deepspeed.initialize``, which the survivor mirrored): a
second death during healing.
``--die-in-step K``: in attempt 0, rank 1 of generation 0 SIGKILLs itself inside DeepSpeed's
``engine.step()`` of step K, once its torch optimizer stepped (the norm's all-reduce done,
the weights' all-gather not yet): the survivor's error comes from inside that step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_gpt_deepspeed as example

from orchestrator import exit_process
from orchestrator.inplace_protocol import ENV_GENERATION
from orchestrator.protocol import ENV_SHM_DIR


def note_pid(when: str) -> None:
    rank, gen = os.environ["RANK"], os.environ.get(ENV_GENERATION, "0")
    attempt = os.environ.get("ORCHESTRATOR_ATTEMPT", "0")
    d = Path(os.environ["ORCHESTRATOR_RUN_DIR"]) / "pids"
    d.mkdir(exist_ok=True)
    name = f"rank{rank}-attempt{attempt}-gen{gen}-{when}.json"
    (d / name).write_text(json.dumps({"pid": os.getpid()}))


def die_in_join() -> None:
    from orchestrator.rejoin import Rejoin

    def join(self: Rejoin) -> int:
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable")

    Rejoin.join = join  # type: ignore[method-assign]


def die_in_step(step: int) -> None:
    import deepspeed

    real = deepspeed.initialize

    def initialize(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        calls = [0]

        def hook(*_: Any) -> None:
            calls[0] += 1
            if calls[0] == step + 1:  # the first call is step 0's
                os.kill(os.getpid(), signal.SIGKILL)

        out[0].optimizer.optimizer.register_step_post_hook(hook)
        return out

    deepspeed.initialize = initialize


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lose-shm", action="store_true")
    ap.add_argument("--die-in-heal", action="store_true")
    ap.add_argument("--die-in-step", type=int, default=-1)
    ours, rest = ap.parse_known_args()
    replacement = int(os.environ.get(ENV_GENERATION, "0") or 0) > 0
    note_pid("start")
    if replacement and ours.lose_shm:
        for f in Path(os.environ[ENV_SHM_DIR]).glob(f"slot*/rank{os.environ['RANK']}*"):
            f.unlink()
    if replacement and ours.die_in_heal and os.environ.get("ORCHESTRATOR_ATTEMPT") == "0":
        die_in_join()
    first = os.environ.get("ORCHESTRATOR_ATTEMPT") == "0" and not replacement
    if ours.die_in_step >= 0 and first and os.environ["RANK"] == "1":
        die_in_step(ours.die_in_step)
    code = example.main(rest)
    note_pid("end")
    return code


if __name__ == "__main__":
    exit_process(main())
