"""Durable snapshots: training-loop stall and write throughput, against the alternatives.

Per rank, on the example GPT's model + AdamW state, in one run, at 1 and 2 ranks:
  * stall of one persisted snapshot with the Guard's tiers (copy into the host ring, then
    hand it to the background writer) vs ``torch.save`` of the same state (rank 0 writes, as
    a DDP job would) vs ``dcp.save`` vs ``dcp.async_save`` (time until it returns);
  * durable write throughput of the background writer (DCP part + checksums + commit)
    vs raw disk write bandwidth (the same bytes, ``write`` + ``fsync``) in the same directory.

    python benchmarks/bench_persist.py                 # 1 rank, then 2 ranks under torchrun
    python benchmarks/bench_persist.py --dir /mnt/fast # where to write (default: a temp dir)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import (
    SEQ,
    VOCAB,
    barrier,
    build,
    copy_baseline,
    interleaved,
    loss_of,
    run_or_collect,
    timed,
)

from orchestrator.comm import Comm
from orchestrator.snapshot import SnapshotRing, flatten
from orchestrator.store import DurableStore


def measure(args: argparse.Namespace) -> dict[str, Any]:
    comm = Comm()
    model, opt = build(args.d_model, args.layers, fsdp=args.fsdp)
    batch = torch.randint(VOCAB, (4, SEQ + 1))
    loss_of(model, batch).backward()
    opt.step()  # AdamW state exists now
    opt.zero_grad(set_to_none=True)
    if args.fsdp:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from orchestrator.engines import FSDP2Engine

        ours_state = FSDP2Engine(model, opt).state()  # this rank's shards
        msd, osd = get_state_dict(model, opt)  # DTensors: what DCP saves, sharded
        state = {"model": msd, "optim": osd}
    else:
        core = getattr(model, "module", model)
        state = ours_state = {"model": core.state_dict(), "optim": opt.state_dict()}

    base = args.dir or tempfile.mkdtemp(prefix="bench-persist-")
    base = comm.broadcast_object(base)
    root = os.path.join(base, f"w{comm.world_size}")
    os.makedirs(root, exist_ok=True)
    n = 0

    def fresh(tag: str) -> str:
        nonlocal n
        n += 1
        return os.path.join(root, f"{tag}-{n}")

    # Ours, foreground: the copy into the ring; the write is handed to a thread.
    ring = SnapshotRing(keep=2)
    ring.capture(0, ours_state).sealed = True  # allocate both slots
    ring.capture(1, ours_state)
    # The same tensors the ring copies (this rank's shards, their dtypes), copied plainly.
    leaves: list[torch.Tensor] = []
    flatten(ours_state, leaves)
    t = interleaved(
        {"ours": lambda: ring.capture(2, ours_state), "memcpy": copy_baseline(leaves)}, args.reps
    )
    ours_stall, memcpy = t["ours"], t["memcpy"]
    snap = ring.snapshots()[-1]

    # Ours, background: one rank's part (rank 0 holds the replicated state) + commit.
    def ours_write() -> None:
        store = DurableStore(comm.broadcast_object(fresh("ours")))
        keys = list(snap.skeleton) if comm.rank == 0 or args.fsdp else []
        store.write_part(snap, comm.rank, comm.world_size, keys)
        if comm.rank == 0:
            store.commit(snap.step, comm.world_size, "", {}, timeout_s=60)

    ours_write_s = timed(ours_write, args.reps)
    nbytes = snap.nbytes

    def torch_save() -> None:
        path = comm.broadcast_object(fresh("torchsave"))
        if args.fsdp:  # torch.save of DTensor shards: each rank its own file
            path = f"{path}.rank{comm.rank}"
        if comm.rank == 0 or args.fsdp:  # replicated: one writer, the others wait
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        barrier()

    torch_save_s = timed(torch_save, args.reps)

    def dcp_save() -> None:
        dcp.save(state, checkpoint_id=comm.broadcast_object(fresh("dcp")))

    dcp_save_s = timed(dcp_save, args.reps)

    # async_save runs its collectives on a background thread: it needs a group of its own,
    # or it deadlocks against the main thread's collectives (what torchtitan does too).
    async_pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
    async_stalls = []
    for _ in range(args.reps):
        path = comm.broadcast_object(fresh("adcp"))
        barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path, process_group=async_pg)
        async_stalls.append(time.perf_counter() - t0)
        fut.result()  # one in flight at a time, as in a training loop
    dcp_async_stall = statistics.median(async_stalls)

    payload = os.urandom(nbytes)

    def raw_write() -> None:
        if comm.rank == 0:
            with open(fresh("raw"), "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        barrier()

    raw_s = timed(raw_write, args.reps)
    barrier()
    if comm.rank == 0 and not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    mb = nbytes / 2**20
    return {
        "world_size": comm.world_size,
        "fsdp": args.fsdp,
        "state_mb": mb,
        "ours_stall_ms": ours_stall * 1e3,
        "memcpy_ms": memcpy * 1e3,
        "ours_over_memcpy": ours_stall / memcpy,
        "torch_save_ms": torch_save_s * 1e3,
        "dcp_save_ms": dcp_save_s * 1e3,
        "dcp_async_stall_ms": dcp_async_stall * 1e3,
        "torch_save_over_ours": torch_save_s / ours_stall,
        "dcp_save_over_ours": dcp_save_s / ours_stall,
        "dcp_async_over_ours": dcp_async_stall / ours_stall,
        "ours_write_mb_s": mb / ours_write_s,
        "raw_write_mb_s": mb / raw_s,
        "write_vs_raw": raw_s / ours_write_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", help="directory to write into (default: a fresh temp dir)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    results = run_or_collect(__file__, args, measure, always_dist=args.fsdp)
    if results is None:
        return
    print(f"{'ranks':>5} {'MB/rank':>7} {'ours ms':>8} {'torch.save':>10} {'dcp.save':>9} "
          f"{'async_save':>10} {'write MB/s':>10} {'raw MB/s':>9} {'write/raw':>9}")  # fmt: skip
    for r in results:
        print(
            f"{r['world_size']:>5} {r['state_mb']:>7.1f} {r['ours_stall_ms']:>8.2f} "
            f"{r['torch_save_ms']:>7.1f} ms {r['dcp_save_ms']:>6.1f} ms "
            f"{r['dcp_async_stall_ms']:>7.1f} ms {r['ours_write_mb_s']:>10.0f} "
            f"{r['raw_write_mb_s']:>9.0f} {r['write_vs_raw']:>8.2f}x"
        )
        print(
            f"{'':>5} ours/memcpy {r['ours_over_memcpy']:.2f}x, "
            f"torch.save/ours {r['torch_save_over_ours']:.1f}x, "
            f"dcp.save/ours {r['dcp_save_over_ours']:.1f}x, "
            f"async_save/ours {r['dcp_async_over_ours']:.1f}x"
        )
    t1, t2 = results[0]["ours_stall_ms"], results[1]["ours_stall_ms"]
    print(f"scaling efficiency of our stall T1/(2*T2): {t1 / (2 * t2):.2f}")
    print("targets: ours/memcpy <= 1.5x, torch.save/ours >= 15x, async_save/ours >= 3x, "
          "write/raw >= 0.8x")  # fmt: skip


if __name__ == "__main__":
    main()
