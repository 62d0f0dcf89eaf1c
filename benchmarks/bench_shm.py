"""The shared-memory ring (snapshot.shared_memory) against the private ring and the durable
tier, in one process, on the example GPT's model + AdamW state (one rank's state):

  * capture stall into a slot (first / steady): private host memory vs /dev/shm;
  * the slot's verdict (CRC32 of its bytes, on a thread in training);
  * restore after a restart: a shared-memory slot (checksum check + copy out) vs the durable
    tier on local disk and on a local S3 server (moto), each validated as on resume;
  * shared memory per slot / state bytes.

    python benchmarks/bench_shm.py                  # 10M and 100M parameters
    python benchmarks/bench_shm.py --sizes 10M      # one size

The local disk is read right after it was written, from the page cache: a restore on a
real restart (another process, possibly cold cache) can only be slower, so the disk ratio
is a lower bound.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import torch
from _common import SEQ, VOCAB, build, loss_of

from orchestrator.shm import ShmSlots
from orchestrator.snapshot import SnapshotRing
from orchestrator.store import DurableStore

DIMS = {"10M": (256, 12), "100M": (768, 14)}


def best_of(fn: Callable[[], Any], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def steady(ring: SnapshotRing, state: dict[str, Any], reps: int) -> float:
    """Best capture time into a slot whose buffers exist (the slot freed between runs)."""

    def once() -> None:
        ring.slots = [None] * ring.keep  # the buffers stay: the next capture reuses them
        ring.capture(1, state)

    return best_of(once, reps) * 1e3


def s3_server() -> tuple[subprocess.Popen[bytes] | None, str | None]:
    """A moto S3 server on 127.0.0.1 (None when moto is not installed)."""
    try:
        import moto.server  # noqa: F401
        import s3fs
    except ImportError:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(
        AWS_ACCESS_KEY_ID="x",
        AWS_SECRET_ACCESS_KEY="x",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=url,
        AWS_ENDPOINT_URL_S3=url,
        NO_PROXY="127.0.0.1",
        no_proxy="127.0.0.1",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with opener.open(f"{url}/moto-api/", timeout=1.0):
                break
        except OSError:
            time.sleep(0.1)
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    import fsspec

    fsspec.filesystem("s3").mkdir(bucket)
    return proc, f"s3://{bucket}/shm-bench"


def measure(size: str, reps: int, s3_url: str | None) -> dict[str, Any]:
    d, layers = DIMS[size]
    model, opt = build(d, layers)
    loss_of(model, torch.randint(VOCAB, (4, SEQ + 1))).backward()
    opt.step()  # AdamW state exists now
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    params = sum(p.numel() for p in model.parameters())
    out: dict[str, Any] = {"size": size, "params": params}

    private = SnapshotRing(2)
    t0 = time.perf_counter()
    snap = private.capture(1, state)
    out["private_first_ms"] = (time.perf_counter() - t0) * 1e3
    assert snap is not None
    out["state_mb"] = snap.nbytes / 2**20
    out["private_steady_ms"] = steady(private, state, reps)

    root = tempfile.mkdtemp(prefix="bench-shm-", dir="/dev/shm")
    try:
        shm = ShmSlots(root, 0, 1, 2, attempt=0)
        ring = SnapshotRing(2, alloc=shm.alloc, on_drop=shm.drop)
        t0 = time.perf_counter()
        snap = ring.capture(1, state)
        out["shm_first_ms"] = (time.perf_counter() - t0) * 1e3
        assert snap is not None
        out["shm_steady_ms"] = steady(ring, state, reps)
        snap = ring.capture(1, state)
        assert snap is not None
        snap.sealed = True
        plan = {"keys": ["model", "optim"], "native": {}, "texts": {}, "extra": {}}
        t0 = time.perf_counter()
        shm.seal(snap, on_error=print, plan=plan)
        shm.join()
        out["verdict_ms"] = (time.perf_counter() - t0) * 1e3
        slot_bytes = sum(
            os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(root) for f in fs
        )
        out["slot_over_state"] = slot_bytes / ring.keep / snap.nbytes  # per slot

        def from_shm() -> None:
            assert shm.check(snap.slot) is None
            shm.load(snap.slot)

        out["restore_shm_ms"] = best_of(from_shm, reps) * 1e3
        tiers = {"disk": tempfile.mkdtemp(prefix="bench-shm-disk-")}
        if s3_url:
            tiers["s3"] = s3_url
        for name, url in tiers.items():
            store = DurableStore(url)
            store.write_part(snap, 0, 1, ["model", "optim"], nonce="n")
            manifest = store.commit(1, 1, "n", {}, timeout_s=60)

            def from_store(s: DurableStore = store, m: dict[str, Any] = manifest) -> None:
                s.validate_files(1, m, [0])  # as a resume does: sizes and checksums first
                s.load_part(1, 0)

            out[f"restore_{name}_ms"] = best_of(from_store, max(1, reps // 2)) * 1e3
            if name == "disk":
                shutil.rmtree(url, ignore_errors=True)
        shm.close(remove=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", nargs="+", default=list(DIMS), choices=list(DIMS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    proc, s3_url = s3_server()
    try:
        rows = [measure(s, args.reps, s3_url) for s in args.sizes]
    finally:
        if proc is not None:
            proc.terminate()
    print("| params | MB | capture first / steady: private | shm | verdict (thread) | "
          "restore: shm | disk | S3 | disk / shm | S3 / shm | shm slot / state |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s3 = r.get("restore_s3_ms")
        print(
            f"| {r['params'] / 1e6:.1f}M | {r['state_mb']:.0f} | "
            f"{r['private_first_ms']:.1f} / {r['private_steady_ms']:.1f} ms | "
            f"{r['shm_first_ms']:.1f} / {r['shm_steady_ms']:.1f} ms | {r['verdict_ms']:.0f} ms | "
            f"{r['restore_shm_ms']:.1f} ms | {r['restore_disk_ms']:.1f} ms | "
            + (f"{s3:.0f} ms | " if s3 else "- | ")
            + f"{r['restore_disk_ms'] / r['restore_shm_ms']:.1f}x | "
            + (f"{s3 / r['restore_shm_ms']:.1f}x | " if s3 else "- | ")
            + f"{r['slot_over_state']:.3f}x |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
