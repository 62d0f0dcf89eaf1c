"""Issue 33's side-by-side: a rank SIGKILLed at step 27 of the example GPT (2 ranks, DDP, gloo,
CPU), fault -> next completed step, under

* ``inplace``: ours, ``orchestrator launch --nproc-per-node 2`` (the node agent replaces the
  dead rank alone; the survivor stays and the replacement heals from memory);
* ``restart``: ours with ``supervisor.in_place: false``: every rank stopped and started again
  (what a torchrun job gets today), resuming from the newest snapshot;
* ``torchft``: torchft 0.2.0, a lighthouse and 2 replica groups of 1 rank, the dead replica
  restarted at once and healed from the live one (benchmarks/bench_inplace_worker.py);
* ``nvrx``: NVRx 0.4.1's in-process restart (``inprocess.Wrapper``), 2 active ranks and a
  warm spare that takes the dead rank's place, healed by a broadcast from the survivor.

torchft and NVRx need the ``bench`` extra (``pip install -e .[bench]``); ``--smoke`` runs ours
at a tiny size without them. Numbers are medians over ``--repeats`` rounds, the cases
interleaved in each round so drift on a shared machine hits all alike.

    python benchmarks/bench_inplace.py --sizes 10M,100M --repeats 3 --json out.json
    python benchmarks/bench_inplace.py --cases inplace --policy-extra spare.yaml  # e.g. a
        # supervisor.in_place_spares key, merged into the in-place case's policy
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "bench_inplace_worker.py"
EXAMPLE = REPO / "examples" / "train_gpt.py"
SIZES = {"tiny": (32, 1), "10M": (256, 12), "100M": (768, 14)}  # d_model, layers
FAULT_STEP = 27
POLICY: dict[str, Any] = {
    "adjust": {"lr_factor": 1.0},
    "quarantine": {"enabled": False},
    "snapshot": {"every_steps": 5, "keep": 3},
    "persist": {"every_steps": 10},
    "supervisor": {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5},
}
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


# ---------------------------------------------------------------------------- ours
def ours(a: argparse.Namespace, size: str, in_place: bool, work: Path) -> dict[str, Any]:
    d, layers = SIZES[size]
    policy = merge(POLICY, {"supervisor": {"in_place": in_place}})
    policy["faults"] = [{"kind": "crash", "step": a.fault_step, "rank": 1}]
    if in_place and a.policy_extra:
        policy = merge(policy, yaml.safe_load(Path(a.policy_extra).read_text()) or {})
    run_dir = work / "run"
    (work / "policy.yaml").write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(work / "policy.yaml"),
           "--run-dir", str(run_dir), "--nproc-per-node", "2", str(EXAMPLE),
           "--steps", str(a.steps), "--d-model", str(d), "--layers", str(layers)]  # fmt: skip
    out = subprocess.run(cmd, env=ENV, cwd=REPO, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"orchestrator launch exited {out.returncode}: {out.stdout[-2000:]}")
    events = [e for f in sorted((run_dir / "journal").glob("*.jsonl")) for e in read_jsonl(f)]
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("outcome") == "commit"]
    (fault,) = [e["time"] for e in events if e["kind"] == "fault"]
    steps = [(r["time"], r["step"]) for r in rows]
    res = after_fault(steps, steps, fault, a.fault_step)
    if in_place:
        (ev,) = [e for e in events if e["kind"] == "inplace_recovery"]
        rec = ev["details"]
        (rep,) = [e["details"] for e in events if e["kind"] == "rank_replaced"]
        res["journal_fault_to_first_step_s"] = rec["times"]["first_step"] - rec["times"]["fault"]
        res["replacement_start_to_step_s"] = rec["times"]["first_step"] - rep["decided"]
        res["resumed_step"] = ev["step"]
        # the agent's word, the survivors' detection, leaving, re-forming, the heal's end
        res["times_from_fault_s"] = {k: round(v - fault, 3) for k, v in rec["times"].items()}
    else:
        starts = [e["time"] for e in events if e["kind"] == "attempt_start" and e["attempt"] == 1]
        first = min(t for t, _ in steps if t > fault)
        res["replacement_start_to_step_s"] = first - starts[0] if starts else None
    return res


def after_fault(
    survivor: list[tuple[float, int]], full: list[tuple[float, int]], fault: float, at: int
) -> dict[str, Any]:
    """From committed steps (time, step) in time order: fault -> the survivor's first step
    after it (the first at or past the fault's step, or a step redone after a rollback) and
    -> the first such step at full strength; the survivor's stall (from its last step before
    that to full strength, the longest gap between two of its steps) and its usual step."""
    seen, cut = -1, len(survivor)
    for i, (_, k) in enumerate(survivor):
        if k >= at or k <= seen:
            cut = i
            break
        seen = k
    before, after = survivor[:cut], survivor[cut:]
    nxt = after[0][0]
    back = min(t for t, _ in full if t >= nxt)
    window = [before[-1][0], *[t for t, _ in after if t <= back]]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(before)][-10:]
    return {
        "fault_to_next_step_s": nxt - fault,
        "fault_to_full_step_s": back - fault,
        "survivor_stall_s": max(b - a for a, b in itertools.pairwise(window)),
        "step_s": statistics.median(gaps) if gaps else None,
    }


# ---------------------------------------------------------------------------- competitors
def worker_cmd(mode: str, a: argparse.Namespace, size: str) -> list[str]:
    d, layers = SIZES[size]
    steps = a.steps if mode != "torchft" else 10**6  # torchft's replicas agree on the end
    return [sys.executable, str(WORKER), mode, "--steps", str(steps), "--fault-step",
            str(a.fault_step), "--d-model", str(d), "--layers", str(layers)]  # fmt: skip


def supervise(procs: dict[int, subprocess.Popen[bytes]], restart: Any, deadline: float) -> None:
    """Wait for every process to end; a killed one is handed to ``restart`` once."""
    restarted: set[int] = set()
    while time.time() < deadline:
        codes = {k: p.poll() for k, p in procs.items()}
        for k, c in codes.items():
            if c not in (None, 0) and k not in restarted and restart is not None:
                restarted.add(k)
                procs[k] = restart(k)
                codes[k] = None
        if all(c is not None for c in codes.values()):
            bad = {k: c for k, c in codes.items() if c != 0}
            if bad:
                raise RuntimeError(f"processes failed: {bad}")
            return
        time.sleep(0.005)
    for p in procs.values():
        p.kill()
    raise RuntimeError("timed out: see the logs under the work directory")


def torchft(a: argparse.Namespace, size: str, work: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                                  quorum_tick_ms=100, heartbeat_timeout_ms=1000)  # fmt: skip
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
              for _ in range(3)]  # fmt: skip

    def start(gid: int, life: int = 0) -> subprocess.Popen[bytes]:
        env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(stores[gid].port), RANK="0",
                   WORLD_SIZE="1", REPLICA_GROUP_ID=str(gid), BENCH_OUT=str(work),
                   BENCH_CTL_PORT=str(stores[2].port),
                   TORCHFT_LIGHTHOUSE=lighthouse.address(), BENCH_LIFE=str(life))  # fmt: skip
        log = open(work / f"replica{gid}-life{life}.log", "w")
        return subprocess.Popen(worker_cmd("torchft", a, size), env=env, stdout=log, stderr=log)

    try:
        supervise({g: start(g) for g in (0, 1)}, lambda g: start(g, 1), time.time() + 900)
    finally:
        lighthouse.shutdown()
    return competitor(work, a.fault_step, "replica0", "replica1")


def nvrx(a: argparse.Namespace, size: str, work: Path) -> dict[str, Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = {}
    for r in range(3):
        env = dict(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK=str(r),
                   WORLD_SIZE="3", BENCH_PG_PORT=str(pg.port), BENCH_OUT=str(work))  # fmt: skip
        log = open(work / f"proc{r}.log", "w")
        procs[r] = subprocess.Popen(worker_cmd("nvrx", a, size), env=env, stdout=log, stderr=log)
    try:
        supervise(procs, None, time.time() + 900)
    except RuntimeError:
        codes = {r: p.returncode for r, p in procs.items()}
        if codes.get(1) != -9 or any(c != 0 for r, c in codes.items() if r != 1):
            raise
    return competitor(work, a.fault_step, "proc0", "proc1", spare="proc2")


def competitor(
    work: Path, fault_step: int, survivor: str, victim: str, spare: str = ""
) -> dict[str, Any]:
    logs = {p.name: read_jsonl(p) for p in work.glob("*.jsonl")}
    (fault,) = [e["t"] for k, v in logs.items() if k.startswith(victim) for e in v
                if e["event"] == "fault"]  # fmt: skip
    (surv,) = [v for k, v in logs.items() if k.startswith(survivor)]
    steps = [(e["t"], e["step"]) for e in surv if e["event"] == "step"]
    full = [(e["t"], e["step"]) for e in surv if e["event"] == "step" and e["world"] == 2]
    res = after_fault(steps, full, fault, fault_step)
    name = spare or victim
    (new,) = [v for k, v in logs.items() if k.startswith(name) and any(
        e["event"] == "step" and e["t"] > fault for e in v)]  # fmt: skip
    start = next(e["t"] for e in new if e["event"] == "start")
    first = min(e["t"] for e in new if e["event"] == "step" and e["t"] > fault)
    healed = [e["t"] for e in new if e["event"] == "healed" and e["t"] > fault]
    res["replacement_start_to_step_s"] = None if spare else first - start
    res["replacement_start_to_heal_s"] = healed[0] - start if healed and not spare else None
    res["replacement_heal_to_step_s"] = first - healed[0] if healed else None
    return res


# ---------------------------------------------------------------------------- the report
CASES = {
    "inplace": lambda a, s, w: ours(a, s, True, w),
    "restart": lambda a, s, w: ours(a, s, False, w),
    "torchft": torchft,
    "nvrx": nvrx,
}
METRICS = (
    "fault_to_next_step_s",
    "fault_to_full_step_s",
    "survivor_stall_s",
    "replacement_start_to_step_s",
    "replacement_start_to_heal_s",
    "replacement_heal_to_step_s",
    "journal_fault_to_first_step_s",
    "step_s",
)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def one(a: argparse.Namespace, case: str, size: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"bench-inplace-{case}-") as tmp:
        t0, load0 = time.time(), load()
        try:
            res = CASES[case](a, size, Path(tmp))
        except Exception as err:  # one failed run does not lose the others
            if a.keep_failed:
                os.system(f"cp -r {tmp} {tmp}-failed")
            res = {"failed": f"{type(err).__name__}: {str(err)[-600:]}"}
        res.update(case=case, size=size, load_before=load0, load_after=load(),
                   wall_s=round(time.time() - t0, 1))  # fmt: skip
        return res


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": sum("failed" not in r for r in runs)}
    for m in METRICS:
        vals = [r[m] for r in runs if r.get(m) is not None]
        if vals:
            out[m] = round(statistics.median(vals), 3)
            out[m + "_range"] = [round(min(vals), 3), round(max(vals), 3)]
    out["failed"] = [r["failed"] for r in runs if "failed" in r][:1]
    return out


def summarize(runs: list[dict[str, Any]], cases: list[str]) -> dict[str, Any]:
    sizes = list(dict.fromkeys(r["size"] for r in runs))
    return {s: {c: summary([r for r in runs if r["case"] == c and r["size"] == s])
                for c in cases} for s in sizes}  # fmt: skip


def table(summ: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = ["| params | case | fault -> next step | fault -> both ranks stepping "
             "| survivor's stall | replacement start -> step | step time | it / ours |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for size, cases in summ.items():
        ref = cases.get("inplace", {}).get("fault_to_full_step_s")
        for case, s in cases.items():
            if not s.get("n"):
                lines.append(f"| {size} | {case} | failed: {(s['failed'] or ['?'])[0][:120]} |")
                continue

            def f(k: str, s: dict[str, Any] = s) -> str:
                if s.get(k) is None:
                    return "n/a"
                lo, hi = s[k + "_range"]
                return f"{s[k]:.2f} s" + (f" ({lo:.1f}-{hi:.1f})" if s["n"] > 1 else "")

            full = s.get("fault_to_full_step_s")
            ratio = f"{full / ref:.2f}x" if ref and full and case != "inplace" else ""
            nxt, full_s = f("fault_to_next_step_s"), f("fault_to_full_step_s")
            cells = [nxt, full_s, f("survivor_stall_s"), f("replacement_start_to_step_s")]
            lines.append(f"| {size} | {case} | {' | '.join(cells)} | {f('step_s')} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--sizes", default="10M")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fault-step", type=int, default=FAULT_STEP, help="rank 1 dies here")
    p.add_argument("--steps", type=int, help="default: the fault's step + 5")
    p.add_argument("--policy-extra", help="YAML merged into the in-place case's policy")
    p.add_argument("--smoke", action="store_true", help="ours only, tiny, once: no extras")
    p.add_argument("--keep-failed", action="store_true", help="keep a failed run's files")
    p.add_argument("--json", help="write every run and the medians here")
    p.add_argument("--tabulate", nargs="+", help="print the table of these --json files' runs")
    a = p.parse_args()
    if a.tabulate:
        runs = [r for f in a.tabulate for r in json.loads(Path(f).read_text())["runs"]]
        print(table(summarize(runs, a.cases.split(","))))
        return
    if a.smoke:
        a.cases, a.sizes, a.repeats = "inplace,restart", "tiny", 1
    a.steps = a.steps or a.fault_step + 5
    cases, sizes = a.cases.split(","), a.sizes.split(",")
    runs: list[dict[str, Any]] = []
    for size in sizes:
        for _i in range(a.repeats):
            for case in cases:
                runs.append(one(a, case, size))
                print(json.dumps(runs[-1]), flush=True)
    summ = summarize(runs, cases)
    print(table(summ))
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "summary": summ}, indent=1))


if __name__ == "__main__":
    main()
