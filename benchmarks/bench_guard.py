"""Cost of the Guard on the example GPT, at 1 and 2 ranks (CPU/gloo here; NCCL on GPU).

Reports, in one run:
  * per-step cost of the check (pack + one all-reduce + one host read) as % of step time,
    measured two ways: isolated (the check alone, many reps) and end to end (Guard loop vs
    the same loop without the Guard, interleaved rounds, median);
  * snapshot stall (ring.capture of the full per-rank state) as a ratio to a flat memcpy of
    the same number of bytes into a preallocated host buffer;
  * step time with diagnosis on (forensics re-runs, health checks at start and on incidents)
    vs off: they only act on incidents, so a healthy step should not see them.

    python benchmarks/bench_guard.py            # 1 rank, then 2 ranks via torchrun
    python benchmarks/bench_guard.py --json     # one JSON line per world size
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from _common import (
    SEQ,
    VOCAB,
    SyntheticTokens,
    build,
    loss_of,
    run_or_collect,
)

from orchestrator import Guard, parse_policy
from orchestrator.comm import Comm
from orchestrator.detect import pack_local
from orchestrator.snapshot import SnapshotRing


def _plain_steps(model, opt, loader, n: int) -> float:  # type: ignore[no-untyped-def]
    it = iter(loader)
    t0 = time.perf_counter()
    for _ in range(n):
        loss = loss_of(model, next(it))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (time.perf_counter() - t0) / n


def _guard_steps(guard: Guard, model, loader, n: int) -> float:  # type: ignore[no-untyped-def]
    start = guard.global_step
    t0 = time.perf_counter()
    for batch in guard.batches(loader, max_steps=start + n):
        loss = loss_of(model, batch)
        guard.backward(loss)
        guard.step()
    return (time.perf_counter() - t0) / n


def measure(args: argparse.Namespace) -> dict[str, float]:
    comm = Comm()
    model, opt = build(args.d_model, args.layers)
    ds = SyntheticTokens(100_000, SEQ, VOCAB)
    plain_loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True)
    # No snapshots inside the timed guard loop: the check is measured alone here.
    base = {"snapshot": {"every_steps": 1_000_000}, "persist": {"enabled": False}}
    off = {**base, "health": {"on_incident": False}, "diagnose": {"rerun": False}}
    on = {**base, "health": {"preflight": True}, "diagnose": {"rerun": True}}
    # One run directory for all ranks, removed only once every rank is done with it.
    tmp = comm.broadcast_object(tempfile.mkdtemp(prefix="bench-guard-") if comm.rank == 0 else None)
    guard = Guard(parse_policy(off), model=model, optimizer=opt, run_dir=f"{tmp}/off")
    loader = guard.dataloader(ds, batch_size=args.batch_size)
    guard_on = Guard(parse_policy(on), model=model, optimizer=opt, run_dir=f"{tmp}/on")
    loader_on = guard_on.dataloader(ds, batch_size=args.batch_size)
    for g in (guard, guard_on):  # the plain loop and the other Guard step this optimizer too
        g.engine.release()  # (the Guard refuses steps it did not make; here they are meant)
    _plain_steps(model, opt, plain_loader, 3)  # warm up (lazy Adam state, allocator)
    _guard_steps(guard, model, loader, 3)
    _guard_steps(guard_on, model, loader_on, 3)
    plain, guarded, diagnosed = [], [], []
    for _ in range(args.rounds):  # interleaved, so drift hits all alike
        plain.append(_plain_steps(model, opt, plain_loader, args.steps))
        guarded.append(_guard_steps(guard, model, loader, args.steps))
        diagnosed.append(_guard_steps(guard_on, model, loader_on, args.steps))
    guard_on.close()
    guard.close()
    if dist.is_initialized():
        dist.barrier()
    if comm.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)

    # The check in isolation: exactly what Guard.step adds on a healthy step.
    loss = loss_of(model, next(iter(plain_loader)))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    reps = 200
    comm.all_reduce_sum_(pack_local(loss, grads, True)).tolist()
    t0 = time.perf_counter()
    for _ in range(reps):
        comm.all_reduce_sum_(pack_local(loss, grads, True)).tolist()
    check = (time.perf_counter() - t0) / reps
    opt.zero_grad(set_to_none=True)

    # Snapshot stall vs flat memcpy of the same bytes (both into reused host buffers).
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    ring = SnapshotRing(keep=2)
    ring.capture(0, state).sealed = True  # allocate both slots
    ring.capture(1, state)
    nbytes = ring.snapshots()[-1].nbytes
    src = torch.empty(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.copy_(src)
    snap_t, copy_t = [], []
    for i in range(args.snap_reps):
        t0 = time.perf_counter()
        ring.capture(2 + i, state)
        snap_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_t.append(time.perf_counter() - t0)

    step_plain, step_guard = statistics.median(plain), statistics.median(guarded)
    step_diag = statistics.median(diagnosed)
    return {
        "world_size": comm.world_size,
        "step_ms": step_plain * 1e3,
        "check_ms": check * 1e3,
        "check_pct_of_step": 100 * check / step_plain,
        "e2e_overhead_pct": 100 * (step_guard - step_plain) / step_plain,
        "diagnosis_on_vs_off_pct": 100 * (step_diag - step_guard) / step_guard,
        "snapshot_mb": nbytes / 2**20,
        "snapshot_ms": statistics.median(snap_t) * 1e3,
        "memcpy_ms": statistics.median(copy_t) * 1e3,
        "snapshot_vs_memcpy": statistics.median(snap_t) / statistics.median(copy_t),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--snap-reps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    results = run_or_collect(__file__, args, measure, always_dist=False)
    if results is None:
        return
    print(f"{'ranks':>5} {'step ms':>8} {'check ms':>9} {'check %':>8} {'e2e %':>7} "
          f"{'snap MB':>8} {'snap ms':>8} {'memcpy ms':>9} {'snap/memcpy':>11}")  # fmt: skip
    for r in results:
        print(
            f"{r['world_size']:>5} {r['step_ms']:>8.2f} {r['check_ms']:>9.3f} "
            f"{r['check_pct_of_step']:>7.2f}% {r['e2e_overhead_pct']:>6.2f}% "
            f"{r['snapshot_mb']:>8.1f} {r['snapshot_ms']:>8.2f} {r['memcpy_ms']:>9.2f} "
            f"{r['snapshot_vs_memcpy']:>10.2f}x"
        )
        print(f"{'':>5} diagnosis on vs off: {r['diagnosis_on_vs_off_pct']:+.2f}% of step time")
    print("targets: check <= 1% of step time; snapshot stall <= 1.5x flat memcpy; "
          "diagnosis on vs off: 0 (noise)")  # fmt: skip


if __name__ == "__main__":
    main()
