"""A minimal rank side of the in-place protocol (orchestrator/inplace_protocol.py) in plain
torch.distributed, to test the node agent (orchestrator/agent.py) without the Guard: each
step all-reduces a vector into the state; a survivor that catches the collective's error
waits for the agent's word, re-forms on the next generation's group store and sends its
state to the replacement, which joins through its own env:// init, as a user's script does.

    orchestrator launch --nproc-per-node 2 tests/inplace_worker.py --out DIR [--die-at K...]
        [--die-again]

``--die-at K0 K1 ...``: in attempt 0, rank 1 of generation ``i`` SIGKILLs itself before
step ``Ki``'s collective.
``--hang-at K``: in attempt 0, rank 1 of generation 0 stops making progress at step K
(heartbeats as the Guard writes them, so the supervisor's hang watch names it).
``--slow-start S``: a replacement (generation > 0) sleeps S seconds before its init (a
host where the interpreter, imports and CUDA take that long).
``--die-again``: the replacement SIGKILLs itself after its init, before it joined (a second
death during healing: the agent falls back).
``--kill-spare``: rank 1 of generation 0 SIGKILLs the agent's warm spare (orchestrator/spare.py)
before it dies (the agent must start a fresh replacement). Writes DIR/rank<r>.json: pid at
start and end, generation, the final state; and DIR/start-rank<r>-gen<g>.json: what the
process saw at its start (to compare a spare's start with a fresh one's).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from orchestrator import inplace_protocol as IP
from orchestrator.heartbeat import REJOIN, Heartbeat

STEPS = 30


def control() -> dist.TCPStore:
    return dist.TCPStore(
        os.environ[IP.ENV_CONTROL_ADDR], int(os.environ[IP.ENV_CONTROL_PORT]), is_master=False
    )


def reform(ctl: dist.TCPStore, gen: int, rank: int, world: int) -> int:
    """Survivor: wait for the agent's word on ``gen``, join ``gen + 1``; its number."""
    ctl.wait([IP.next_key(gen)], timedelta(seconds=IP.NEXT_WAIT_S))
    word = IP.NextGeneration.decode(ctl.get(IP.next_key(gen)))
    if word.fallback is not None:
        print(f"rank {rank}: fallback: {word.fallback}", file=sys.stderr)
        sys.exit(1)
    dist.destroy_process_group()
    client = dist.TCPStore(os.environ["MASTER_ADDR"], word.port, is_master=False)
    store = dist.PrefixStore(IP.PG_PREFIX, client)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    return word.gen


def heal(ctl: dist.TCPStore, gen: int, state: torch.Tensor, step: torch.Tensor) -> None:
    """Everyone of ``gen``: the survivors' state to the replacement, then joined."""
    dist.broadcast(state, 0)
    dist.broadcast(step, 0)
    ctl.add(IP.joined_key(gen), 1)


def record_start(out: Path, rank: int, gen: int) -> None:
    main = sys.modules["__main__"]
    (out / f"start-rank{rank}-gen{gen}.json").write_text(
        json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv,
                    "path0": sys.path[0], "cwd": os.getcwd(), "env": dict(os.environ),
                    "faulthandler": faulthandler.is_enabled(), "main": main.__file__,
                    "name": __name__, "sigint": str(signal.getsignal(signal.SIGINT)),
                    "sigterm": str(signal.getsignal(signal.SIGTERM)), "spares": len(spares())})
    )  # fmt: skip


def _stat(pid: str) -> list[str]:
    """/proc/<pid>/stat's fields after the command's name (state, ppid, ...); [] if gone."""
    try:
        return (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def spares() -> list[int]:
    """The agent's warm spares: this process's siblings that run orchestrator.spare."""
    found = []
    for d in Path("/proc").iterdir():
        fields = _stat(d.name) if d.name.isdigit() else []
        if not fields or int(fields[1]) != os.getppid():
            continue
        try:
            if b"orchestrator.spare" in (d / "cmdline").read_bytes():
                found.append(int(d.name))
        except OSError:
            continue
    return found


def kill_spare() -> None:
    """SIGKILL the agent's waiting spare and wait until it is dead (not yet reaped)."""
    deadline = time.monotonic() + 60
    while not (found := spares()):
        if time.monotonic() > deadline:
            raise SystemExit("inplace_worker: no spare to kill")
        time.sleep(0.05)
    os.kill(found[0], signal.SIGKILL)
    while (state := _stat(str(found[0]))) and state[0] != "Z":
        time.sleep(0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--die-at", type=int, nargs="*", default=[])
    p.add_argument("--hang-at", type=int, default=-1)
    p.add_argument("--die-again", action="store_true")
    p.add_argument("--slow-start", type=float, default=0.0)
    p.add_argument("--kill-spare", action="store_true")
    a = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gen = int(os.environ[IP.ENV_GENERATION])
    first = os.environ.get("ORCHESTRATOR_ATTEMPT", "0") == "0"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start_pid = os.getpid()
    record_start(out, rank, gen)
    ctl = control()
    if gen > 0:
        time.sleep(a.slow_start)  # the simulated slow start itself, not a wait for anything
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    state = torch.zeros(8, dtype=torch.float64)
    step = torch.zeros(1, dtype=torch.int64)
    if gen > 0:  # a replacement: heal from the survivors
        if a.die_again and first:
            os.kill(os.getpid(), signal.SIGKILL)
        heal(ctl, gen, state, step)
    beat = Heartbeat(os.environ["ORCHESTRATOR_RUN_DIR"], rank, int(os.environ.get(
        "ORCHESTRATOR_ATTEMPT", "0")), 0.2)  # fmt: skip
    while int(step) < STEPS:
        k = int(step)
        beat.beat(k)
        if rank == 1 and first and gen < len(a.die_at) and k == a.die_at[gen]:
            if a.kill_spare and gen == 0:
                kill_spare()
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1 and first and gen == 0 and k == a.hang_at:
            time.sleep(600)  # hung: the supervisor kills it
        beat.enter("check")
        x = torch.arange(8, dtype=torch.float64) * (rank + 1) + k
        try:
            dist.all_reduce(x)
        except RuntimeError:  # a peer died: the agent replaces it
            beat.enter(REJOIN)  # as the Guard's survivor says it (orchestrator/rejoin.py)
            gen = reform(ctl, gen, rank, world)
            heal(ctl, gen, state, step)
            continue  # the step is redone by every rank of the new generation
        state.mul_(0.5).add_(x.sin())
        step += 1
    beat.beat(int(step), "done", force=True)
    beat.close()
    (out / f"rank{rank}.json").write_text(
        json.dumps({"pid_start": start_pid, "pid_end": os.getpid(), "gen": gen,
                    "inplace": os.environ.get(IP.ENV_INPLACE),
                    "state": state.tolist(), "hex": state.numpy().tobytes().hex()})
    )  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
