"""One rank of ``orchestrator health``: run the health checks and report.

Started by the launcher the user gave (``orchestrator health -- torchrun --nproc-per-node N``
appends this script). Rank 0 prints the per-rank table and writes RUN_DIR/health.json; every
rank exits 0 when all are healthy, else 72 (UNHEALTHY).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from orchestrator.comm import Comm, exit_process
from orchestrator.errors import EXIT_UNHEALTHY
from orchestrator.health import HealthChecker
from orchestrator.journal import Journal
from orchestrator.policy import load_policy
from orchestrator.protocol import ENV_ATTEMPT, ENV_FAULTS, ENV_RUN_DIR

REPORT = "health.json"


def main() -> int:
    run_dir = os.environ[ENV_RUN_DIR]
    policy = load_policy()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    comm = Comm()
    journal = Journal(run_dir, comm.global_rank, int(os.environ.get(ENV_ATTEMPT, "0")))
    checker = HealthChecker(policy.health, comm, run_dir)
    if policy.faults or os.environ.get(ENV_FAULTS):  # a drill: its faults wrap the checker
        from orchestrator.faults import FaultInjector, requested, wrap_health

        faults = requested(policy)
        wrap_health(checker, FaultInjector(faults, comm.global_rank, run_dir, journal))
    report = checker.run("standalone")
    if comm.rank == 0:
        print(report.table(), flush=True)
        with open(os.path.join(run_dir, REPORT), "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=1)
        journal.write("health", 0, report.to_dict())
    checker.close(abort=not report.healthy)  # a peer may be absent or frozen
    journal.close()
    return 0 if report.healthy else EXIT_UNHEALTHY


if __name__ == "__main__":
    exit_process(main())
