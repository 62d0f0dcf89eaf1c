"""Storage that fails for real: which errors are retried (the classes s3fs, botocore, gcsfs,
aiohttp and the local file system really raise), the S3 endpoint stopped during a write and
during a resume, throttled, refusing permission, a missing bucket, and a full disk.

The S3 server is moto on 127.0.0.1, reached through a TCP proxy (tests/s3_server.py) that
the tests stop and start: moto keeps its objects in memory, so the endpoint dies at the
proxy, which the client cannot tell from a dead server (connections refused, and the ones
open are reset)."""

from __future__ import annotations

import errno
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_server import Endpoint

from conftest import (
    assert_bitwise_equal,
    final_states,
    kinds,
    spawn,
    train,
    train_cmd,
    wait,
)
from orchestrator.audit import audit
from orchestrator.policy_sections import PersistPolicy
from orchestrator.retry import is_transient, storage_retry
from orchestrator.snapshot import Snapshot, SnapshotRing
from orchestrator.store import DurableStore, step_dir

pytestmark = pytest.mark.timeout(300)


def _client_error(code: str, status: int) -> Exception:
    """What botocore raises for an S3 error response, as s3fs translates it."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    err = ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        "PutObject",
    )
    out: Exception = translate_boto_error(err)
    return out


def test_real_storage_error_classes_are_told_apart() -> None:
    """Throttling, timeouts and connection loss are retried; permission, not found, disk
    full and invalid requests are not (each built as its library raises it)."""
    pytest.importorskip("s3fs")
    import aiohttp
    import botocore.exceptions as be
    from torch.distributed.checkpoint.api import CheckpointException

    transient = [
        _client_error("SlowDown", 503),
        _client_error("ServiceUnavailable", 503),
        _client_error("InternalError", 500),
        _client_error("RequestTimeout", 400),
        be.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"),  # the server is down
        be.ConnectTimeoutError(endpoint_url="http://127.0.0.1:9"),
        be.ReadTimeoutError(endpoint_url="http://127.0.0.1:9"),
        be.ConnectionClosedError(endpoint_url="http://127.0.0.1:9"),
        aiohttp.ServerDisconnectedError(),
        aiohttp.ClientConnectionError(),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused"),
        TimeoutError(),
        OSError(errno.EIO, "Input/output error"),
        OSError("a remote backend's error without an errno"),
        CheckpointException("dcp", {0: (ConnectionResetError(errno.ECONNRESET, "x"), None)}),
    ]
    permanent = [
        _client_error("AccessDenied", 403),
        _client_error("InvalidAccessKeyId", 403),
        _client_error("NoSuchBucket", 404),
        _client_error("NoSuchKey", 404),
        _client_error("InvalidArgument", 400),
        be.NoCredentialsError(),
        PermissionError(errno.EACCES, "Permission denied"),
        FileNotFoundError(errno.ENOENT, "No such file or directory"),
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EROFS, "Read-only file system"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        OSError("Forbidden: gs://bucket/x"),  # gcsfs's 403
        CheckpointException("dcp", {0: (OSError(errno.ENOSPC, "full"), None)}),
        ValueError("not a storage error"),
    ]
    assert [e for e in transient if not is_transient(e)] == []
    assert [e for e in permanent if is_transient(e)] == []
    gcsfs = pytest.importorskip("gcsfs.retry", reason="gcsfs is optional ([gcs])")
    assert is_transient(gcsfs.HttpError({"code": 429, "message": "rate"}))
    assert is_transient(gcsfs.HttpError({"code": 503, "message": "unavailable"}))
    assert not is_transient(gcsfs.HttpError({"code": 400, "message": "bad"}))


STEPS = ["--steps", "40"]
EXACT: dict[str, Any] = {"adjust": {"lr_factor": 1.0}}
# Our retries, with botocore's own cut to one attempt (AWS_MAX_ATTEMPTS): an error reaches
# the retry policy at once instead of after botocore's ten seconds of backoff.
PATIENT = {"retries": 12, "retry_max_wait_s": 1.0}


@pytest.fixture(scope="module")
def uninterrupted(clean_run: Callable[[int], Path]) -> Path:
    return clean_run(40)


def _bucket(endpoint: Endpoint) -> str:
    import fsspec

    name = f"drill-{uuid.uuid4().hex[:12]}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(name)
    return f"s3://{name}/run"


def _until(what: str, done: Callable[[], bool], proc: subprocess.Popen[str], s: float) -> None:
    """Poll ``done`` (bounded by ``s`` seconds and by the process's life)."""
    deadline = time.monotonic() + s
    while not done():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {s} s"
        time.sleep(0.05)


def _half_written(upstream: str, url: str) -> Callable[[], bool]:
    """Whether a step under ``url`` has every part but no manifest yet (looked at on the
    server itself, behind the endpoint)."""
    import fsspec

    fs = fsspec.filesystem(
        "s3", client_kwargs={"endpoint_url": upstream}, skip_instance_cache=True,
        use_listings_cache=False,
    )  # fmt: skip
    root = url.removeprefix("s3://")

    def check() -> bool:
        try:
            for d in fs.ls(root, detail=False):
                names = {p.rsplit("/", 1)[-1] for p in fs.ls(d, detail=False)}
                if {"rank_0.json", "rank_1.json"} <= names and "manifest.json" not in names:
                    return True
        except FileNotFoundError:
            pass
        return False

    return check


def test_the_s3_endpoint_dies_during_a_write_and_comes_back(
    tmp_path: Path,
    uninterrupted: Path,
    s3_endpoint: str,
    s3_endpoint_proxy: Endpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 is between the last part and the manifest (slow_storage on commit) when the
    endpoint dies: the commit fails with botocore's EndpointConnectionError, which the
    retry policy retries until the endpoint is back; nothing is lost, bit for bit."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = _bucket(s3_endpoint_proxy)
    d = tmp_path / "run"
    policy = {
        **EXACT,
        "persist": {"every_steps": 10, "url": url, **PATIENT},
        "faults": [{"kind": "slow_storage", "op": "commit", "seconds": 2.0, "rank": 0}],
    }
    proc = spawn(*train_cmd(d, 2, *STEPS, policy=policy))
    _until("a half-written snapshot", _half_written(s3_endpoint, url), proc, 120)
    s3_endpoint_proxy.stop()
    _until("a retried commit", lambda: bool(kinds(d, "persist_retry")), proc, 60)
    s3_endpoint_proxy.start()
    r = wait(proc, 240)
    assert r.returncode == 0, r.stdout[-3000:]
    retries = kinds(d, "persist_retry")
    assert any("EndpointConnectionError" in e["details"]["error"] for e in retries), retries
    assert not kinds(d, "persist_failed")
    assert audit(str(d), url) == []
    assert DurableStore(url).committed_steps()[0] == 40
    for a, b in zip(final_states(uninterrupted), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_a_part_retried_after_its_index_was_stored_still_matches_the_manifest(
    s3_endpoint_proxy: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's index (its last write) reaches the server, but the endpoint dies before the
    response does: rank 1's writer retries the part while rank 0, which found the index
    there, commits the snapshot with the sizes and hashes in it. The retry must leave the
    bytes those hashes were taken from (CI once saw rank_1/.metadata differ from its hash:
    DCP writes a fresh save id into it on every save). The ordering the race needs is made
    here, not waited for: rank 0 commits while rank 1's retry sleeps."""

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the lost response reaches our retries
    url = _bucket(s3_endpoint_proxy)
    store, nonce = DurableStore(url), uuid.uuid4().hex

    def snap(key: str, value: torch.Tensor) -> Snapshot:
        taken = SnapshotRing(2).capture(10, {key: {"t": value}})
        assert taken is not None
        return taken

    store.write_part(snap("model", torch.arange(64.0)), 0, 2, ["model"], nonce)
    s3_endpoint_proxy.die_after(b"PUT", b"/step_000000010/rank_1.json")
    commits: list[dict[str, Any]] = []

    def rank_0_commits(state: Any) -> None:  # the endpoint is back, rank 1 not yet retrying
        s3_endpoint_proxy.start()
        commits.append(store.commit(10, 2, nonce, {}, timeout_s=10.0))

    policy = PersistPolicy(url=url, retries=3, retry_max_wait_s=0.1)
    retrying = storage_retry(policy, before_sleep=rank_0_commits)
    retrying(
        store.write_part, snap("rng", torch.arange(8, dtype=torch.uint8)), 1, 2, ["rng"], nonce
    )
    assert len(commits) == 1, commits
    (cand,) = store.candidates()
    assert cand.committed and store.check(cand) is None


def test_a_part_written_twice_for_one_nonce_is_the_same_bytes(tmp_path: Path, s3_url: str) -> None:
    """The earlier attempt's index can also land after the retry looked for it (a request
    the client gave up on, carried out late): the retry then writes the part again, and
    every file must come out as before, byte for byte, whichever index rank 0 reads."""

    state = {"model": {"w": torch.randn(4, 4)}, "rng": {"t": torch.arange(8, dtype=torch.uint8)}}
    snap = SnapshotRing(2).capture(10, state)
    assert snap is not None

    def stored(store: DurableStore) -> dict[str, bytes]:
        store.fs.invalidate_cache()
        return {p: store.fs.cat_file(p) for p in store.fs.find(store.path(step_dir(10)))}

    for url in (str(tmp_path / "snapshots"), s3_url):
        store = DurableStore(url)
        store.write_part(snap, 1, 2, ["model", "rng"], "a-nonce")
        first = stored(store)
        assert any(p.endswith("/.metadata") for p in first), first
        store.fs.rm(store.path(step_dir(10), "rank_1.json"))  # not there yet when looked for
        store.write_part(snap, 1, 2, ["model", "rng"], "a-nonce")
        assert stored(store) == first, url


def test_the_s3_endpoint_down_at_a_resume_is_waited_for_not_skipped(
    tmp_path: Path,
    uninterrupted: Path,
    s3_endpoint_proxy: Endpoint,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A crash at 25 (once the writes in flight committed), and the endpoint dies before
    the restart: the supervisor's next attempt cannot list the snapshots and stops (it
    neither starts from scratch nor resumes from something older); once the endpoint is
    back, the attempt after resumes from the newest committed snapshot, bit for bit."""
    from test_supervisor import launch_cmd, torchrun

    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = _bucket(s3_endpoint_proxy)
    d = tmp_path / "run"
    policy = {
        **EXACT,
        "persist": {"every_steps": 10, "url": url, "retries": 2, "retry_max_wait_s": 0.2},
        "supervisor": {"backoff_s": 1.0, "backoff_max_s": 2.0, "heartbeat_interval_s": 0.5},
        "faults": [{"kind": "crash", "step": 25, "rank": 0, "after_persist": True}],
        # the durable tier's resume is tested: no node ring (the default) to resume from
        "snapshot": {"shared_memory": False},
    }
    cmd = launch_cmd(d, policy, *torchrun(*STEPS, "--save-final", str(d / "final")))
    proc = spawn(cmd)
    _until("the crash", lambda: bool(kinds(d, "fault")), proc, 120)
    s3_endpoint_proxy.stop()
    _until("a refused resume", lambda: bool(kinds(d, "storage_unreachable")), proc, 120)
    s3_endpoint_proxy.start()
    r = wait(proc, 240)
    assert r.returncode == 0, r.stdout[-3000:]
    (down,) = kinds(d, "storage_unreachable")
    assert down["attempt"] == 1 and "EndpointConnectionError" in down["details"]["error"]
    assert not kinds(d, "snapshot_invalid")
    (resume,) = kinds(d, "resume")
    committed = [e["step"] for e in kinds(d, "persist") if e["attempt"] == 0]
    assert resume["attempt"] >= 2 and resume["details"]["snapshot_step"] == max(committed)
    assert [e["step"] for e in kinds(d, "run_start") if e["attempt"] == 1] == [0]
    assert audit(str(d), url) == []
    for a, b in zip(final_states(uninterrupted), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


def test_s3_throttling_is_retried(
    tmp_path: Path, s3_endpoint_proxy: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The endpoint answers 503 SlowDown for a while (as S3 does over a prefix's request
    rate): s3fs's and botocore's retries give up, ours retry until it passes."""
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    url = _bucket(s3_endpoint_proxy)
    d = tmp_path / "run"
    policy = {**EXACT, "persist": {"every_steps": 10, "url": url, **PATIENT}}
    proc = spawn(*train_cmd(d, 1, "--steps", "30", policy=policy, save=False))
    _until("a first snapshot", lambda: bool(kinds(d, "persist")), proc, 120)
    s3_endpoint_proxy.throttle(8)
    r = wait(proc, 240)
    assert r.returncode == 0, r.stdout[-3000:]
    assert s3_endpoint_proxy.throttled_total == 8
    retries = kinds(d, "persist_retry")
    said = [e["details"]["error"] for e in retries]  # s3fs: SlowDown, 503 -> OSError(EBUSY)
    assert said and all(x.startswith(f"OSError({errno.EBUSY},") for x in said), said
    assert not kinds(d, "persist_failed")
    assert DurableStore(url).committed_steps()[0] == 30
    assert audit(str(d), url) == []


def test_permission_and_not_found_are_not_retried(
    tmp_path: Path, s3_endpoint: str, s3_endpoint_proxy: Endpoint
) -> None:
    """S3 refusing the credentials (moto checking them): the resume stops at once with the
    reason, no retry. A local path that cannot be a directory (not found / not a directory):
    the writes fail once each, journaled, and training goes on."""
    url = _bucket(s3_endpoint_proxy)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def auth(after: str) -> None:  # moto checks credentials after this many requests
        req = urllib.request.Request(
            f"{s3_endpoint}/moto-api/reset-auth",
            after.encode(),
            headers={"Content-Type": "text/plain"},  # else the server reads it as a form
        )
        opener.open(req, timeout=10).close()

    d = tmp_path / "denied"
    auth("0")
    before = s3_endpoint_proxy.requests_total
    try:
        r = train(d, 1, "--steps", "5", policy={"persist": {"url": url, **PATIENT}}, save=False)
    finally:
        auth("inf")
    assert r.returncode != 0
    (down,) = kinds(d, "storage_unreachable")
    assert "PermissionError" in down["details"]["error"]
    # Retried, the listing would have been asked PATIENT's 12 times and more.
    asked = s3_endpoint_proxy.requests_total - before
    assert 1 <= asked <= 3, asked

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the snapshots' directory should be")
    d = tmp_path / "blocked"
    policy = {"persist": {"every_steps": 5, "url": str(blocker / "snapshots"), **PATIENT}}
    r = train(d, 1, "--steps", "12", policy=policy, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    failed = kinds(d, "persist_failed")
    assert failed and all(not e["details"]["transient"] for e in failed)
    assert not kinds(d, "persist_retry")


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A tmpfs of a given size mounted under the test's folder (skips where mounting is
    not allowed)."""
    mounts: list[Path] = []

    def mount(mib: float) -> Path:
        m = tmp_path / f"disk{len(mounts)}"
        m.mkdir()
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={int(mib * 1024)}k", "tmpfs", str(m)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounts.append(m)
        return m

    yield mount
    for m in mounts:
        subprocess.run(["umount", "-l", str(m)], check=False)


def test_a_full_disk_fails_the_write_keeps_the_committed_snapshot(
    tmp_path: Path, small_disk: Any
) -> None:
    """The durable store is a tmpfs with room for one snapshot and a half: the second write
    fails with ENOSPC, is not retried, its part is removed again, training goes on, and
    the first snapshot stays committed and valid."""
    probe = tmp_path / "probe"
    r = train(probe, 2, "--steps", "10", policy={"persist": {"every_steps": 10}}, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    size = DurableStore(str(probe / "snapshots")).candidates()[0].manifest["bytes"]  # type: ignore[index]
    disk = small_disk(1.5 * size / 2**20)
    d = tmp_path / "run"
    policy = {"persist": {"every_steps": 10, "keep": 1, "url": str(disk), **PATIENT}}
    r = train(d, 2, "--steps", "30", policy=policy, save=False)
    assert r.returncode == 0, r.stdout[-3000:]
    assert [e["step"] for e in kinds(d, "persist")] == [10]
    failed = kinds(d, "persist_failed")
    assert failed and all(
        e["details"]["disk_full"] and "no space left" in e["details"]["why"]
        and not e["details"]["transient"]
        for e in failed
    )  # fmt: skip
    assert not kinds(d, "persist_retry")
    assert audit(str(d), str(disk)) == []
    # The failed parts are removed: rank 0's (its write failed) at once, rank 1's of step 20
    # once every rank knew (the step's all-reduce). The final one, written at close, may
    # keep rank 1's part until retention after a later commit.
    left = {p.name: sorted(q.name for q in p.iterdir()) for p in disk.iterdir()}
    assert left.pop("step_000000010") == ["COMMITTED", "manifest.json", "rank_0", "rank_0.json",
                                          "rank_1", "rank_1.json"]  # fmt: skip
    assert set(left) <= {"step_000000030"} and all("rank_0" not in v for v in left.values())
