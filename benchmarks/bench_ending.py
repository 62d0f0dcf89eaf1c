"""How often a finished 2-rank run of a plain script (``tests/ending_worker.py``: no
``orchestrator.exit_process``, it returns after ``guard.close()``, the way scripts end) exits
non-zero, optionally with busy loops saturating the CPU beside it. On gloo a worker thread that
frees a collective's tensors as the interpreter finalizes aborts such a run (SIGABRT); the
Guard fences the gloo groups at exit to prevent it (``orchestrator.comm.fence_gloo_at_exit``).

    python benchmarks/bench_ending.py --runs 20 --engine fsdp1 --busy 4   # aborts / runs
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "ending_worker.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--engine", choices=("ddp", "fsdp1", "fsdp2", "zero2"), default="ddp")
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the runs")
    args = ap.parse_args()
    codes: collections.Counter[int] = collections.Counter()
    t0 = time.time()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.runs):
                env = {**os.environ, "ORCHESTRATOR_RUN_DIR": os.path.join(tmp, f"run{i}")}
                port = str(29600 + i % 200)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                       "--master-addr", "127.0.0.1", "--master-port", port,
                       os.path.abspath(WORKER), "--engine", args.engine]  # fmt: skip
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
                codes[r.returncode] += 1
                if r.returncode != 0:
                    print(f"run {i}: exit {r.returncode}: {r.stderr.strip().splitlines()[-3:]}")
    finally:
        for p in busy:
            p.kill()
            p.wait()
    bad = args.runs - codes[0]
    print(f"{args.engine}, {args.busy} busy loops: {bad} of {args.runs} finished runs exited "
          f"non-zero ({dict(codes)}), {time.time() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
