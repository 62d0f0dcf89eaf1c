"""The ranks of benchmarks/proto_inplace.py (issue 33's prototype): one process per rank,
started by that script's parent with torchrun's environment (or parked as a warm spare).

Each rank trains the MLP with its gradients all-reduced on gloo; after a collective fails it
waits for the parent's next generation, re-forms the process group under a new store prefix
and heals: from a live peer (``inplace``: the newest state is broadcast with its CRC32), or
from its own shared-memory slot (``inplace-shm``: every rank writes its state and CRC32 to a
/dev/shm file at each snapshot step; the replacement reads its rank's file, the survivors
roll back to their in-memory copy of the same step, and all compare the CRC32s before going
on), or, after a full restart (``restart``), from rank 0's snapshot file. ``inplace-double``:
the replacement dies again during the healing; the parent falls back to a full restart.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

WORLD = 2
VICTIM = 1
SNAPSHOT = "/dev/shm/proto_inplace_{port}.pt"
SLOT = "/dev/shm/proto_inplace_{port}_rank{rank}.pt"


def now() -> float:
    return time.time()


# ---------------------------------------------------------------------------- the worker


class State:
    """The model's parameters and momentum as views into two flat buffers: one buffer to
    all-reduce, broadcast and checksum."""

    def __init__(self, width: int, depth: int) -> None:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
        self.model = torch.nn.Sequential(*layers)
        params = list(self.model.parameters())
        self.flat = torch.cat([p.detach().reshape(-1) for p in params] * 2)
        self.n = self.flat.numel() // 2
        offset = 0
        for p in params:
            p.data = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.flat[self.n :].zero_()  # the momentum half
        self.width, self.step, self.have = width, 0, True
        self.ring: tuple[int, torch.Tensor, int] | None = None  # (step, copy, CRC32)

    def crc(self) -> int:
        return zlib.crc32(self.flat.numpy().tobytes())

    def train_step(self, rank: int) -> torch.Tensor:
        """Forward and backward on this rank's deterministic batch; returns the flat grads."""
        gen = torch.Generator().manual_seed(self.step * WORLD + rank)
        x = torch.randn(32, self.width, generator=gen)
        y = torch.randn(32, self.width, generator=gen)
        self.model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(self.model(x), y).backward()
        return torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])  # type: ignore[union-attr]

    def apply(self, grads: torch.Tensor) -> None:
        momentum = self.flat[self.n :]
        momentum.mul_(0.9).add_(grads, alpha=1.0 / WORLD)
        self.flat[: self.n].add_(momentum, alpha=-0.01)
        self.step += 1


@dataclass
class Args:
    mode: str
    fault: str
    steps: int
    fault_step: int
    snapshot_every: int
    pg_timeout_s: float
    width: int
    depth: int


def identity(store: dist.TCPStore) -> tuple[int, int]:
    """(rank, generation): from torchrun's env, or, for a warm spare, from the parent's
    assignment in the store (the spare blocks there until a rank dies)."""
    spare = os.environ.get("PROTO_SPARE")
    if spare is None:
        return int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    key = f"spare/{spare}"
    store.wait([key], timedelta(seconds=600))
    rank, gen = store.get(key).decode().split()
    return int(rank), int(gen)


def heal(store: dist.TCPStore, state: State, rank: int, gen: int) -> None:
    """The ranks agree on who holds the newest state; it is broadcast, with its step and CRC,
    to any rank behind; every receiver checks the CRC and all agree before training goes on."""
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(steps, torch.tensor([state.step if state.have else -1]))
    best = max(int(s) for s in steps)
    if all(int(s) == best for s in steps):
        return
    src = next(r for r in range(WORLD) if int(steps[r]) == best)
    header = torch.tensor([best, state.crc() if rank == src else 0], dtype=torch.int64)
    dist.broadcast(header, src)
    dist.broadcast(state.flat, src)
    ok = True
    if rank != src:
        ok = state.crc() == int(header[1])
        state.step, state.have = best, ok
    agreed = torch.tensor([int(ok)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if not int(agreed):
        raise SystemExit(f"rank {rank}: the state healed from rank {src} fails its CRC32")
    store.set(f"healed/{gen}/{rank}", f"{now()} {src} {best}")


def train(store: dist.TCPStore, state: State, rank: int, gen: int, args: Args) -> None:
    first = True
    while state.step < args.steps:
        grads = state.train_step(rank)
        if gen == 0 and rank == VICTIM and state.step == args.fault_step:
            store.set("t_fault", str(now()))
            os.kill(os.getpid(), signal.SIGKILL if args.fault == "kill" else signal.SIGSTOP)
        store.set(f"hb/{gen}/{rank}", f"{state.step} {now()}")  # entered the step's collective
        dist.all_reduce(grads)
        state.apply(grads)
        if first:
            store.set(f"step1/{gen}/{rank}", str(now()))
            first = False
        if state.step == args.fault_step + 1:  # the faulted step done (again)
            store.set(f"past_fault/{gen}/{rank}", str(now()))
        if state.step % args.snapshot_every == 0:
            snapshot(state, rank, args.mode)


def snapshot(state: State, rank: int, mode: str) -> None:
    """``restart``: rank 0's file; ``inplace-shm``: every rank's slot file (its own state and
    CRC32, as the shared-memory ring's slot and verdict) and an in-memory copy (the ring)."""
    port = os.environ["MASTER_PORT"]
    if mode in ("restart", "inplace-double") and rank == 0:  # the full restart's source
        path = SNAPSHOT.format(port=port)
        torch.save({"step": state.step, "flat": state.flat}, path + ".tmp")
        os.replace(path + ".tmp", path)
    elif mode == "inplace-shm":
        crc = state.crc()
        state.ring = (state.step, state.flat.clone(), crc)
        path = SLOT.format(port=port, rank=rank)
        torch.save({"step": state.step, "flat": state.flat, "crc": crc}, path + ".tmp")
        os.replace(path + ".tmp", path)


def heal_from_slot(store: dist.TCPStore, state: State, rank: int, gen: int) -> None:
    """The replacement reads its rank's slot and checks its CRC32; the survivors roll back to
    their in-memory copy; every rank must stand at the same step with the same CRC32 (the
    state is replicated), else the in-place path fails (the parent would restart all)."""
    if state.have:
        if state.ring is None:
            raise SystemExit(f"rank {rank}: no snapshot in memory to roll back to")
        anchor, flat, crc = state.ring
        state.flat.copy_(flat)
    else:
        slot = torch.load(SLOT.format(port=os.environ["MASTER_PORT"], rank=rank))
        state.flat.copy_(slot["flat"])
        anchor, crc = int(slot["step"]), state.crc()
        if crc != slot["crc"]:
            anchor = -1  # torn or stale: this source is refused
    said = [torch.zeros(2, dtype=torch.int64) for _ in range(WORLD)]
    dist.all_gather(said, torch.tensor([anchor, crc], dtype=torch.int64))
    if anchor < 0 or any(not torch.equal(t, said[0]) for t in said):
        raise SystemExit(
            f"rank {rank}: the ranks' snapshots disagree: {[t.tolist() for t in said]}"
        )
    state.step, state.have = anchor, True
    store.set(f"healed/{gen}/{rank}", f"{time.time()} shm {anchor}")


def worker(args: Args) -> None:
    torch.set_num_threads(1)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=60))
    state = State(args.width, args.depth)
    rank, gen = identity(store)
    store.set(f"ready/{gen}/{rank}", f"{now()} {os.getpid()}")
    if gen > 0 and args.mode == "restart":
        saved = torch.load(SNAPSHOT.format(port=port))
        state.flat.copy_(saved["flat"])
        state.step = saved["step"]
    state.have = gen == 0 or args.mode == "restart"
    timeout = timedelta(seconds=args.pg_timeout_s)
    while True:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"pg/{gen}", store),
            rank=rank,
            world_size=WORLD,
            timeout=timeout,
        )
        store.set(f"formed/{gen}/{rank}", f"{now()} {os.getpid()}")
        if args.mode == "inplace-double" and gen == 1 and rank == VICTIM:
            os.kill(os.getpid(), signal.SIGKILL)  # a second death, during the healing
        try:
            if gen > 0 and args.mode == "inplace-shm":
                heal_from_slot(store, state, rank, gen)
            else:
                heal(store, state, rank, gen)
            train(store, state, rank, gen, args)
            break
        except RuntimeError as err:  # gloo's errors (DistBackendError) are RuntimeErrors
            store.set(f"raised/{gen}/{rank}", f"{now()} {type(err).__name__}: {str(err)[:300]}")
            gen += 1
            store.wait([f"gen/{gen}"], timedelta(seconds=120))
            dist.destroy_process_group()
    dist.barrier()
    store.set(f"final/{rank}", f"{state.crc()} {os.getpid()}")
    dist.destroy_process_group()
