"""One rank of a GPU check (tests/gpu/test_gpu.py starts it under torchrun).

    torchrun --nproc-per-node N tests/gpu/gpu_worker.py CHECK --out DIR [--device cpu]

Each check writes ``DIR/<check>-rank<r>.json`` with what it measured; the test decides.
``--device cpu`` runs the same code path on CPU with gloo (a dry run of the script itself,
meaningless as a measurement): the checks are written for CUDA and NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from orchestrator import Guard, parse_policy  # noqa: E402
from orchestrator.comm import Comm  # noqa: E402
from orchestrator.health import HealthChecker  # noqa: E402
from orchestrator.policy_sections import HealthPolicy  # noqa: E402


class Tokens(Dataset):
    """Deterministic synthetic rows of ``width`` features and a class label."""

    def __init__(self, n: int, width: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, width, generator=g)
        self.y = torch.randint(0, 16, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def mlp(width: int, depth: int, norm: str = "layer") -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.BatchNorm1d(width) if norm == "batch"
                   else nn.LayerNorm(width), nn.GELU(), nn.Dropout(0.1)]  # fmt: skip
    return nn.Sequential(*layers, nn.Linear(width, 16))


def setup(device_kind: str) -> tuple[torch.device, int, int]:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, rank, world


def write(out: str, check: str, rank: int, result: dict[str, Any]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    with open(os.path.join(out, f"{check}-rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class SyncCounter:
    """Host syncs counted with ``torch.cuda.set_sync_debug_mode('warn')``: torch warns on
    every synchronizing call (``.item()``, ``.tolist()``, a blocking copy, a stream sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.count = 0
        self._catch: Any = None

    def __enter__(self) -> SyncCounter:
        self.count = 0
        if self.device.type == "cuda":
            self._catch = warnings.catch_warnings(record=True)
            self._seen = self._catch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
            self.count = sum("synchroniz" in str(w.message) for w in self._seen)
            self._catch.__exit__(*exc)


def checker(policy: HealthPolicy, rank: int, out: str) -> HealthChecker:
    run_dir = os.path.join(out, "health-run")
    os.makedirs(run_dir, exist_ok=True)
    return HealthChecker(policy, Comm(), run_dir)


# --- checks --------------------------------------------------------------------------------
def build(engine: str, device: torch.device, width: int, depth: int, norm: str = "layer"):  # type: ignore[no-untyped-def]
    """(model, optimizer, scheduler, the object the Guard wraps, backward, step)."""
    torch.manual_seed(0)
    model = mlp(width, depth, norm).to(device)
    if engine == "deepspeed":
        import deepspeed

        cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
               "bf16": {"enabled": device.type == "cuda"},
               "zero_optimization": {"stage": 2},
               # torch's AdamW: DeepSpeed 0.19.8's FusedAdam JIT build cannot parse an
               # arch such as "9.0a" (int('0a')) in TORCH_CUDA_ARCH_LIST, set on H100/H200
               # images; the Guard does not care which AdamW runs.
               "optimizer": {"type": "AdamW",
                             "params": {"lr": 1e-3, "torch_adam": True}}}  # fmt: skip
        ds, _, _, _ = deepspeed.initialize(model=model, config=cfg)
        return ds, None, None
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif dist.get_world_size() > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def guard_for(engine: str, model: Any, opt: Any, sched: Any, policy: dict[str, Any],
              run_dir: str) -> Guard:  # fmt: skip
    if engine == "deepspeed":
        return Guard(parse_policy(policy), engine=model, run_dir=run_dir)
    return Guard(parse_policy(policy), model=model, optimizer=opt, scheduler=sched,
                 run_dir=run_dir)  # fmt: skip


def check_syncs(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """Host syncs per step of the same loop, bare and under the Guard (snapshot steps
    apart: they fence the side stream once)."""
    width, depth, steps, warm = 256, 4, 40, 10
    data = Tokens(2048, width)
    result: dict[str, Any] = {"engine": args.engine}
    # Bare: the user's loop as it is without the Guard.
    model, opt, sched = build(args.engine, device, width, depth)
    bare = []
    it = iter(torch.utils.data.DataLoader(data, batch_size=8))
    # DeepSpeed's bf16 module takes bf16 inputs (bf16 is on for CUDA only: build()).
    dtype = torch.bfloat16 if args.engine == "deepspeed" and device.type == "cuda" else None
    for step in range(steps):
        x, y = (t.to(device, non_blocking=True) for t in next(it))
        x = x.to(dtype) if dtype is not None else x
        with SyncCounter(device) as c:
            loss = F.cross_entropy(model(x).float(), y)
            if args.engine == "deepspeed":
                model.backward(loss)
                model.step()
            else:
                loss.backward()
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
        if step >= warm:
            bare.append(c.count)
    del model, opt, sched
    # Guarded.
    model, opt, sched = build(args.engine, device, width, depth)
    policy = {"snapshot": {"every_steps": 5}, "persist": {"every_steps": 20},
              "health": {"preflight": False}}  # fmt: skip
    guard = guard_for(args.engine, model, opt, sched, policy, os.path.join(args.out, "run"))
    loader = guard.dataloader(data, batch_size=8, seed=0)
    guarded: dict[int, int] = {}
    batches = guard.batches(loader, max_steps=steps)
    while True:
        step = guard.global_step
        with SyncCounter(device) as c:
            try:
                x, y = next(batches)
            except StopIteration:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            x = x.to(dtype) if dtype is not None else x
            loss = F.cross_entropy(model(x).float(), y)
            guard.backward(loss)
            guard.step()
        if step >= warm:
            guarded[step] = c.count
    guard.close()
    result["bare"] = bare
    result["guarded"] = {str(k): v for k, v in guarded.items()}
    result["snapshot_steps"] = [s for s in guarded if s % 5 == 0]
    return result


def check_bn(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """A BatchNorm model snapshotted every step, rolled back by a NaN: the restored
    buffers, parameters and optimizer state equal synchronous copies the loop took at the
    top of the same step (a snapshot torn by the next forward would not)."""
    width, depth = 512, 6
    model, opt, sched = build("ddp", device, width, depth, norm="batch")
    policy = {"snapshot": {"every_steps": 1, "keep": 3}, "persist": {"enabled": False},
              "health": {"preflight": False, "on_incident": False},
              "adjust": {"lr_factor": 1.0},
              "faults": [{"kind": "nan_grad", "step": 20}]}  # fmt: skip
    guard = guard_for("ddp", model, opt, sched, policy, os.path.join(args.out, "run"))
    loader = guard.dataloader(Tokens(4096, width), batch_size=64, seed=0)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    mismatches: list[str] = []
    compared = 0
    last = -1
    for x, y in guard.batches(loader, max_steps=30):
        step = guard.global_step
        sync(device)
        now = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        # Back at a step after a rollback (not the bad step's re-runs, which repeat the
        # same step on the state the bad forward left): the state must be the copy's.
        if step in seen and step != last:
            compared += 1
            for k, v in now.items():
                if not torch.equal(v, seen[step][k]):
                    mismatches.append(f"step {step}: {k}")
        elif step not in seen:
            seen[step] = now
        last = step
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = F.cross_entropy(model(x).float(), y)
        guard.backward(loss)
        guard.step()
    guard.close()
    return {"rollbacks": guard.rollbacks, "compared": compared, "mismatches": mismatches}


def check_tf32(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """The compute check under TF32, as nanoGPT turns it on; the settings survive it."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    health = checker(HealthPolicy(preflight=False), rank, args.out)
    report = health.run("tf32")
    health.close()
    return {
        "healthy": report.healthy,
        "bad": {str(k): v for k, v in report.bad.items()},
        "compute": report.ranks[0]["checks"]["compute"] if report.ranks else None,
        "precision_after": torch.get_float32_matmul_precision(),
        "allow_tf32_after": torch.backends.cuda.matmul.allow_tf32,
    }


def check_memory(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """Peak device memory around a rollback with the state at ``--state-fraction`` of the
    device's memory (a second copy of the state on the device would not fit)."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" \
        else 2 << 30  # fmt: skip
    # fp32 AdamW: weights, grads and two moments, 16 bytes a parameter.
    width = 8192
    depth = max(1, int(args.state_fraction * total / 16 / (width * width)))
    model, opt, sched = build("ddp", device, width, depth)
    policy = {"snapshot": {"every_steps": 5, "keep": 2}, "persist": {"enabled": False},
              "health": {"preflight": False, "on_incident": False},
              "faults": [{"kind": "nan_grad", "step": 8}]}  # fmt: skip
    guard = guard_for("ddp", model, opt, sched, policy, os.path.join(args.out, "run"))
    loader = guard.dataloader(Tokens(512, width), batch_size=4, seed=0)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
    peaks: dict[int, int] = {}  # iteration -> peak allocated during it
    rolled_back: list[int] = []  # iterations that ended in a rollback
    last, i = -1, 0
    for x, y in guard.batches(loader, max_steps=12):
        step = guard.global_step
        if device.type == "cuda":
            if i:
                peaks[i - 1] = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        if step < last:
            rolled_back.append(i - 1)
        last, i = step, i + 1
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x).float(), y)
        guard.backward(loss)
        guard.step()
    guard.close()
    return {"state_bytes": state_bytes, "total": total, "rollbacks": guard.rollbacks,
            "peaks": {str(k): v for k, v in peaks.items()}, "rolled_back": rolled_back}  # fmt: skip


def check_stall(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """Step time on snapshot steps against the others, shared memory off and on."""
    width, depth, out = 4096, 8, {}
    for shm in (False, True):
        model, opt, sched = build("ddp", device, width, depth)
        policy = {"snapshot": {"every_steps": 5, "shared_memory": shm},
                  "persist": {"enabled": False}, "health": {"preflight": False}}  # fmt: skip
        guard = guard_for("ddp", model, opt, sched, policy,
                          os.path.join(args.out, f"run-shm{int(shm)}"))  # fmt: skip
        loader = guard.dataloader(Tokens(4096, width), batch_size=16, seed=0)
        times: dict[int, float] = {}
        for x, y in _timed(guard, loader, 40, device, times):
            loss = F.cross_entropy(model(x.to(device)).float(), y.to(device))
            guard.backward(loss)
            guard.step()
        guard.close()
        snap = [t for s, t in times.items() if s >= 10 and s % 5 == 0]
        other = [t for s, t in times.items() if s >= 10 and s % 5 != 0]
        out[f"shm{int(shm)}"] = {"snapshot_step_s": sorted(snap)[len(snap) // 2],
                                 "other_step_s": sorted(other)[len(other) // 2]}  # fmt: skip
        del model, opt, sched, guard
    return out


def _timed(guard: Guard, loader: Any, steps: int, device: torch.device,
           times: dict[int, float]) -> Iterator[Any]:  # fmt: skip
    """The Guard's batches, with each step's wall time (the capture is issued when the
    batch is handed out, the fence waits in the step)."""
    t0 = time.perf_counter()
    for batch in guard.batches(loader, max_steps=steps):
        step = guard.global_step
        yield batch
        sync(device)
        times[step] = time.perf_counter() - t0
        t0 = time.perf_counter()


def check_train(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """Train with dropout on the device and durable snapshots; resumable (a second run in
    the same run directory resumes). Writes the final state for a bit-for-bit comparison."""
    torch.use_deterministic_algorithms(True)  # with CUBLAS_WORKSPACE_CONFIG (the test's)
    width, depth = 256, 3
    model, opt, sched = build("ddp", device, width, depth)
    torch.manual_seed(1234 + rank)
    policy = {"snapshot": {"every_steps": 5}, "persist": {"every_steps": 10},
              "health": {"preflight": False}}  # fmt: skip
    guard = guard_for("ddp", model, opt, sched, policy, args.run_dir)
    loader = guard.dataloader(Tokens(2048, width), batch_size=16, seed=0)
    for x, y in guard.batches(loader, max_steps=args.steps):
        loss = F.cross_entropy(model(x.to(device)).float(), y.to(device))
        guard.backward(loss)
        guard.step()
    guard.close()
    torch.save({k: v.cpu() for k, v in model.state_dict().items()},
               os.path.join(args.out, f"final-rank{rank}.pt"))  # fmt: skip
    return {"step": guard.global_step, "device": str(device),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip


def check_health(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """A health check with rank 1 away: absent (never calls it) or stopped by SIGSTOP just
    before it. The others must end with a verdict naming it within health.timeout_s."""
    policy = HealthPolicy(timeout_s=args.timeout_s, preflight=False)
    health = checker(policy, rank, args.out)
    if rank == 1:
        if args.away == "stopped":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(args.timeout_s * 4)  # absent: never comes
        return {"away": True}
    t0 = time.monotonic()
    report = health.run(f"away-{args.away}")
    return {"healthy": report.healthy, "bad": {str(k): v for k, v in report.bad.items()},
            "absent": {str(k): v for k, v in report.absent.items()},
            "seconds": time.monotonic() - t0}  # fmt: skip


def check_exit(args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """Rank 1 raises inside the loop while rank 0 waits in the step's collective: rank 1's
    process must end (abort, not a hang in destroy_process_group)."""
    model, opt, sched = build("ddp", device, 256, 2)
    policy = {"persist": {"enabled": False}, "health": {"preflight": False}}
    guard = guard_for("ddp", model, opt, sched, policy, os.path.join(args.out, "run"))
    loader = guard.dataloader(Tokens(1024, 256), batch_size=8, seed=0)
    for x, y in guard.batches(loader, max_steps=20):
        if rank == 1 and guard.global_step == 5:
            write(args.out, "exit", rank, {"raised_at": time.time()})
            raise RuntimeError("a user bug on rank 1 (tests/gpu exit check)")
        loss = F.cross_entropy(model(x.to(device)).float(), y.to(device))
        guard.backward(loss)
        guard.step()
    guard.close()
    return {"finished": True}


CHECKS = {"syncs": check_syncs, "bn": check_bn, "tf32": check_tf32, "memory": check_memory,
          "stall": check_stall, "train": check_train, "health": check_health,
          "exit": check_exit}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("check", choices=sorted(CHECKS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--engine", choices=("ddp", "fsdp2", "deepspeed"), default="ddp")
    ap.add_argument("--state-fraction", type=float, default=0.4)
    ap.add_argument("--away", choices=("absent", "stopped"), default="absent")
    ap.add_argument("--timeout-s", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--run-dir")
    args = ap.parse_args()
    device, rank, _ = setup(args.device)
    result = CHECKS[args.check](args, device, rank)
    write(args.out, args.check, rank, result)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
