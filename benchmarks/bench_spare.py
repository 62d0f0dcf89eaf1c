"""In-place recovery with and without the node agent's warm spare, against today's full
restart, in one run (issue 33's target: fault to the next committed step <= 1.5 s at 10M
parameters, >= 5x faster than the full restart).

Each case trains the example GPT (``--d-model 256 --layers 12``: 10M parameters; DDP, gloo,
2 CPU ranks) under ``orchestrator launch --nproc-per-node 2`` (the node agent); rank 1 is
SIGKILLed by the policy's crash fault at ``--fault-step``:

- ``spare``: in place, the replacement is the agent's warm spare (the default);
- ``fresh``: in place, ``supervisor.in_place_spares: 0`` (a fresh process);
- ``restart``: ``supervisor.in_place: false`` (every rank stopped and started again).

The cases alternate within each repeat, so a busy host slows them alike. Times are seconds
from the fault (rank 1's ``fault`` event, journaled just before its SIGKILL) on the host's
wall clock, read from the journal: the agent's decision (``rank_replaced``), the group
re-formed (the survivors' ``init_process_group`` returned: the replacement's script reached
its own), the heal (every rank loaded the agreed step; the replacement built its model, DDP
and Guard before it) from rank 0's ``inplace_recovery`` times, and the next committed step.

    python benchmarks/bench_spare.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.journal import load_journal  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "spare": {"in_place_spares": 1},
    "fresh": {"in_place_spares": 0},
    "restart": {"in_place": False},
}
POLICY: dict[str, Any] = {
    "adjust": {"lr_factor": 1.0},
    "quarantine": {"enabled": False},
    "snapshot": {"every_steps": 5, "keep": 3},
    "persist": {"every_steps": 10},
}
MARKS = ("decided", "reform", "heal", "next_step")


def one(case: str, work: Path, args: argparse.Namespace) -> dict[str, float]:
    d = work / f"{case}-{len(list(work.iterdir()))}"
    sup = {"backoff_s": 0.2, **CASES[case]}
    policy = {**POLICY, "supervisor": sup,
              "faults": [{"kind": "crash", "step": args.fault_step, "rank": 1}]}  # fmt: skip
    path = work / f"{d.name}.yaml"
    path.write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
           "--run-dir", str(d), "--nproc-per-node", "2", str(REPO / "examples" / "train_gpt.py"),
           "--steps", str(args.steps), "--d-model", str(args.d_model),
           "--layers", str(args.layers)]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"bench_spare: {case} failed ({r.returncode}):\n{r.stdout[-3000:]}")
    events = load_journal(str(d))[0]
    of = lambda kind: [e for e in events if e["kind"] == kind]  # noqa: E731
    (fault,) = [e["time"] for e in of("fault") if e["rank"] == 1]
    out: dict[str, float] = {}
    if case == "restart":
        out["next_step"] = min(e["time"] for e in of("first_step") if e["attempt"] == 1)
    else:
        (rep,) = of("rank_replaced")
        assert rep["details"]["spare"] is (case == "spare"), rep
        (rec,) = [e for e in of("inplace_recovery") if e["rank"] == 0]
        t = rec["details"]["times"]
        out.update(decided=rep["details"]["decided"], reform=t["reform"], heal=t["heal"],
                   next_step=t["first_step"])  # fmt: skip
    return {k: round(v - fault, 3) for k, v in out.items()}


def table(results: dict[str, list[dict[str, float]]]) -> str:
    rows = ["| case | " + " | ".join(MARKS) + " | vs restart |", "|---" * (len(MARKS) + 2) + "|"]
    base = statistics.median(r["next_step"] for r in results["restart"])
    for case, runs in results.items():
        cells = []
        for m in MARKS:
            xs = [r[m] for r in runs if m in r]
            cells.append(
                f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"
            )
        ratio = base / statistics.median(r["next_step"] for r in runs)
        rows.append(f"| {case} | " + " | ".join(cells) + f" | {ratio:.1f}x |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--fault-step", type=int, default=27)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", help="also write every run's times here")
    ap.add_argument("--work", help="keep the runs' directories here (default: a temporary one)")
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {c: [] for c in args.cases.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for i in range(args.repeats):
            for case in results:
                results[case].append(one(case, work, args))
                print(f"repeat {i} {case}: {results[case][-1]} load {os.getloadavg()[0]:.1f}",
                      flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if "restart" in results:
        print(table(results))


if __name__ == "__main__":
    main()
