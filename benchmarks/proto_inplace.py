"""Prototype for issue 33 (a dead rank costs one process, not the job), standalone: it imports
nothing from the package and the package never imports it.

The ranks are benchmarks/proto_inplace_worker.py's. A parent plays the node's launcher: it
hosts the job's TCPStore (torchrun's agent store, ``TORCHELASTIC_USE_AGENT_STORE=True``),
starts the ranks itself with torchrun's environment contract, and watches them. The ranks
train a ~10M-parameter MLP with DDP-style gradient all-reduce on gloo (one flat buffer per
step) and SGD with momentum. Rank 1 is SIGKILLed (``--fault kill``) or
SIGSTOPped (``--fault hang``) before its all-reduce at ``--fault-step``.

* ``inplace``: the survivor's all-reduce raises, it waits for the parent's next generation
  in the store, destroys its process group and forms a new one under a new store prefix with
  the replacement rank (a fresh process, or in the ``-spare`` cases a warm spare that had
  already imported torch and built the model), which heals from the survivor: the step and
  a CRC32 are broadcast, then the state; the replacement checks the CRC, all ranks agree
  (MIN).
* ``inplace-shm``: the same, but the replacement heals from its rank's slot in /dev/shm and
  the survivors roll back to their in-memory copy of that step (every rank keeps both at
  each snapshot step); step and CRC32 compared across ranks; the lost steps are replayed.
* ``restart``: today's behaviour: the parent kills every rank and starts them all again from
  the newest snapshot file (rank 0 writes one to /dev/shm every ``--snapshot-every`` steps).
* A hang: the parent kills the rank whose last "entered collective" step is behind once no
  rank entered one for ``--hang-timeout-s``; with that off, the survivor's gloo timeout
  (``--pg-timeout-s``) raises and the parent kills the rank that never entered.

    python benchmarks/proto_inplace.py                    # every case, 5 repeats each
    python benchmarks/proto_inplace.py --cases inplace-kill,restart-kill --repeats 3

Reported per case (medians): fault -> the survivor's exception, -> the group re-formed,
-> healed, -> the next completed step; the replacement's start -> ready; whether rank 0 kept
its process id, and whether the final state is bit for bit that of a run without a fault.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch.distributed as dist
from proto_inplace_worker import SNAPSHOT, VICTIM, WORLD, Args, now, worker

CASES = {  # name: (mode, fault, spare, parent's hang timeout in s; 0 = off)
    "inplace-kill": ("inplace", "kill", False, 0.0),
    "inplace-kill-spare": ("inplace", "kill", True, 0.0),
    "inplace-shm-spare": ("inplace-shm", "kill", True, 0.0),
    "inplace-double-spare": ("inplace-double", "kill", True, 0.0),
    "restart-kill": ("restart", "kill", False, 0.0),
    "inplace-hang-parent": ("inplace", "hang", True, 1.0),
    "inplace-hang-gloo": ("inplace", "hang", True, 0.0),
}


# ---------------------------------------------------------------------------- the parent


class Parent:
    """One run: the store, the ranks (and a warm spare), the restarts."""

    def __init__(self, args: argparse.Namespace, case: str) -> None:
        self.mode, self.fault, self.spare, self.hang_timeout_s = CASES[case]
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.port = self.store.port
        self.argv = [
            sys.executable,
            __file__,
            "--worker",
            "--mode",
            self.mode,
            "--fault",
            self.fault,
        ]
        for key in ("steps", "fault_step", "snapshot_every", "pg_timeout_s", "width", "depth"):
            self.argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        self.gen, self.events = 0, dict[str, float]()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.spares: list[tuple[str, subprocess.Popen[bytes]]] = []

    def env(self, rank: int | None) -> dict[str, str]:
        """torchrun's contract for one node (local == global, one role)."""
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port))
        env.update(
            WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD), GROUP_RANK="0", GROUP_WORLD_SIZE="1"
        )
        env.update(
            ROLE_NAME="default", ROLE_WORLD_SIZE=str(WORLD), TORCHELASTIC_USE_AGENT_STORE="True"
        )
        env.update(TORCHELASTIC_RUN_ID=f"proto{self.port}", TORCHELASTIC_MAX_RESTARTS="3")
        env.update(TORCHELASTIC_RESTART_COUNT=str(self.gen), OMP_NUM_THREADS="1")
        if rank is not None:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        return env

    def start(self, rank: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.argv, env=self.env(rank))

    def start_spare(self) -> None:
        sid = str(len(self.events) + len(self.spares))
        proc = subprocess.Popen(self.argv, env=dict(self.env(None), PROTO_SPARE=sid))
        self.spares.append((sid, proc))

    def replace(self, rank: int) -> None:
        """The dead rank's process is started again (or a spare takes its place); the
        survivors learn the new generation from the store."""
        self.events[f"t_detect/{self.gen}"] = now()
        healed = [f"healed/{self.gen}/{r}" for r in range(WORLD)]
        if self.gen > 0 and self.mode != "restart" and not self.store.check(healed):
            # A death during the healing: fall back to a full restart from the snapshot file.
            self.events["t_fallback"] = now()
            self.mode = self.argv[self.argv.index("--mode") + 1] = "restart"
        self.gen += 1
        if self.mode == "restart":
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            self.procs = {r: self.start(r) for r in range(WORLD)}
            return
        if self.spares:
            sid, proc = self.spares.pop(0)
            self.store.set(f"spare/{sid}", f"{rank} {self.gen}")
            self.procs[rank] = proc
        else:
            self.procs[rank] = self.start(rank)
        self.events[f"t_spawn/{self.gen}"] = now()
        self.store.set(f"gen/{self.gen}", "1")

    def hung_rank(self) -> int | None:
        """The rank that did not enter the collective the others are waiting in: once no rank
        entered one for the hang timeout, or once a survivor's collective timed out."""
        beats = {}
        for r in self.procs:
            if self.store.check([f"hb/{self.gen}/{r}"]):
                step, t = self.store.get(f"hb/{self.gen}/{r}").decode().split()
                beats[r] = (int(step), float(t))
        if len(beats) < WORLD:
            return None
        newest = max(t for _, t in beats.values())
        raised = self.store.check([f"raised/{self.gen}/{r}" for r in range(WORLD) if r != VICTIM])
        stale = self.hang_timeout_s > 0 and now() - newest > self.hang_timeout_s
        steps = sorted(beats, key=lambda r: beats[r][0])
        if (stale or raised) and beats[steps[0]][0] < beats[steps[-1]][0]:
            return steps[0]
        return None

    def run(self) -> dict[str, Any]:
        self.procs = {r: self.start(r) for r in range(WORLD)}
        if self.spare:
            self.start_spare()
        deadline = now() + 300
        while now() < deadline:
            codes = {r: p.poll() for r, p in self.procs.items()}
            if all(c == 0 for c in codes.values()):
                break
            dead = [r for r, c in codes.items() if c not in (None, 0)]
            hung = None if dead else self.hung_rank()
            if hung is not None:
                self.events[f"t_hang_kill/{self.gen}"] = now()
                self.procs[hung].kill()
                self.procs[hung].wait()
                dead = [hung]
            for r in dead:
                self.replace(r)
            time.sleep(0.005)
        for _, proc in self.spares:
            proc.kill()
            proc.wait()
        return self.collect()

    def get(self, key: str) -> list[str]:
        return self.store.get(key).decode().split(" ", 2) if self.store.check([key]) else []

    def collect(self) -> dict[str, Any]:
        out: dict[str, Any] = {"final": [self.get(f"final/{r}") for r in range(WORLD)]}
        fault = float(self.get("t_fault")[0]) if self.get("t_fault") else None
        out["pid_kept"] = len({self.get("ready/0/0")[1], out["final"][0][1]}) == 1
        if fault is None:
            return out
        raised = self.get("raised/0/0")
        out["error"] = " ".join(raised[1:])
        g = self.gen  # the generation that finished the run
        marks = {
            "raise_s": raised[:1],
            "detect_s": [str(self.events.get("t_detect/0", "nan"))],
            "new_ready_s": self.get(f"ready/{g}/{VICTIM}")[:1],
            "formed_s": self.get(f"formed/{g}/0")[:1],
            "healed_s": self.get(f"healed/{g}/0")[:1],
            "next_step_s": self.get(f"step1/{g}/0")[:1],
            "caught_up_s": self.get(f"past_fault/{g}/0")[:1],
        }
        out["generations"] = g
        out["fell_back"] = "t_fallback" in self.events
        for name, val in marks.items():
            out[name] = float(val[0]) - fault if val else None
        if "t_spawn/1" in self.events:
            ready = self.get(f"ready/1/{VICTIM}")
            out["spawn_to_ready_s"] = float(ready[0]) - self.events["t_spawn/1"] if ready else None
        return out


# ---------------------------------------------------------------------------- the report

METRICS = (
    "raise_s",
    "detect_s",
    "formed_s",
    "healed_s",
    "next_step_s",
    "caught_up_s",
    "spawn_to_ready_s",
)


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(vals), 3) if vals else None


def one_run(args: argparse.Namespace, case: str, fault_step: int) -> dict[str, Any]:
    saved = args.fault_step
    args.fault_step = fault_step
    try:
        parent = Parent(args, case)
        out = parent.run()
        for path in glob.glob(SNAPSHOT.format(port=parent.port).replace(".pt", "*.pt")):
            os.unlink(path)
        return out
    finally:
        args.fault_step = saved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", action="store_true", help="(internal) run as a rank")
    parser.add_argument("--mode", default="inplace")
    parser.add_argument("--fault", default="kill")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--fault-step", type=int, default=12)
    parser.add_argument("--snapshot-every", type=int, default=5)
    parser.add_argument("--pg-timeout-s", type=float, default=5.0)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--json", default="", help="also write the results here")
    args = parser.parse_args()
    if args.worker:
        worker(Args(**{k: getattr(args, k) for k in Args.__dataclass_fields__}))
        return
    params = args.depth * (args.width * args.width + args.width)
    reference = one_run(args, "inplace-kill", -1)
    ref_crc = reference["final"][0][0]
    print(f"{params / 1e6:.1f}M parameters; reference final CRC32 {ref_crc}", flush=True)
    report: dict[str, Any] = {"params": params, "reference_crc": ref_crc, "cases": {}}
    for case in args.cases.split(","):
        runs = [one_run(args, case, args.fault_step) for _ in range(args.repeats)]
        summary: dict[str, Any] = {m: median(runs, m) for m in METRICS}
        summary["bitwise_equal"] = all(
            r["final"][0][0] == r["final"][1][0] == ref_crc for r in runs
        )
        summary["rank0_pid_kept"] = all(r["pid_kept"] for r in runs)
        summary["error"] = runs[0].get("error")
        summary["runs"] = runs
        report["cases"][case] = summary
        shown = {k: v for k, v in summary.items() if k != "runs"}
        print(case, json.dumps(shown), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
