"""The measurements of the benchmark suite, one per case, each run in a fresh process under
torchrun (1 or 2 ranks) by ``python -m benchmarks run``. Model: the example GPT, fp32
weights + AdamW state. Every case reports rank 0's numbers as one JSON line.

    python benchmarks/cases.py snapshot --size 10M          # 1 and 2 ranks, printed
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import snapshot_tc
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import (
    SEQ,
    VOCAB,
    SyntheticTokens,
    barrier,
    build,
    copy_baseline,
    incident_to_next_commit,
    interleaved,
    loss_of,
    run_or_collect,
    timed,
)

from orchestrator import Guard, parse_policy
from orchestrator.comm import Comm
from orchestrator.engines import TorchEngine
from orchestrator.shm import ShmSlots
from orchestrator.snapshot import SnapshotRing

#: parameters -> (d_model, layers) of the example GPT (12 d^2 parameters per layer)
SIZES = {"10M": (256, 12), "100M": (768, 14), "500M": (1536, 17), "tiny": (32, 1)}


def _trained(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    d, layers = SIZES[args.size]
    model, opt = build(d, layers)
    loss_of(model, torch.randint(VOCAB, (2, SEQ + 1))).backward()
    opt.step()  # AdamW state exists now
    opt.zero_grad(set_to_none=True)
    return model, opt


def _shared_dir(comm: Comm) -> str:
    return str(comm.broadcast_object(tempfile.mkdtemp(prefix="bench-suite-")))


# --- snapshot: limits, stalls, restore, memory ------------------------------------------------
def snapshot(args: argparse.Namespace) -> dict[str, Any]:
    comm = Comm()
    model, opt = _trained(args)
    engine = TorchEngine(model, opt)
    params = sum(p.numel() for p in engine.core.parameters())
    state = {"model": engine.core.state_dict(), "optim": opt.state_dict()}
    reps = args.reps

    ring = SnapshotRing(keep=2)
    t0 = time.perf_counter()
    first = ring.capture(0, engine.state())  # allocates its slot: the first-call cost
    first_s = time.perf_counter() - t0
    assert first is not None
    first.sealed = True
    ring.capture(1, engine.state())
    snap = ring.snapshots()[-1]
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(engine.state()))
    nbytes = snap.nbytes
    # The floor: the same tensors copied plainly; and the same bytes as one flat copy.
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)  # first touch of the pages is not part of a copy
    src_np, dst_np = src.numpy(), dst.numpy()
    shm_ring, shm = _shm_ring(comm, engine, state_bytes)
    close_shm = shm.pop("close")
    try:  # a failed case must not leave its ring in /dev/shm
        t = interleaved(
            {
                "ours": lambda: ring.capture(2, engine.state()),
                "shm": shm_ring,
                "memcpy": copy_baseline(_tensors(engine.state())),
                "numpy": lambda: np.copyto(dst_np, src_np),
            },
            reps,
        )
        barrier()
    finally:
        close_shm()
    steady_s, memcpy_s, memcpy_np_s = t["ours"], t["memcpy"], t["numpy"]
    shm["shm_ms"] = t["shm"] * 1e3

    base = _shared_dir(comm)
    n = 0

    def fresh(tag: str) -> str:
        nonlocal n
        n += 1
        return os.path.join(base, f"{tag}-{n}")

    payload = os.urandom(min(nbytes, 1 << 30))

    def raw_write() -> None:
        path = fresh("raw")
        if comm.rank == 0:
            with open(path, "wb") as f:
                for _ in range(max(1, nbytes // len(payload))):
                    f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        barrier()

    disk_s = timed(raw_write, max(1, reps // 2))

    save_path = ""

    def torch_save() -> None:
        nonlocal save_path
        save_path = str(comm.broadcast_object(fresh("torchsave")))
        if comm.rank == 0:  # replicated state: one writer, the others wait (a DDP job)
            with open(save_path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        barrier()

    torch_save_s = timed(torch_save, reps)
    dcp_path = ""

    def dcp_save() -> None:
        nonlocal dcp_path
        dcp_path = str(comm.broadcast_object(fresh("dcp")))
        dcp.save(state, checkpoint_id=dcp_path)

    dcp_save_s = timed(dcp_save, reps)
    async_pg = dist.new_group(backend="gloo") if dist.is_initialized() else None
    stalls, totals = [], []
    for _ in range(reps):
        path = comm.broadcast_object(fresh("adcp"))
        barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=path, process_group=async_pg)
        stalls.append(time.perf_counter() - t0)
        fut.result()
        totals.append(time.perf_counter() - t0)

    # Restore: ours (the rollback's copy back), torch.load + load_state_dict, dcp.load.
    restore_s = timed(lambda: engine.restore(snap, 1.0), reps)

    def torch_load() -> None:
        loaded = torch.load(save_path, weights_only=True)
        engine.core.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optim"])

    torch_load_s = timed(torch_load, reps)
    dcp_load_s = timed(lambda: dcp.load(state, checkpoint_id=dcp_path), reps)
    tc = snapshot_tc.compare(engine, model, opt, base, reps)  # last: it trains the model
    barrier()
    if comm.rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    mib = nbytes / 2**20
    return {
        "params_m": params / 1e6,
        "state_mb": mib,
        "memcpy_ms": memcpy_s * 1e3,
        "memcpy_numpy_ms": memcpy_np_s * 1e3,
        "disk_write_gbps": nbytes / disk_s / 1e9,
        "ours_first_ms": first_s * 1e3,
        "ours_ms": steady_s * 1e3,
        "torch_save_ms": torch_save_s * 1e3,
        "dcp_save_ms": dcp_save_s * 1e3,
        "async_save_stall_ms": statistics.median(stalls) * 1e3,
        "async_save_total_ms": statistics.median(totals) * 1e3,
        "ours_restore_ms": restore_s * 1e3,
        "torch_load_ms": torch_load_s * 1e3,
        "dcp_load_ms": dcp_load_s * 1e3,
        "ring_slot_over_state": nbytes / state_bytes,
        **shm,
        **tc,
    }


def tc_only(args: argparse.Namespace) -> dict[str, Any]:
    """Only the snapshot case's torch_checkpointing comparison (benchmarks/snapshot_tc.py)."""
    comm = Comm()
    model, opt = _trained(args)
    base = _shared_dir(comm)
    try:
        engine = TorchEngine(model, opt)
        params = sum(p.numel() for p in engine.core.parameters())
        out = snapshot_tc.compare(engine, model, opt, base, args.reps)
        return {"params_m": params / 1e6, **out}
    finally:
        barrier()
        if comm.rank == 0:
            shutil.rmtree(base, ignore_errors=True)


def _shm_ring(comm: Comm, engine: TorchEngine, state_bytes: int) -> tuple[Any, dict[str, Any]]:
    """The ring in node shared memory (snapshot.shared_memory), every rank of this machine
    on one node: the replicated state is kept once, each rank copying its share. Returns a
    steady capture to time, and its numbers (``close`` removes it)."""
    # Rank 0's folder, made by rank 0 only (one per rank left the others' behind, empty).
    made = tempfile.mkdtemp(prefix="bench-suite-shm-", dir="/dev/shm") if comm.rank == 0 else None
    root = str(comm.broadcast_object(made))
    token = str(comm.broadcast_object(os.urandom(4).hex()))
    ranks = list(range(comm.world_size))
    slots = ShmSlots(root, comm.rank, comm.world_size, 2, attempt=0, node_ranks=ranks, token=token)
    ring = SnapshotRing(2, alloc=slots.alloc, on_drop=slots.drop)
    keys = list(engine.state())
    alike = frozenset(keys) - set(engine.part_keys(keys, holds_shared=False))
    barrier()
    try:  # a slot /dev/shm has no room for: nothing left there
        t0 = time.perf_counter()
        first = ring.capture(0, engine.state(), alike)
        first_s = time.perf_counter() - t0
        assert first is not None
        first.sealed = True
        ring.capture(1, engine.state(), alike)
    except BaseException:
        slots.close(remove=True)
        raise
    barrier()
    node_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
    return lambda: ring.capture(2, engine.state(), alike), {
        "shm_first_ms": first_s * 1e3,
        "shm_node_slot_over_state": node_bytes / ring.keep / state_bytes,
        "close": lambda: slots.close(remove=comm.rank == 0),
    }


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# --- detection cost per step ------------------------------------------------------------------
def detect(args: argparse.Namespace) -> dict[str, Any]:
    """Step time with no check, ours, per-module output hooks, anomaly mode: interleaved
    step by step (drift hits all alike), medians; and our check alone, many repetitions."""
    comm = Comm()
    model, opt = _trained(args)
    ds = SyntheticTokens(100_000, SEQ, VOCAB)
    run_dir = _shared_dir(comm)
    policy = parse_policy({"snapshot": {"every_steps": 10**9}, "persist": {"enabled": False}})
    guard = Guard(policy, model=model, optimizer=opt, run_dir=run_dir)
    guard.engine.release()  # the plain loop steps this optimizer too, on purpose (interleaved)
    loader = guard.dataloader(ds, batch_size=args.batch_size)
    batches = guard.batches(loader, max_steps=10**9)
    plain_it = iter(torch.utils.data.DataLoader(ds, batch_size=args.batch_size))

    def plain() -> None:
        loss_of(model, next(plain_it)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def ours() -> None:
        loss = loss_of(model, next(batches))
        guard.backward(loss)
        guard.step()

    handles: list[Any] = []

    def hooked() -> None:
        for m in model.modules():  # what a per-module NaN hunt does: a sync per module
            handles.append(m.register_forward_hook(_check_output))
        try:
            plain()
        finally:
            for h in handles:
                h.remove()
            handles.clear()

    def anomaly() -> None:
        with torch.autograd.set_detect_anomaly(True, check_nan=True):
            plain()

    modes = {"none": plain, "ours": ours, "hooks": hooked, "anomaly": anomaly}
    times: dict[str, list[float]] = {k: [] for k in modes}
    for fn in modes.values():  # warm-up
        fn()
    for _ in range(args.steps):
        for name, fn in modes.items():
            barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    guard.close()
    step = {k: statistics.median(v) for k, v in times.items()}
    from orchestrator.detect import pack_local

    loss = loss_of(model, next(plain_it))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    comm.all_reduce_sum_(pack_local(loss, grads, True)).tolist()
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        comm.all_reduce_sum_(pack_local(loss, grads, True)).tolist()
    check_s = (time.perf_counter() - t0) / reps
    barrier()
    if comm.rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    base = step["none"]
    return {
        "step_ms": base * 1e3,
        "ours_pct": 100 * (step["ours"] - base) / base,
        "hooks_pct": 100 * (step["hooks"] - base) / base,
        "anomaly_pct": 100 * (step["anomaly"] - base) / base,
        "check_ms": check_s * 1e3,
        "check_pct": 100 * check_s / base,
    }


def digest(args: argparse.Namespace) -> dict[str, Any]:
    """The replica digest against a training step, and the spike detector's own cost: the
    digest (parameters + AdamW state) and its comparison run at each snapshot step, so
    their cost per step is amortized over snapshot.every_steps (the default 10); the
    snapshot copy beside it for scale. A step is timed plainly (forward, backward, AdamW),
    medians of interleaved repetitions."""
    from orchestrator import replicas
    from orchestrator.detect import SpikeDetector, pack_local
    from orchestrator.policy_sections import SpikePolicy

    comm = Comm()
    model, opt = _trained(args)
    engine = TorchEngine(model, opt)
    engine.release()  # the plain step below steps the optimizer itself
    ds = SyntheticTokens(100_000, SEQ, VOCAB)
    it = iter(torch.utils.data.DataLoader(ds, batch_size=args.batch_size))
    ring = SnapshotRing(keep=2)
    first = ring.capture(0, engine.state())
    assert first is not None
    first.sealed = True

    def step() -> None:
        loss_of(model, next(it)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def digest_and_compare() -> None:
        d = replicas.digest(engine.digest_tensors()[0])
        assert d is not None
        replicas.agreed(*replicas.compare_async(comm, d))  # its host read: the step's sync

    loss_of(model, next(it)).backward()  # a step's gradients, for the check alone
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    opt.zero_grad(set_to_none=True)
    zero = torch.zeros(())

    def check() -> None:
        comm.all_reduce_sum_(pack_local(zero, grads, True)).tolist()

    t = interleaved(
        {
            "step": step,
            "digest": digest_and_compare,
            "check": check,
            "snapshot": lambda: ring.capture(1, engine.state()),
        },
        args.reps,
    )
    det = SpikeDetector(SpikePolicy())
    for i in range(200):  # a full window
        det.check({"loss": 3.0 - 0.001 * i, "grad_norm": 1.0})
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        det.check({"loss": 2.8 - 1e-5 * i, "grad_norm": 1.0})
    spike_s = (time.perf_counter() - t0) / n
    every = 10
    per_step = t["digest"] / every
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "step_ms": t["step"] * 1e3,
        "digest_ms": t["digest"] * 1e3,
        "snapshot_ms": t["snapshot"] * 1e3,
        "check_ms": t["check"] * 1e3,
        "every_steps": every,
        "digest_pct": 100 * per_step / t["step"],
        "check_and_digest_pct": 100 * (t["check"] + per_step) / t["step"],
        "spike_us": spike_s * 1e6,
        "latency_steps": every,
    }


def _check_output(module: torch.nn.Module, inputs: Any, output: Any) -> None:
    if isinstance(output, torch.Tensor) and not bool(torch.isfinite(output).all()):
        raise FloatingPointError(type(module).__name__)


# --- recovery: in-process vs a restart --------------------------------------------------------
RESTART = """
import sys, time, torch
t0 = time.perf_counter()
sys.path.insert(0, {bench!r})
from _common import build, loss_of, VOCAB, SEQ
d, layers, path, how = {d}, {layers}, {path!r}, {how!r}
model, opt = build(d, layers)
if how == "torch.save":
    state = torch.load(path, weights_only=True)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
else:
    from orchestrator.store import DurableStore
    store = DurableStore(path)
    tree = store.load_part(store.committed_steps()[0], 0)
    model.load_state_dict(tree["model"]); opt.load_state_dict(tree["optim"])
loss_of(model, torch.randint(VOCAB, (2, SEQ + 1))).backward(); opt.step()
print("RESTART_S", time.perf_counter() - t0)
"""


def recovery(args: argparse.Namespace) -> dict[str, Any]:
    """Incident -> next completed step: in-process rollback (Guard, 1 step replayed) vs a
    fresh process that reloads the newest durable snapshot (ours, or torch.save) and runs
    one step. Single process: a restart's cost is per process."""
    d, layers = SIZES[args.size]
    model, opt = build(d, layers)
    run_dir = tempfile.mkdtemp(prefix="bench-recovery-")
    policy = parse_policy(
        {
            "snapshot": {"every_steps": 2},
            "persist": {"every_steps": 2},
            "quarantine": {"enabled": False},
            "health": {"on_incident": False},
            "faults": [{"kind": "nan_grad", "step": 5, "rank": 0}],
        }
    )
    guard = Guard(policy, model=model, optimizer=opt, run_dir=run_dir)
    loader = guard.dataloader(SyntheticTokens(4096, SEQ, VOCAB), batch_size=2)
    in_process = incident_to_next_commit(
        guard, lambda batch: loss_of(model, batch), loader, max_steps=8
    )
    save_path = os.path.join(run_dir, "state.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, save_path)
    restarts = {}
    for how, path in (("ours", os.path.join(run_dir, "snapshots")), ("torch.save", save_path)):
        code = RESTART.format(
            bench=str(Path(__file__).resolve().parent), d=d, layers=layers, path=path, how=how
        )
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        restarts[how] = time.perf_counter() - t0
    shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "in_process_s": in_process,
        "restart_ours_s": restarts["ours"],
        "restart_torch_save_s": restarts["torch.save"],
    }


CASES = {"snapshot": snapshot, "detect": detect, "recovery": recovery, "digest": digest,
         "snapshot_tc": tc_only}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--size", default="10M", choices=sorted(SIZES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="detect: interleaved steps")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    def measure(a: argparse.Namespace) -> dict[str, Any]:
        return {"case": a.case, "size": a.size, "world_size": Comm().world_size, **CASES[a.case](a)}

    nprocs = (1,) if args.case == "recovery" else (1, 2)  # a restart's cost is per process
    results = run_or_collect(__file__, args, measure, nprocs=nprocs)
    for r in results or []:
        print(r)


if __name__ == "__main__":
    main()
