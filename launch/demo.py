"""`orchestrator demo`: the README's main job, on 2 CPU processes, in about a minute.

The example GPT trains under the supervisor with a transient NaN (step 37, rank 1) and a
hard crash (step 70, rank 0) injected: detect -> roll back -> crash -> restart -> resume
from the node's shared-memory ring (the default where /dev/shm has room; else the durable
snapshot) -> done. Then the journal is told back as a short story.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from launch.status import render
from launch.supervisor import Supervisor
from orchestrator.events import (
    Fault,
    Incident,
    Persist,
    Restart,
    Resume,
    Rollback,
    RunEnd,
    ShmFallback,
    SupervisorExit,
)
from orchestrator.journal import read_events
from orchestrator.policy import parse_policy

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def run_demo(run_dir: str | None, steps: int) -> int:
    if not EXAMPLE.exists():
        print(
            f"the demo runs {EXAMPLE}, which is not here: run it from a checkout of the "
            "repository installed with `pip install -e .`",
            file=sys.stderr,
        )
        return 2
    run_dir = run_dir or os.path.join("runs", time.strftime("demo-%Y%m%d-%H%M%S"))
    policy = parse_policy(
        {
            "persist": {"every_steps": 20},
            "supervisor": {"backoff_s": 1.0, "hang_timeout_s": 60},
            "faults": [
                {"kind": "nan_grad", "step": 37, "rank": 1},
                {"kind": "crash", "step": 70, "rank": 0},
            ],
        },
        source="<demo>",
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        str(EXAMPLE), "--steps", str(steps),
    ]  # fmt: skip
    print(f"[demo] {' '.join(cmd[2:])}\n[demo] run directory: {run_dir}", flush=True)
    code = Supervisor(policy, run_dir, cmd).run()
    print("\n[demo] what happened, from the journal:")
    for line in story(run_dir):
        print(f"  {line}")
    print("\n" + render(run_dir))
    return code


def story(run_dir: str) -> list[str]:
    out = []
    for e in read_events(run_dir).events:
        r, step = e.record, e.step
        if isinstance(r, Fault):
            out.append(f"step {step}: injected {r.fault.get('kind')} on rank {e.rank}")
        elif isinstance(r, Incident):
            out.append(f"step {step}: detected {r.reason} (origin ranks {r.origin_ranks})")
        elif isinstance(r, Rollback):
            out.append(f"step {step}: rolled back from step {r.from_step} to {r.to_step}")
        elif isinstance(r, Persist):
            mb = f"{r.bytes / 2**20:.1f} MB" if r.bytes is not None else "size not said"
            out.append(f"step {step}: durable snapshot committed ({mb})")
        elif isinstance(r, Restart):
            out.append(f"attempt {e.attempt} ended ({r.cause}, exit {r.returncode}): "
                       f"restart in {r.delay_s or 0.0:.1f} s")  # fmt: skip
        elif isinstance(r, Resume):
            where = {"shm": "in shared memory", "remote": "durable", "local": "node-local"}
            tier = f"{where.get(r.tier, r.tier)} snapshot" if r.tier else "snapshot"
            out.append(f"attempt {e.attempt}: resumed from the {tier} of step {step}")
        elif isinstance(r, ShmFallback):
            out.append(f"attempt {e.attempt}: snapshots in private memory: {r.why}")
        elif isinstance(r, RunEnd):
            what = "training finished" if r.status == "finished" else "workers stopped"
            out.append(f"step {step}: {what} ({r.incidents} incident(s) in this attempt)")
        elif isinstance(r, SupervisorExit):
            out.append(f"supervisor: {r.reason} (exit {r.exit_code})")
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
