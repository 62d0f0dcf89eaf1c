"""How often a finished 2-rank run of a plain script (no ``orchestrator.exit_process``: it
returns from ``main`` after ``guard.close()``, the way scripts end) exits non-zero. On gloo
an interpreter teardown with a gloo thread still holding tensors can abort such a run
(SIGABRT); the Guard destroys the process group at exit to prevent it.

    python benchmarks/bench_ending.py --runs 100          # prints aborts / runs
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

SCRIPT = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from inproc import Regression
from orchestrator import Guard, parse_policy

def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(parse_policy({{"persist": {{"enabled": False}}}}), model=model, optimizer=opt)
    for x, y in guard.batches(guard.dataloader(Regression(), batch_size=4), max_steps=20):
        guard.backward(torch.nn.functional.mse_loss(model(x).squeeze(-1), y))
        guard.step()
    guard.close()

if __name__ == "__main__":
    main()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
    codes: collections.Counter[int] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plain.py")
        with open(path, "w") as f:
            f.write(SCRIPT.format(tests=os.path.abspath(tests)))
        t0 = time.time()
        for i in range(args.runs):
            env = {**os.environ, "ORCHESTRATOR_RUN_DIR": os.path.join(tmp, f"run{i}")}
            port = str(29600 + i % 200)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", port, path]  # fmt: skip
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            codes[r.returncode] += 1
            if r.returncode != 0:
                print(f"run {i}: exit {r.returncode}: {r.stderr.strip().splitlines()[-3:]}")
    bad = args.runs - codes[0]
    print(f"{bad} of {args.runs} finished runs exited non-zero ({dict(codes)}), "
          f"{time.time() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
