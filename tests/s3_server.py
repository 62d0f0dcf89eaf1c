"""A real S3-compatible server for tests: ``moto_server`` in a subprocess on 127.0.0.1.

Fixtures (import both into a test module, or load this file with ``-p s3_server``):

* ``s3_endpoint`` (session): starts the server on a free port, points botocore/s3fs at it
  through the environment (so ``fsspec.open("s3://...")`` works here *and* in child
  processes that inherit ``os.environ``: subprocess, torchrun workers), stops it at the end.
* ``s3_url`` (function): a fresh bucket, yielded as ``"s3://<bucket>/<unique-prefix>"``.
* ``s3_endpoint_proxy`` (function): the server behind an :class:`Endpoint` (a TCP proxy)
  that the test stops, starts and throttles; the environment points at the proxy.

Skips, with the reason, when moto[server]/s3fs are missing or the server does not come up.
s3fs caches listings per instance: a process that lists what *other* processes wrote must
call ``fs.invalidate_cache()`` first (or build its filesystem with ``use_listings_cache=False``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
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


class Endpoint:
    """A TCP proxy on 127.0.0.1 in front of the moto server: the S3 endpoint the clients
    use, which a test can stop and start (moto keeps its objects in memory, so the server
    itself cannot be restarted with them). ``stop()`` closes the listener and resets every
    open connection: a client sees what a dead server gives it (refused, reset). ``start()``
    listens again on the same port. ``throttle(n)``: the next ``n`` requests get
    ``503 SlowDown``, as S3 answers a client over its request rate. ``die_after(method,
    suffix)``: the endpoint dies right after the server carried out the next such request
    whose path ends with ``suffix``, before its response went out (as ``stop()``): the
    client sees the request fail, though it took effect."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._throttled = 0
        self.throttled_total = 0
        self._fatal: list[tuple[bytes, bytes]] = []
        self.requests_total = 0  # requests that reached the proxy (retries show here)
        self._listener: socket.socket | None = None
        self.start()

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            # close() alone leaves a thread blocked in accept() accepting one more client
            # (the kernel's socket outlives the fd until the call returns): shut it down.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:  # RST, not FIN: the connection dies as with a crashed server
            with contextlib.suppress(OSError):
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()

    def throttle(self, requests: int) -> None:
        with self._lock:
            self._throttled = requests

    def die_after(self, method: bytes, suffix: bytes) -> None:
        with self._lock:
            self._fatal.append((method, suffix))

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        """One request per connection (the response says ``Connection: close``), so each
        request can be throttled and none is in flight on a pooled connection unseen."""
        with self._lock:
            self._conns.add(client)
        up: socket.socket | None = None
        try:
            request = _read_request(client)
            if request is None:
                return
            with self._lock:
                self.requests_total += 1
                throttle = self._throttled > 0
                if throttle:
                    self._throttled -= 1
                    self.throttled_total += 1
            if throttle:
                xml = (
                    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                    b"<Message>Please reduce your request rate.</Message></Error>"
                )
                if request.startswith(b"HEAD "):
                    xml = b""  # a HEAD response has no body, an error's neither
                client.sendall(
                    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                    + f"Content-Length: {len(xml)}\r\nConnection: close\r\n\r\n".encode()
                    + xml
                )
                return
            up = socket.create_connection(self.upstream)
            with self._lock:
                self._conns.add(up)
            up.sendall(_closing(request))
            response = b""
            while chunk := up.recv(65536):
                response += chunk
            method, path = request.split(b" ", 2)[:2]
            path = path.split(b"?", 1)[0]
            with self._lock:
                fatal = next(
                    (m for m in self._fatal if m[0] == method and path.endswith(m[1])), None
                )
                if fatal is not None:
                    self._fatal.remove(fatal)
            if fatal is not None:  # done upstream; the client never hears of it
                self.stop()
                return
            client.sendall(_closing(response))
        except OSError:
            pass
        finally:
            for c in (client, up):
                if c is not None:
                    with self._lock:
                        self._conns.discard(c)
                    with contextlib.suppress(OSError):
                        c.close()


def _read_request(client: socket.socket) -> bytes | None:
    """One HTTP request: its head and its body (Content-Length, or chunked)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = client.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    fields = {}
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip()
    if b"100-continue" in fields.get(b"expect", b"").lower():
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        while not body.endswith(b"0\r\n\r\n"):
            chunk = client.recv(65536)
            if not chunk:
                break
            body += chunk
    else:
        length = int(fields.get(b"content-length", b"0"))
        while len(body) < length:
            chunk = client.recv(65536)
            if not chunk:
                break
            body += chunk
    return head + b"\r\n\r\n" + body


def _closing(message: bytes) -> bytes:
    """``message`` (a request or a response) with ``Connection: close`` as its only
    connection header (and no ``Expect``: the proxy answered that itself)."""
    head, _, body = message.partition(b"\r\n\r\n")
    lines = [
        ln for ln in head.split(b"\r\n") if not ln.lower().startswith((b"connection:", b"expect:"))
    ]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


@pytest.fixture
def s3_endpoint_proxy(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Endpoint]:
    """The session's S3 server behind an :class:`Endpoint` the test can stop, start and
    throttle; this process and its children (inheriting the environment) use it."""
    import s3fs

    proxy = Endpoint(s3_endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.url)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield proxy
    finally:
        proxy.stop()
        s3fs.S3FileSystem.clear_instance_cache()
