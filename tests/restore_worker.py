"""One rank of tests/test_restore.py: train a few steps with an engine adapter, snapshot into
the ring, train on, roll back, and check that every parameter, buffer and optimizer-state
tensor (fp32 master partitions, ZeRO partitions, local shards) is the same object with the
same storage as before, holding the snapshot's bits; then that the next step replays bit
for bit. ``--peak``: the host memory a rollback adds, in one process (VmHWM).

Run: torchrun --nproc-per-node 2 tests/restore_worker.py --engine ddp|fsdp1|fsdp2|zero1|...
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from orchestrator.comm import exit_process
from orchestrator.engines import Engine, engine_for
from orchestrator.snapshot import SnapshotRing


def net(norm: type[nn.Module] = nn.BatchNorm1d) -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank
    # 33 rows: shards of uneven size. BatchNorm: buffers a forward writes.
    return nn.Sequential(nn.Linear(16, 33), norm(33), nn.ReLU(), nn.Linear(33, 4))


class Tracker(nn.Module):
    """A running mean its forward writes in place, as BatchNorm's: bf16 BatchNorm does not
    run on CPU, so the DeepSpeed cells use this for a buffer a forward writes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.9).add_(x.detach().mean(0).to(self.mean.dtype), alpha=0.1)
        return x


def build(kind: str) -> Engine:
    model = net(nn.LayerNorm if kind.startswith("zero") else nn.BatchNorm1d)
    if kind.startswith("zero"):
        model.insert(2, Tracker(33))
    if kind.startswith("zero"):
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 8,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
            "zero_optimization": {"stage": int(kind[-1])},
            "bf16": {"enabled": True},
            "steps_per_print": 10**9,
        }
        ds, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        return engine_for(None, None, None, None, ds)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model)
    elif kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return engine_for(model, opt, sched, None, None)


def train_step(engine: Engine, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 16, generator=g)
    ds = getattr(engine, "ds", None)
    model = ds if ds is not None else engine.model  # type: ignore[attr-defined]
    if ds is not None:
        x = x.to(torch.bfloat16)  # DeepSpeed's bf16 module takes bf16 inputs
    loss = model(x).float().pow(2).mean()
    engine.backward(loss)
    engine.judge(1.0)
    engine.commit(1.0)


def live_tensors(engine: Engine) -> dict[str, torch.Tensor]:
    """Every tensor a rollback must restore, by name: the objects training uses."""
    out: dict[str, torch.Tensor] = {}
    ds = getattr(engine, "ds", None)
    if ds is not None:
        opt = ds.optimizer
        stage3 = getattr(engine, "stage3", False)
        for n, p in ds.module.named_parameters():
            out[f"param {n}"] = p.ds_tensor if stage3 else p
        for n, b in ds.module.named_buffers():
            out[f"buffer {n}"] = b
        masters = (
            opt.fp32_partitioned_groups_flat if stage3 else opt.single_partition_of_fp32_groups
        )
        for i, t in enumerate(masters):
            out[f"fp32 master {i}"] = t
        inner = opt.optimizer
        for i, state in enumerate(inner.state.values()):
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim {i} {k}"] = v
        return out
    model: nn.Module = engine.model  # type: ignore[attr-defined]
    for n, p in model.named_parameters():
        out[f"param {n}"] = p
    for n, b in model.named_buffers():
        out[f"buffer {n}"] = b
    opt: torch.optim.Optimizer = engine.optimizer  # type: ignore[attr-defined]
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optim {i} {k}"] = v
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def where(t: torch.Tensor) -> tuple[int, int]:
    return id(t), local(t).data_ptr()


def bits(t: torch.Tensor) -> torch.Tensor:
    return local(t).detach().clone().contiguous().view(-1).view(torch.uint8)


def check(engine: Engine, rank: int, steps: int = 3) -> list[str]:
    """Snapshot after ``steps`` steps, train on, roll back; the problems found."""
    for s in range(steps):
        train_step(engine, s, rank)
    ring = SnapshotRing(2)
    snap = ring.capture(steps, engine.state())
    assert snap is not None
    snap.wait()
    before = live_tensors(engine)
    ids = {n: where(t) for n, t in before.items()}
    want = {n: bits(t) for n, t in before.items()}
    train_step(engine, steps, rank)
    after_next = {n: bits(t) for n, t in live_tensors(engine).items()}
    for s in range(steps + 1, steps + 3):
        train_step(engine, s, rank)
    moved = [n for n, t in live_tensors(engine).items() if not torch.equal(bits(t), want[n])]
    problems = [] if moved else ["training did not change the state: nothing to restore"]
    engine.restore(snap, 1.0)
    now = live_tensors(engine)
    if set(now) != set(ids):
        problems.append(f"tensors after the rollback: {sorted(set(now) ^ set(ids))} differ")
    for n, t in now.items():
        if n not in ids:
            continue
        if where(t)[0] != ids[n][0]:
            problems.append(f"{n}: another object after the rollback")
        if where(t)[1] != ids[n][1]:
            problems.append(f"{n}: another storage after the rollback")
        if not torch.equal(bits(t), want[n]):
            problems.append(f"{n}: not the snapshot's bits after the rollback")
    train_step(engine, steps, rank)  # the same step again: the same result, bit for bit
    for n, t in live_tensors(engine).items():
        if n in after_next and not torch.equal(bits(t), after_next[n]):
            problems.append(f"{n}: the step after the rollback did not replay bit for bit")
    return problems


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak(mib: int) -> dict[str, Any]:
    """Bytes of host memory a rollback adds at its peak, for a model of ``mib`` MiB of fp32
    parameters under AdamW (state: three times that)."""
    model = nn.Sequential(nn.Linear(1024, mib * 256, bias=False))  # 1024 x 256 x 4 B = 1 MiB
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = engine_for(model, opt, None, None, None)

    def step() -> None:
        model(torch.randn(4, 1024)).pow(2).mean().backward()
        engine.commit(1.0)

    step()
    ring = SnapshotRing(2)
    snap = ring.capture(1, engine.state())
    assert snap is not None
    step()
    rss = vm("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    engine.restore(snap, 1.0)
    return {"state_bytes": snap.nbytes, "added_bytes": vm("VmHWM") - rss}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="ddp")
    ap.add_argument("--peak", type=int, help="MiB of parameters: measure a rollback's peak")
    args = ap.parse_args()
    if args.peak:
        print("PEAK " + json.dumps(peak(args.peak)), flush=True)
        return 0
    if args.engine.startswith("zero"):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    problems = check(build(args.engine), rank)
    for p in problems:
        print(f"[rank {rank}] {p}", flush=True)
    if not problems:
        print(f"RESTORE-OK rank {rank}", flush=True)
    dist.barrier()
    return 1 if problems else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Not sys.exit: interpreter teardown with gloo's threads alive aborted an FSDP1 rank
    # once in CI ("terminate called without an active exception") after both said OK.
    exit_process(main())
