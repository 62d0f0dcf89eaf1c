"""N ranks as threads in one process, each with its own real gloo process group.

The collective decisions of the Guard (the step check, an investigation, a rollback, the
incident budget, the replica digests) need several ranks, but not several processes: every
collective of the library names its group (:class:`orchestrator.comm.Comm`). Here each
thread is one rank: torch.distributed's world is made thread-local (torch's own
``ThreadLocalWorld``, which its threaded tests use) and each thread calls
``init_process_group("gloo")`` on one shared in-memory ``HashStore``, so ``dist.get_rank()``,
the default group and every ``dist.new_group`` are that rank's own, over real gloo
(loopback TCP). A run costs milliseconds to start instead of a torchrun's seconds.

c10d's registry of groups by name is made per thread too (torch's thread isolation mode).

What the threads share, unlike processes: torch's global RNG (seed your models before
:func:`run_ranks`, or give them their own ``torch.Generator``; keep dropout out: a replay
that draws random numbers is not bit for bit here), the environment, signal handlers (the
Guard installs none off the main thread: preemption stays with the torchrun tests, as do
crashes, the supervisor and bit-for-bit across processes) and module globals
(:func:`run_ranks` resets ``comm``'s error flag and drops the gloo backends its Guards kept
for the exit fence).

Usage::

    def rank_main(rank: int, world_size: int) -> float:
        ...  # dist.get_rank() == rank here
        return loss

    losses = run_ranks(rank_main, world_size=2, timeout_s=60)
"""

from __future__ import annotations

import copy
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from regression_worker import NoisyRegression
from torch import nn
from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

from orchestrator import Guard, comm, parse_policy
from orchestrator.errors import RunStop

T = TypeVar("T")
_RUNS = itertools.count()
_PROCESS_WORLD: list[Any] = [None]  # torch.distributed's own world, while a run replaces it
_LOCK = threading.Lock()  # one harness run at a time: the thread-local world is process-wide


class RankFailed(AssertionError):
    """A rank raised: the message holds its traceback (the first failing rank's)."""


def _rank_thread(
    fn: Callable[[int, int], T],
    rank: int,
    world_size: int,
    store: dist.Store,
    timeout_s: float,
    results: dict[int, Any],
    errors: dict[int, BaseException],
) -> None:
    try:
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except BaseException as err:
        errors[rank] = err
        return
    try:
        results[rank] = fn(rank, world_size)
    except BaseException as err:  # re-raised in the caller's thread, with its traceback
        errors[rank] = err  # before the peers see this rank go: the first error is the cause
    finally:
        # Also on an exception: closing this rank's sockets fails a peer's collective at
        # once ("connection closed by peer") instead of after the group's timeout.
        dist.destroy_process_group()


def run_ranks(fn: Callable[[int, int], T], world_size: int = 2, timeout_s: float = 60.0) -> list[T]:
    """Run ``fn(rank, world_size)`` on ``world_size`` threads, one gloo group each.

    Returns:
        Each rank's return value, by rank.

    Raises:
        RankFailed: a rank raised (the first one's traceback in the message; the others'
            errors, often a collective that lost that peer, are listed after it), or a rank
            was still running after ``timeout_s`` (a hang: the stuck threads' stacks shown).
    """
    with _LOCK:
        old_world = dist.distributed_c10d._world
        if isinstance(old_world, ThreadLocalWorld):  # left by a run whose rank got stuck
            old_world = _PROCESS_WORLD[0]
        else:
            _PROCESS_WORLD[0] = old_world
        dist.distributed_c10d._world = ThreadLocalWorld()  # type: ignore[assignment]
        # c10d's registry of groups by name is process-wide; each thread names its groups
        # "0", "1", ... as a process would: make the registry per thread, as torch's
        # threaded tests do.
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        comm._ENDING_ON_ERROR[0] = False
        kept = set(comm._KEPT_BACKENDS)
        store = dist.PrefixStore(f"harness{next(_RUNS)}", dist.HashStore())
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        threads = [
            threading.Thread(
                target=_rank_thread,
                args=(fn, r, world_size, store, timeout_s, results, errors),
                name=f"harness-rank{r}",
                daemon=True,  # a hung rank must not keep pytest from exiting
            )
            for r in range(world_size)
        ]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
        finally:
            if not any(t.is_alive() for t in threads):
                # A stuck rank keeps the thread-local world (its group is torn down when
                # the group's timeout ends its collective): restoring the process's world
                # under it would let it destroy the main thread's default group.
                torch._C._distributed_c10d._set_thread_isolation_mode(False)
                dist.distributed_c10d._world = old_world
            # Process-wide state a rank's Guard set for its process: a rank that gave up
            # flags the process as ending on an error, and each Guard keeps its gloo backend
            # for the exit fence. These threads are done with both (their groups destroyed);
            # the pytest process, and the next run, are not ending.
            comm._ENDING_ON_ERROR[0] = False
            for key in set(comm._KEPT_BACKENDS) - kept:
                del comm._KEPT_BACKENDS[key]
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        failed = "".join(
            f"\nrank {r} failed:\n{''.join(traceback.format_exception(e))}"
            for r, e in sorted(errors.items())
        )
        raise RankFailed(
            f"{len(stuck)} rank(s) still running after {timeout_s}s (torch.distributed's "
            f"thread-local world stays until the next run):\n{_stacks(stuck)}{failed}"
        )
    if errors:
        first = next(iter(errors))  # the first to fail: the cause, the others its echo
        others = "".join(
            f"\nrank {r} also failed: {e!r}" for r, e in sorted(errors.items()) if r != first
        )
        tb = "".join(traceback.format_exception(errors[first]))
        raise RankFailed(f"rank {first} failed:\n{tb}{others}") from errors[first]
    return [results[r] for r in range(world_size)]


def _stacks(threads: list[threading.Thread]) -> str:
    frames = sys._current_frames()
    out = []
    for t in threads:
        frame = frames.get(t.ident or -1)
        if frame is not None:
            out.append(f"{t.name}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(out)


@dataclass
class RankResult:
    """One rank's end of :func:`train_regression`."""

    outcomes: list[str]  # what guard.step returned, step by step
    state: dict[str, Any]  # the model's and the optimizer's state, copied at the end
    stop: RunStop | None  # the RunStop the Guard raised (GaveUp, Unhealthy), if any
    step: int  # guard.global_step at the end


def train_regression(
    run_dir: Path,
    policy: dict[str, Any],
    *,
    steps: int,
    samples: int = 4096,
    poison: int = 0,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    world_size: int = 2,
    timeout_s: float = 120.0,
) -> list[RankResult]:
    """tests/regression_worker.py's DDP run (``--engine ddp --data guard``), its ranks as
    threads: the same model, data, poison and loop, into ``run_dir``."""
    torch.manual_seed(0)  # here, once: the ranks' threads share torch's global RNG
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    models = [copy.deepcopy(model) for _ in range(world_size)]
    data = NoisyRegression(samples, poison)

    def rank_main(rank: int, _: int) -> RankResult:
        module = nn.parallel.DistributedDataParallel(models[rank])
        opt_cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
        opt = opt_cls(module.parameters(), lr=lr)
        guard = Guard(parse_policy(policy), model=module, optimizer=opt, run_dir=str(run_dir))
        outcomes: list[str] = []
        stop: RunStop | None = None
        try:
            for x, y in guard.batches(guard.dataloader(data, 8, seed=3), max_steps=steps):
                loss = F.mse_loss(module(x).squeeze(-1), y)
                guard.backward(loss)
                outcomes.append(guard.step(loss))
        except RunStop as err:  # in a process: its exit code
            stop = err
        guard.close()
        state = {"model": models[rank].state_dict(), "optim": opt.state_dict()}
        return RankResult(outcomes, copy.deepcopy(state), stop, guard.global_step)

    return run_ranks(rank_main, world_size, timeout_s)
