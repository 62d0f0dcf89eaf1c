"""The stores' side of benchmarks/bench_scale_parts.py (docs/scale.md): rank 0's durable
commit against the S3 server the tests use (moto, tests/s3_server.py), with every request
counted by operation, and the health check's evidence gather against a real TCPStore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # s3_server: the tests' moto helpers


# --- the durable commit on S3 --------------------------------------------------------------------
@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (as tests/s3_server.py starts it), the environment
    pointed at it."""
    from s3_server import _answers, _free_port, _stop

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.TemporaryFile()
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    if not _answers(url, proc, time.monotonic() + 30):
        _stop(proc)
        raise RuntimeError("the moto S3 server did not come up within 30 s")
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url,
           "AWS_ENDPOINT_URL_S3": url, "NO_PROXY": "127.0.0.1,localhost",
           "no_proxy": "127.0.0.1,localhost"}  # fmt: skip
    os.environ.update(env)
    try:
        yield url
    finally:
        _stop(proc)
        log.close()


S3_CALLS: Counter[str] = Counter()


def _count_s3_calls() -> None:
    """Count every S3 request s3fs makes, by operation (each LIST page is one)."""
    import s3fs
    from fsspec.asyn import sync_wrapper

    real = s3fs.S3FileSystem._call_s3

    async def counted(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        S3_CALLS[method] += 1
        return await real(self, method, *args, **kwargs)

    s3fs.S3FileSystem._call_s3 = counted  # type: ignore[method-assign]
    # Files written through fs.open go through the sync wrapper made of the original.
    s3fs.S3FileSystem.call_s3 = sync_wrapper(counted)  # type: ignore[method-assign]


def commit_rows(parts_list: list[int], commit_max: int) -> list[dict[str, Any]]:
    """Rank 0's commit against ``parts`` parts on S3: with every part there (the least it
    costs), one polling round with none there yet (what each 50 ms round costs while ranks
    are still writing), a round as the wait made it before it listed the step folder (a
    look per part), and one listing of the step folder. Above ``commit_max`` parts only the
    listing is measured: the commit's requests are counted per part below it (moto serves
    a few hundred a second)."""
    import fsspec

    _count_s3_calls()
    rows = []
    with moto_server():
        fs = fsspec.filesystem("s3")
        bucket = f"scale-{uuid.uuid4().hex[:8]}"
        fs.mkdir(bucket)
        for parts in parts_list:
            rows += _commit_at(fs, f"{bucket}/p{parts}", parts, parts <= commit_max)
    return rows


def _commit_at(fs: Any, root: str, parts: int, commit: bool) -> list[dict[str, Any]]:
    from orchestrator.errors import PersistError
    from orchestrator.manifest import step_dir
    from orchestrator.store import DurableStore

    store = DurableStore(f"s3://{root}")
    d = f"{root}/{step_dir(100)}"
    objs = {}
    for r in range(parts):  # each rank's index and one file of its DCP folder
        files = {f"rank_{r}/.metadata": {"size": 1, "sha256": "0", "rank": r}}
        objs[f"{d}/rank_{r}.json"] = json.dumps({"rank": r, "nonce": "x", "files": files}).encode()
        objs[f"{d}/rank_{r}/.metadata"] = b"m"
    t0 = time.perf_counter()
    fs.pipe(objs)
    write_ms = round((time.perf_counter() - t0) * 1e3)
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("one LIST of the step folder", lambda: _list(store, d)),
    ]
    if commit:
        cases[:0] = [
            ("commit, every part there", lambda: store.commit(100, parts, "x", {}, 600.0)),
            ("commit: one round, none there", lambda: _one_round(store, parts, PersistError)),
            ("before: a look per part, one round", lambda: _per_part(store, d, parts)),
        ]
    rows = []
    for name, fn in cases:
        S3_CALLS.clear()
        t0 = time.perf_counter()
        out = fn()
        ms = round((time.perf_counter() - t0) * 1e3)
        calls = dict(sorted(S3_CALLS.items()))
        note = out if isinstance(out, str) else ""
        rows.append(
            {"part": name, "parts": parts, "ms": ms, "requests": sum(calls.values()),
             "by_op": calls, "note": note}
        )  # fmt: skip
    rows.append(
        {"part": "(writing the parts)", "parts": parts, "ms": write_ms, "requests": 2 * parts,
         "by_op": {"put_object": 2 * parts}, "note": "not the commit"}
    )  # fmt: skip
    return rows


def _one_round(store: Any, parts: int, error: type[Exception]) -> str:
    try:
        store.commit(200, parts, "x", {}, 0.0)  # step 200 has no parts: one round, then gives up
    except error:
        return "gave up after one round"
    return "committed?"


def _per_part(store: Any, d: str, parts: int) -> str:
    """One round of the wait as it was before it listed the step folder: a look per part
    (``exists``: a HEAD, and a LIST more for a part not there) and a read of each found."""
    store.fs.invalidate_cache()
    found = [r for r in range(parts) if store.fs.exists(f"{d}/rank_{r}.json")]
    for r in found:
        store._read_json_or_none(f"{d}/rank_{r}.json")
    return f"{len(found)} parts there"


def _list(store: Any, d: str) -> str:
    store.fs.invalidate_cache()
    entries = store.fs.ls(d, detail=False)
    return f"{len(entries)} entries"


# --- the health check's gather through the store -------------------------------------------------
EVIDENCE = {"rank": 8191, "host": "node-1023.cluster", "checks": {
    "compute": {"ok": True, "max_rel_error": 1.2e-07, "checksum": "0" * 64},
    "memory": {"ok": True, "mismatches": 0},
    "collectives": {"ok": True, "bad_senders": [], "all_reduce_ok": True},
    "bandwidth": {"ok": True, "gbps": 123.4, "seconds": 0.0012, "wait_s": 0.0001}}}  # fmt: skip


def health_rows(worlds: list[int]) -> list[dict[str, Any]]:
    """One rank's read of every rank's evidence (orchestrator/health.py ``_gather``) from
    a real TCPStore holding ``world`` of them: a look per key as before (every rank made
    ``world`` requests, so the store served world^2); a poll as it was (a ``check`` of every
    key: O(world) on the store) and as it is (``add`` of a counter: O(1)); then ``multi_get``
    of them all, which stays (every rank judges every rank's evidence)."""
    value = json.dumps(EVIDENCE)
    return [row for world in worlds for row in _gather_at(world, value)]


def _gather_at(world: int, value: str) -> list[dict[str, Any]]:
    from datetime import timedelta

    from s3_server import _free_port
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", _free_port(), is_master=True, timeout=timedelta(seconds=60))
    keys = [f"h/1/evidence/{r}" for r in range(world)]
    store.multi_set(keys, [value] * world)
    cases: list[tuple[str, Callable[[], Any], int]] = [
        ("health gather: a look per key (before)",
         lambda: [store.check([k]) for k in keys], world),
        ("health gather: a poll, check of all (before)", lambda: store.check(keys), 1),
        ("health gather: a poll, the counter (now)", lambda: store.add("h/1/reported", 0), 1),
        ("health gather: multi_get of all", lambda: store.multi_get(keys), 1),
    ]  # fmt: skip
    rows = []
    for name, fn, requests in cases:
        t0 = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t0) * 1e3
        note = f"{world * len(value) // 1024} KB to each rank" if "multi_get" in name else ""
        rows.append(
            {"part": name, "parts": world, "ms": round(ms, 2), "requests": requests,
             "by_op": {"per rank": requests, "store total": requests * world}, "note": note}
        )  # fmt: skip
    return rows
