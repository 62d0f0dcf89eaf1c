"""DeepSpeed: snapshot stall and rollback time, against DeepSpeed's own checkpointing.

On the example GPT under DeepSpeed (ZeRO-2 by default, bf16, AdamW), in one run, at 1 and
2 ranks:
  * stall of one in-memory snapshot (what the Guard does at a snapshot step: the engine's
    state into the host ring, steady state) vs ``engine.save_checkpoint`` of the same
    engine (time until it returns, files on local disk);
  * rollback: restoring that snapshot (``restore``) vs ``engine.load_checkpoint`` of the
    checkpoint just written, and "incident -> next completed step" in a real Guard loop
    with a NaN injected (restore + rewind + the replayed steps, in seconds).

    python benchmarks/bench_deepspeed.py                       # ~100M parameters
    python benchmarks/bench_deepspeed.py --d-model 256 --layers 2 --zero-stage 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from _common import (
    SEQ,
    VOCAB,
    SyntheticTokens,
    TinyGPT,
    incident_to_next_commit,
    loss_of,
    run_or_collect,
    timed,
)

from orchestrator import Guard, parse_policy
from orchestrator.comm import Comm
from orchestrator.engines.deepspeed import DeepSpeedEngine
from orchestrator.snapshot import SnapshotRing


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    comm = Comm()
    torch.manual_seed(0)
    model = TinyGPT(VOCAB, SEQ, args.d_model, args.layers, heads=4)
    params = sum(p.numel() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    batch = torch.randint(VOCAB, (2, SEQ + 1))

    def train_step() -> None:
        engine.backward(loss_of(engine, batch).float())
        engine.step()

    train_step()  # optimizer state exists now
    step_s = timed(train_step, args.reps)

    adapter = DeepSpeedEngine(engine)
    ring = SnapshotRing(keep=2)
    ring.capture(0, adapter.state()).sealed = True  # allocate both slots
    ring.capture(1, adapter.state())
    ours_stall = timed(lambda: ring.capture(2, adapter.state()), args.reps)
    snap = ring.snapshots()[-1]
    restore_s = timed(lambda: adapter.restore(snap, 1.0), args.reps)

    base = comm.broadcast_object(tempfile.mkdtemp(prefix="bench-ds-"))
    n = 0

    def save() -> None:
        nonlocal n
        n += 1
        engine.save_checkpoint(base, tag=f"t{n}")

    ds_save_s = timed(save, max(1, args.reps // 2))
    ds_load_s = timed(lambda: engine.load_checkpoint(base, tag=f"t{n}"), max(1, args.reps // 2))
    dist.barrier()
    if comm.rank == 0:
        shutil.rmtree(base, ignore_errors=True)

    recovery_s = _guard_recovery(engine, args)
    return {
        "world_size": comm.world_size,
        "zero_stage": args.zero_stage,
        "params_m": params / 1e6,
        "state_mb_per_rank": snap.nbytes / 2**20,
        "step_ms": step_s * 1e3,
        "ours_stall_ms": ours_stall * 1e3,
        "ds_save_ms": ds_save_s * 1e3,
        "ds_save_over_ours": ds_save_s / ours_stall,
        "ours_restore_ms": restore_s * 1e3,
        "ds_load_ms": ds_load_s * 1e3,
        "ds_load_over_ours": ds_load_s / restore_s,
        "incident_to_next_step_s": recovery_s,
    }


def _guard_recovery(engine: Any, args: argparse.Namespace) -> float:
    """Seconds from the incident (guard.step returns) to the next committed step, in a real
    Guard loop: a NaN at step 4, snapshots every 2 steps, so 1 step is replayed. The
    default on-incident health check is included (cases.py's recovery leaves it out)."""
    policy = parse_policy(
        {
            "snapshot": {"every_steps": 2},
            "persist": {"enabled": False},
            "quarantine": {"enabled": False},
            "faults": [{"kind": "nan_grad", "step": 4, "rank": 0}],
        }
    )
    run_dir = Comm().broadcast_object(tempfile.mkdtemp(prefix="bench-ds-guard-"))
    guard = Guard(policy, engine=engine, run_dir=run_dir)
    loader = guard.dataloader(SyntheticTokens(512, SEQ, VOCAB), batch_size=2)
    recovery = incident_to_next_commit(
        guard, lambda batch: loss_of(engine, batch).float(), loader, max_steps=6
    )
    dist.barrier()  # every rank is done with the run directory before rank 0 removes it
    if Comm().rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
    return recovery


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=14, help="768 x 14 layers: ~100M params")
    ap.add_argument("--zero-stage", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_or_collect(__file__, args, measure)
    if results is None:
        return
    print(f"{'ranks':>5} {'params':>7} {'MB/rank':>7} {'step':>9} {'ours':>9} "
          f"{'save_ckpt':>10} {'restore':>9} {'load_ckpt':>10} {'incident->step':>14}")  # fmt: skip
    for r in results:
        print(
            f"{r['world_size']:>5} {r['params_m']:>6.1f}M {r['state_mb_per_rank']:>7.1f} "
            f"{r['step_ms']:>6.0f} ms {r['ours_stall_ms']:>6.1f} ms {r['ds_save_ms']:>7.0f} ms "
            f"{r['ours_restore_ms']:>6.1f} ms {r['ds_load_ms']:>7.0f} ms "
            f"{r['incident_to_next_step_s']:>12.2f} s"
        )
        print(
            f"{'':>5} save_checkpoint/ours {r['ds_save_over_ours']:.1f}x, "
            f"load_checkpoint/restore {r['ds_load_over_ours']:.1f}x"
        )
    print("target: save_checkpoint / ours >= 4x at ~100M parameters, 2 ranks")


if __name__ == "__main__":
    main()
