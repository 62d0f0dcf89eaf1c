"""Shared pieces of the benchmarks: the example model and running a worker under torchrun."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_gpt import SyntheticTokens, TinyGPT

from orchestrator import exit_process

VOCAB, SEQ = 256, 64
RESULT = "RESULT "

__all__ = [
    "SEQ",
    "barrier",
    "timed",
    "VOCAB",
    "SyntheticTokens",
    "build",
    "incident_to_next_commit",
    "init_dist",
    "loss_of",
    "report",
    "run_or_collect",
    "spawn",
]


def build(d: int, layers: int, fsdp: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The example GPT (FSDP2-sharded, else DDP-wrapped when distributed) and its AdamW."""
    torch.manual_seed(0)
    model: torch.nn.Module = TinyGPT(VOCAB, SEQ, d, layers, heads=4)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        assert dist.is_initialized(), "call init_dist(always=True) first: FSDP needs a group"
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    elif dist.is_initialized():
        model = DDP(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Any, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs, every rank starting together."""
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved(fns: dict[str, Any], reps: int) -> dict[str, float]:
    """Median seconds of each of ``fns``, timed in turn within every repetition (every rank
    starting each together), so drift on a shared machine hits all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_baseline(tensors: list[torch.Tensor]) -> Any:
    """A function copying exactly ``tensors`` (the bytes and dtypes a snapshot copies, one
    ``copy_`` each) into preallocated host buffers whose pages were touched first: the
    physical floor a snapshot of them is compared with."""
    dsts = [torch.empty(t.shape, dtype=t.dtype) for t in tensors]
    for d, t in zip(dsts, tensors, strict=True):
        d.copy_(t)  # first touch of the pages is not part of a copy

    def copy() -> None:
        for d, t in zip(dsts, tensors, strict=True):
            d.copy_(t)

    return copy


def incident_to_next_commit(guard: Any, loss_fn: Any, loader: Any, max_steps: int) -> float:
    """Seconds from the step that returned "incident" to the next committed step, in a real
    Guard loop whose policy injects one NaN."""
    t_incident = recovery = None
    for batch in guard.batches(loader, max_steps=max_steps):
        guard.backward(loss_fn(batch))
        outcome = guard.step()
        if outcome == "incident":
            t_incident = time.perf_counter()
        elif outcome == "commit" and t_incident is not None and recovery is None:
            recovery = time.perf_counter() - t_incident
    guard.close()
    if recovery is None:
        raise RuntimeError("the injected NaN did not cause an incident: check the policy")
    return recovery


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def init_dist(always: bool = False) -> None:
    """Join torchrun's group: when there are several ranks, or ``always`` (FSDP at 1 rank)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (world > 1 or always) and not dist.is_initialized():
        dist.init_process_group("gloo")


def report(result: dict[str, Any]) -> NoReturn:
    """Rank 0 prints its result line for ``spawn`` to pick up; then every rank exits."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(RESULT + json.dumps(result), flush=True)
    barrier()  # nobody tears the group down while a peer still talks on it
    exit_process(0)  # not a plain return: see its docstring (gloo teardown at exit)


def spawn(script: str, nproc: int, args: list[str]) -> dict[str, Any]:
    """Run ``script --worker args`` under torchrun with ``nproc`` ranks; return rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(port),
           script, "--worker", *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        fd, path = tempfile.mkstemp(prefix="bench-failure-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(out.stdout + out.stderr)
        raise RuntimeError(
            f"{script} failed under torchrun (exit {out.returncode}); full output: {path}\n"
            f"{out.stderr[-2000:]}"
        )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(RESULT))
    result: dict[str, Any] = json.loads(line[len(RESULT) :])
    return result


def run_or_collect(
    script: str,
    args: Any,
    measure: Any,
    always_dist: bool = False,
    nprocs: tuple[int, ...] = (1, 2),
) -> list[dict[str, Any]] | None:
    """The shared ``main`` of the benchmarks. As a torchrun worker: measure and report, and
    return None. Otherwise: run the script at each rank count of ``nprocs`` and return rank
    0's results, or print them as JSON lines (``--json``) and return None."""
    if args.worker:
        init_dist(always=always_dist)
        report(measure(args))
    passthrough = [a for a in sys.argv[1:] if a != "--json"]
    results = [spawn(script, nproc, passthrough) for nproc in nprocs]
    if args.json:
        for r in results:
            print(json.dumps(r))
        return None
    return results
