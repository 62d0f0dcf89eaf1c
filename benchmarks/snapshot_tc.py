"""The suite's snapshot case, part two: torch_checkpointing 0.1.1 (what torchtitan now uses)
beside our snapshot, in the same process, on the same trained model: the time until its save
returns, until its copy (staging) is done, until the file is written, and the slowdown of the
next steps against the steps before; ours: the ring's capture (returns when the copy is done;
no file: our disk write is ``persist``, a separate step) and the steps after it.

torch_checkpointing is used as its docs show: ``CheckpointManager()`` (asynchronous save,
staging in a thread, writing from a subprocess), ``prewarm_staging`` once, ``save`` per
checkpoint, ``with manager.lock(): optimizer.step()`` so a step cannot change the state while
it is being copied. Only when the ``bench`` extra is installed; else the case says so.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from typing import Any

import torch
from _common import SEQ, VOCAB, barrier, loss_of

from orchestrator.engines import TorchEngine
from orchestrator.snapshot import SnapshotRing

AFTER = 3  # steps timed after each checkpoint


def compare(
    engine: TorchEngine, model: torch.nn.Module, opt: torch.optim.Optimizer, base: str, reps: int
) -> dict[str, Any]:
    try:
        from torch_checkpointing import CheckpointManager
    except ImportError:
        return {"tc_skipped": "torch_checkpointing is not installed (pip install -e .[bench])"}
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    batch = torch.randint(VOCAB, (8, SEQ + 1))
    # Its default O_DIRECT writes fail here (ext4): OSError EINVAL from WriteStream.write,
    # torch_checkpointing/storage/filesystem.py:115, on torch.save's unaligned writes.
    storage = LocalFileSystemStorageConfig(use_direct_io=False)
    mgr = CheckpointManager(CheckpointManager.Config(storage_config=storage))

    def step(lock: bool) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(model, batch).backward()
        if lock:
            with mgr.lock():
                opt.step()
        else:
            opt.step()
        return time.perf_counter() - t0

    def payload() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    engine.release()  # the steps here are plain torch ones, not the Guard's
    ring = SnapshotRing(keep=2)
    for k in range(2):  # both slots' first allocation (keep=2) is not timed
        first = ring.capture(k, engine.state())
        assert first is not None
        first.sealed = True
    mgr.prewarm_staging(payload())
    warm = mgr.save(f"{base}/tc-warm", payload())  # its subprocess starts: not timed either
    if warm is not None:
        warm.result()
    plain = [step(False) for _ in range(3)]
    rows: dict[str, list[float]] = {}
    try:
        for rep in range(reps):
            cases = (("ours", lambda r=rep: _ours(ring, engine, r)),
                     ("tc", lambda r=rep: _tc(mgr, payload, f"{base}/tc-{r}")))  # fmt: skip
            for name, fn in cases:
                plain += [step(name == "tc") for _ in range(2)]
                barrier()
                marks = fn()
                steps = [step(name == "tc") for _ in range(AFTER)]
                marks.update(_wait(marks))
                marks["steps_s"] = sum(steps)
                for k, v in marks.items():
                    rows.setdefault(f"{name}_{k}", []).append(v)
    finally:
        mgr.close()
    step_s = statistics.median(plain)
    out = {k[:-2] + "_ms": statistics.median(v) * 1e3 for k, v in rows.items()}
    out["step_ms"] = step_s * 1e3
    for name in ("ours", "tc"):  # the next steps' time over that of as many plain steps
        out[f"{name}_slowdown"] = statistics.median(rows[f"{name}_steps_s"]) / (AFTER * step_s)
    out["tc_version"] = "0.1.1" if out else None
    return out


def _ours(ring: SnapshotRing, engine: TorchEngine, rep: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    ring.capture(rep + 2, engine.state())
    dt = time.perf_counter() - t0
    return {"return_s": dt, "copied_s": dt}


def _tc(mgr: Any, payload: Any, path: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    written = mgr.save(path, payload())
    marks: dict[str, Any] = {"return_s": time.perf_counter() - t0, "t0": t0}
    staged: Future[Any] | None = mgr._staging_future  # no public handle on the copy's end
    for key, fut in (("copied_s", staged), ("written_s", written)):
        if fut is not None:
            fut.add_done_callback(lambda _f, k=key: marks.setdefault("_" + k, time.perf_counter()))
    marks["futures"] = [f for f in (staged, written) if f is not None]
    return marks


def _wait(marks: dict[str, Any]) -> dict[str, float]:
    """After the timed steps: wait for the futures; their done times, from the save's call."""
    for fut in marks.pop("futures", []):
        fut.result()
    deadline = time.perf_counter() + 5  # result() may return before the callbacks ran
    while time.perf_counter() < deadline and "t0" in marks and "_written_s" not in marks:
        time.sleep(0.001)
    t0 = marks.pop("t0", None)
    done = {k[1:]: v - t0 for k, v in list(marks.items()) if k.startswith("_") and t0}
    for k in [k for k in marks if k.startswith("_")]:
        del marks[k]
    return done
