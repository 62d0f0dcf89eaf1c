"""etcd v3 behind launch/kv.py's ``KV`` protocol, for clusters that run one (the choice
torchrun's ``--rdzv-backend`` offers).

It speaks etcd's HTTP/JSON gateway (``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/txn``; keys
and values base64) with the standard library only. One persistent HTTP/1.1 connection per
endpoint (``http.client``, which ``urllib`` is built on): ``urllib.request`` opens a new
TCP connection for every call, a handshake per operation (on one host 1,600 against 2,200
gets/s measured; across a network one round trip more per call, twice the latency).

- Every key lives under ``prefix`` (one job's keys apart from another's on a shared etcd).
- ``add``, ``append`` and ``compare_set`` are transactions: a compare on the key's
  ``mod_revision`` (or its value) and a put, whose failure branch reads the key back, so a
  conflict costs one more round trip, not two. A conflict is retried, with jittered backoff
  past the first few, until the call's ``timeout_s``.
- Several endpoints (etcd is highly available by itself): a call goes to the one that last
  answered and moves to the next when it cannot connect. Once a request has been sent, a
  failure leaves its outcome unknown: reads, ``set`` and ``compare_set`` are repeated on
  the next endpoint (doing them twice changes nothing), ``add`` and ``append`` are not (an
  ``add`` applied twice would count a node twice): they raise :class:`StoreError`.
- Every call has ``timeout_s`` in all, shared among the endpoints it tries; a dead,
  stopped or unreachable etcd raises :class:`StoreError` naming each endpoint and what
  failed there.

etcd 3.4 or later (the gateway's ``/v3/`` paths; 3.3 served ``/v3beta/``). Plain HTTP
only: an etcd that requires TLS client certificates is not reachable this way.
"""

from __future__ import annotations

import base64
import http.client
import json
import random
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from launch.kv import StoreError

# etcd's default --max-txn-ops: a multi_get of more keys is sent as several transactions.
MAX_TXN_OPS = 128


class EtcdKV:
    """A client of an etcd cluster (calls serialized by a lock, as :class:`launch.kv.TCPKV`'s
    are: the supervisor's beat thread and main thread share it).

    Args:
        endpoints: ``host:port`` of the cluster's client URLs (plain HTTP), tried in order.
        prefix: prepended to every key.
        timeout_s: the most one call may take, retries and endpoints included.
    """

    def __init__(self, endpoints: Sequence[str], prefix: str, timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("EtcdKV needs at least one endpoint (host:port)")
        self.where = "etcd://" + ",".join(endpoints)
        self._endpoints = [_host_port(e) for e in endpoints]
        self._names = list(endpoints)
        self._prefix = prefix.encode()
        self._timeout_s = timeout_s
        self._conns: list[http.client.HTTPConnection | None] = [None] * len(endpoints)
        self._current = 0  # the endpoint that last answered
        self._lock = threading.Lock()
        # Each key this client last wrote by compare-and-put, and the revision it wrote it
        # at: its next add starts from there (one round trip while no one else writes it).
        self._seen: dict[str, tuple[bytes | None, int]] = {}

    # -- the KV protocol -------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        with self._lock:
            answer = self._post("/v3/kv/range", {"key": self._key(key)}, self._deadline())
        return _value(answer.get("kvs"))

    def set(self, key: str, value: bytes) -> None:
        body = {"key": self._key(key), "value": _b64(value)}
        with self._lock:
            self._post("/v3/kv/put", body, self._deadline())

    def add(self, key: str, amount: int) -> int:
        def plus(old: bytes | None) -> bytes:
            try:
                return str(int(old or b"0") + amount).encode()
            except ValueError:
                raise ValueError(f"{self.where}: add to {key!r}, which holds {old!r}") from None

        return int(self._update(key, plus))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        if not expected:  # a missing key matches b"": its mod_revision is 0
            return self._update(
                key, lambda old: desired if not old else None, guess=(None, 0), idempotent=True
            )
        k = self._key(key)
        body = {
            "compare": [{"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}],
            "success": [{"request_put": {"key": k, "value": _b64(desired)}}],
            "failure": [{"request_range": {"key": k}}],
        }
        with self._lock:
            answer = self._post("/v3/kv/txn", body, self._deadline())
        if answer.get("succeeded"):
            return desired
        return _value(answer["responses"][0]["response_range"].get("kvs")) or b""

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """One transaction of range requests per ``MAX_TXN_OPS`` keys, the later ones read
        at the first one's revision: one consistent snapshot of exactly the keys asked.
        (One range over the prefix would return every key under it, asked or not: old
        attempts' keys too, a cost that grows with what the store holds.)"""
        found: list[bytes | None] = []
        revision: str | None = None
        with self._lock:
            deadline = self._deadline()
            for start in range(0, len(keys), MAX_TXN_OPS):
                ranges = [{"key": self._key(k)} for k in keys[start : start + MAX_TXN_OPS]]
                if revision is not None:
                    ranges = [{**r, "revision": revision} for r in ranges]
                body = {"success": [{"request_range": r} for r in ranges]}
                answer = self._post("/v3/kv/txn", body, deadline)
                revision = revision or answer["header"]["revision"]
                found += [_value(r["response_range"].get("kvs")) for r in answer["responses"]]
        return found

    def append(self, key: str, value: bytes) -> None:
        self._update(key, lambda old: (old or b"") + value)

    def close(self) -> None:
        with self._lock:
            for i in range(len(self._conns)):
                self._drop(i)

    # -- transactions ----------------------------------------------------------------

    def _update(
        self,
        key: str,
        change: Callable[[bytes | None], bytes | None],
        guess: tuple[bytes | None, int] | None = None,
        idempotent: bool = False,
    ) -> bytes:
        """Put ``change(old)`` if the key's revision is still the one ``old`` was read at
        (``change`` returning None: leave it); the value the key holds afterwards.

        Starts from what this client last wrote there (else ``guess``, else "missing"): a
        wrong start costs one conflict, whose failure branch reads the key back.
        ``idempotent``: whether putting it twice leaves what putting it once does (see
        ``_post``): true of compare_set, not of add and append."""
        k = self._key(key)
        with self._lock:
            old, revision = guess or self._seen.get(key, (None, 0))
            deadline = self._deadline()
            conflicts = 0
            while True:
                new = change(old)
                if new is None:  # compare_set's mismatch; this read is the answer
                    return old or b""
                body = {
                    "compare": [
                        {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": revision}
                    ],
                    "success": [{"request_put": {"key": k, "value": _b64(new)}}],
                    "failure": [{"request_range": {"key": k}}],
                }
                answer = self._post("/v3/kv/txn", body, deadline, idempotent=idempotent)
                if answer.get("succeeded"):
                    self._seen[key] = (new, int(answer["header"]["revision"]))
                    return new
                kvs = answer["responses"][0]["response_range"].get("kvs")
                old, revision = _value(kvs), (int(kvs[0]["mod_revision"]) if kvs else 0)
                self._seen.pop(key, None)
                conflicts += 1
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"{self.where}: {key!r} changed under {conflicts} tries in "
                        f"{self._timeout_s}s (too many writers at once: raise the timeout)"
                    )
                if conflicts > 2:  # many writers at once: spread them out
                    time.sleep(random.uniform(0, min(0.05, 0.001 * 2**conflicts)))

    # -- HTTP ------------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self._timeout_s

    def _key(self, key: str) -> str:
        return _b64(self._prefix + key.encode())

    def _post(
        self, path: str, body: dict[str, Any], deadline: float, *, idempotent: bool = True
    ) -> dict[str, Any]:
        """POST to the endpoint that last answered, then to the others in turn; each gets
        an equal share of the time left. The answer's JSON, or StoreError naming them all."""
        failed: list[str] = []
        data = json.dumps(body).encode()
        n = len(self._endpoints)
        for tried in range(n):
            i = (self._current + tried) % n
            left = deadline - time.monotonic()
            if left <= 0:
                break
            share = left / (n - tried)
            try:
                conn = self._connection(i, share)
            except OSError as err:  # never sent: the next endpoint may take it
                failed.append(f"{self._names[i]}: cannot connect ({_why(err)})")
                continue
            try:
                status, reply = _exchange(conn, path, data, share)
            except (OSError, http.client.HTTPException) as err:
                self._drop(i)
                failed.append(f"{self._names[i]}: {path} got no answer ({_why(err)})")
                if not idempotent:
                    raise StoreError(
                        f"{self.where}: {'; '.join(failed)}; whether it was applied is "
                        "unknown, so it is not repeated elsewhere"
                    ) from err
                continue
            if status == 200:
                try:
                    answer: dict[str, Any] = json.loads(reply)
                except ValueError:
                    failed.append(f"{self._names[i]}: {path}: not etcd's answer: {reply[:80]!r}")
                    continue
                self._current = i
                return answer
            failed.append(f"{self._names[i]}: {path}: HTTP {status}: {_etcd_error(reply)}")
            if not idempotent:
                break
        raise StoreError(
            f"{self.where}: no endpoint answered {path} within {self._timeout_s}s: "
            f"{'; '.join(failed) or 'no time left'}. Is etcd running there and reachable?"
        )

    def _connection(self, i: int, timeout_s: float) -> http.client.HTTPConnection:
        conn = self._conns[i]
        if conn is not None and conn.sock is not None and not _readable(conn.sock):
            return conn
        # None, closed by us, or readable while idle: the server closed it (or sent what
        # no request asked for). A fresh one, so a request never goes out on a dead one.
        self._drop(i)
        host, port = self._endpoints[i]
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        conn.connect()
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns[i] = conn
        return conn

    def _drop(self, i: int) -> None:
        conn, self._conns[i] = self._conns[i], None
        if conn is not None:
            conn.close()


def connect(url: str, prefix: str, timeout_s: float) -> EtcdKV:
    """An :class:`EtcdKV` for ``etcd://host:port[,host:port...]`` (a trailing ``/`` is
    allowed). It connects on first use, so an unreachable etcd raises then, not here."""
    scheme, sep, rest = url.partition("://")
    endpoints = [e for e in rest.rstrip("/").split(",") if e]
    if scheme != "etcd" or not sep or not endpoints:
        raise ValueError(f"{url!r} is not etcd://host:port[,host:port...]")
    return EtcdKV(endpoints, prefix, timeout_s)


def _exchange(
    conn: http.client.HTTPConnection, path: str, data: bytes, timeout_s: float
) -> tuple[int, bytes]:
    conn.sock.settimeout(timeout_s)
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _host_port(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _value(kvs: list[dict[str, Any]] | None) -> bytes | None:
    # The gateway leaves out empty fields: a key holding b"" has no "value".
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def _etcd_error(reply: bytes) -> str:
    try:
        return str(json.loads(reply).get("message", reply[:200]))
    except ValueError:
        return repr(reply[:200])


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
