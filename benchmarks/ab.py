"""Before and after in one run: the suite's check-cost and snapshot-stall cases from two
revisions of this repository, interleaved round by round (drift on a shared machine hits
both alike), reported as medians and ratios.

    python benchmarks/ab.py --base e60876e               # HEAD's working tree vs. e60876e
    python benchmarks/ab.py --base main~3 --rounds 5 --md ab.md

The base revision is exported with ``git archive`` into a temporary folder; each case runs
under torchrun from its own tree (``PYTHONPATH`` pointing there), 1 and 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT = "RESULT "
#: (case, arguments, the result fields compared; lower is better for each)
CASES: list[tuple[str, list[str], list[str]]] = [
    ("detect", ["--size", "10M", "--steps", "20"], ["ours_pct", "check_ms"]),
    ("snapshot", ["--size", "10M", "--reps", "3"], ["ours_ms"]),
]


def export(rev: str, into: str) -> str:
    """The tree of ``rev`` under ``into`` (tracked files only)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def run_case(tree: str, nproc: int, case: str, args: list[str]) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           os.path.join(tree, "benchmarks", "cases.py"), case, "--worker", *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{case} x{nproc} in {tree} failed:\n{out.stderr[-3000:]}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(RESULT))
    result: dict[str, Any] = json.loads(line[len(RESULT) :])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the revision to compare against")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--md", help="also write the table here")
    args = ap.parse_args()
    seen: dict[tuple[str, int, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        trees = {"base": export(args.base, tmp), "head": str(ROOT)}
        for r in range(args.rounds):
            for case, case_args, fields in CASES:
                for nproc in (1, 2):
                    order = ("base", "head") if r % 2 == 0 else ("head", "base")
                    for name in order:
                        result = run_case(trees[name], nproc, case, case_args)
                        for f in fields:
                            seen.setdefault((case, nproc, f, name), []).append(float(result[f]))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    lines = [
        f"Medians of {args.rounds} interleaved rounds; base {args.base}, head the working tree.",
        "",
        "| case | ranks | value | base | head | head / base |",
        "|---|---|---|---|---|---|",
    ]
    for case, _, fields in CASES:
        for nproc in (1, 2):
            for f in fields:
                b = statistics.median(seen[(case, nproc, f, "base")])
                h = statistics.median(seen[(case, nproc, f, "head")])
                ratio = f"{h / b:.2f}x" if b > 0 else "n/a"
                lines.append(f"| {case} | {nproc} | {f} | {b:.3f} | {h:.3f} | {ratio} |")
    table = "\n".join(lines)
    print(table)
    if args.md:
        Path(args.md).write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
