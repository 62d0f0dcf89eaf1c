"""A real S3-compatible server for tests: ``moto_server`` in a subprocess on 127.0.0.1.

Fixtures (import both into a test module, or load this file with ``-p s3_server``):

* ``s3_endpoint`` (session): starts the server on a free port, points botocore/s3fs at it
  through the environment (so ``fsspec.open("s3://...")`` works here *and* in child
  processes that inherit ``os.environ``: subprocess, torchrun workers), stops it at the end.
* ``s3_url`` (function): a fresh bucket, yielded as ``"s3://<bucket>/<unique-prefix>"``.

Skips, with the reason, when moto[server]/s3fs are missing or the server does not come up.
s3fs caches listings per instance: a process that lists what *other* processes wrote must
call ``fs.invalidate_cache()`` first (or build its filesystem with ``use_listings_cache=False``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Poll ``url`` until it answers, the process dies or ``deadline`` passes."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with opener.open(f"{url}/moto-api/", timeout=1.0):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Endpoint URL (``http://127.0.0.1:<port>``) of a moto S3 server running for the session."""
    pytest.importorskip("moto.server", reason="needs moto[server] (pip install 'moto[server]')")
    s3fs = pytest.importorskip("s3fs", reason="needs s3fs (pip install s3fs)")
    with tempfile.TemporaryFile() as log:
        for _ in range(3):  # the free port may be taken between probe and bind: retry
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            if _answers(url, proc, time.monotonic() + START_TIMEOUT_S):
                break
            _stop(proc)
        else:
            log.seek(0)
            tail = log.read()[-2000:].decode(errors="replace")
            pytest.skip(f"moto S3 server did not answer within {START_TIMEOUT_S}s: {tail}")
        old = os.environ.get("no_proxy") or os.environ.get("NO_PROXY")
        no_proxy = ",".join(filter(None, [old, "127.0.0.1", "localhost"]))
        env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": url,  # botocore >= 1.31 (hence aiobotocore/s3fs), boto3
            "AWS_ENDPOINT_URL_S3": url,  # would otherwise win over AWS_ENDPOINT_URL
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }
        unset = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")
        try:
            with pytest.MonkeyPatch.context() as mp:
                for key, value in env.items():
                    mp.setenv(key, value)
                for key in unset:
                    mp.delenv(key, raising=False)
                s3fs.S3FileSystem.clear_instance_cache()  # none may keep an older endpoint
                yield url
        finally:
            s3fs.S3FileSystem.clear_instance_cache()  # theirs points at a dead server now
            _stop(proc)


@pytest.fixture
def s3_url(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the session's server, as ``s3://<bucket>/<unique-prefix>``."""
    import fsspec

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs = fsspec.filesystem("s3")
    fs.mkdir(bucket)
    fs.invalidate_cache()
    return f"s3://{bucket}/{uuid.uuid4().hex[:8]}"
