"""Goodput of the example run under a fixed fault schedule, by snapshot interval policy, in
one run: the defaults, ``every_steps: auto`` (both tiers), and a sweep of fixed intervals
(the best of which is what a person tuning by hand would find).

Each configuration trains the example GPT for ``--steps`` steps on 2 CPU ranks under
``orchestrator launch``, with a crash every ``--crash-every`` steps and a NaN every
``--nan-every`` steps (the same steps for every configuration), and is measured by the
goodput ledger (orchestrator/goodput.py) over its whole run.

    python benchmarks/bench_goodput.py                      # the table
    python benchmarks/bench_goodput.py --steps 120 --json   # smaller, a JSON line each
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.goodput import ledger  # noqa: E402
from orchestrator.journal import read_journal, read_metrics  # noqa: E402


def faults(steps: int, crash_every: int, nan_every: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for s in range(nan_every // 2, steps, nan_every):
        out.append({"kind": "nan_grad", "step": s, "rank": 1})
    for s in range(crash_every, steps, crash_every):
        out.append({"kind": "crash", "step": s - 3, "rank": 1})
    return out


def run_one(
    name: str, extra: dict[str, Any], args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    d = root / name
    policy = {
        "adjust": {"lr_factor": 1.0},
        "quarantine": {"isolate": False},
        "supervisor": {"backoff_s": 0.5, "backoff_max_s": 1.0, "max_restarts": 50,
                       "crash_loop_attempts": 50},
        "faults": faults(args.steps, args.crash_every, args.nan_every),
        **extra,
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(policy))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path), "--run-dir",
           str(d), "--", sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(REPO / "examples" / "train_gpt.py"), "--steps", str(args.steps),
           "--d-model", str(args.d_model), "--layers", str(args.layers)]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{name}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    events = list(read_journal(str(d)))
    led = ledger(events, read_metrics(str(d)))
    intervals = [e for e in events if e["kind"] == "interval"]
    return {
        "config": name,
        "goodput": round(led.goodput or 0.0, 4),
        "wall_s": round(led.wall_s, 2),
        "elapsed_s": round(time.monotonic() - t0, 2),
        "parts": {k: round(v, 2) for k, v in led.parts.items() if v > 0},
        "intervals": [(e["details"]["tier"], e["details"]["new"]) for e in intervals][-4:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--crash-every", type=int, default=100)
    ap.add_argument("--nan-every", type=int, default=100)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sweep", default="5,10,20,50", help="persist.every_steps to try")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configs: list[tuple[str, dict[str, Any]]] = [
        ("defaults", {}),
        ("auto", {
            "snapshot": {"every_steps": "auto"},
            "persist": {"every_steps": "auto"},
            # The priors say what a person would: about this many seconds between failures;
            # they weigh little against what the run sees.
            "tune": {"every_steps": 20, "prior_weight_s": 10.0},
        }),
    ]  # fmt: skip
    for n in (int(x) for x in args.sweep.split(",") if x.strip()):
        snap = min(n, 10)
        configs.append((f"fixed-{snap}-{n}", {
            "snapshot": {"every_steps": snap}, "persist": {"every_steps": n}}))  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in configs:
            row = run_one(name, extra, args, Path(tmp))
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    swept = [r for r in rows if r["config"].startswith("fixed-")]
    best = max(swept, key=lambda r: r["goodput"]) if swept else rows[0]
    top = best["goodput"] or 1.0  # a run with no productive time at all
    if not args.json:
        print(
            f"goodput under a crash every {args.crash_every} and a NaN every "
            f"{args.nan_every} steps, {args.steps} steps, 2 ranks (d={args.d_model}, "
            f"{args.layers} layers)\n"
        )
        print("| config | goodput | / best fixed | wall s | lost to (s) | intervals chosen |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            lost = ", ".join(f"{k} {v}" for k, v in r["parts"].items() if k != "productive")
            print(f"| {r['config']} | {r['goodput']:.1%} | {r['goodput'] / top:.2f}x "
                  f"| {r['wall_s']} | {lost} | {r['intervals'] or '-'} |")  # fmt: skip
        print(f"\nbest fixed interval of the sweep: {best['config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
