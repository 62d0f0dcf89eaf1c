"""etcd v3 behind launch/kv.py's ``KV`` protocol, for clusters that run one (the choice
torchrun's ``--rdzv-backend`` offers).

It speaks etcd's HTTP/JSON gateway (``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/txn``; keys
and values base64) with the standard library only. One persistent HTTP/1.1 connection per
endpoint (``http.client``, which ``urllib`` is built on): ``urllib.request`` opens a new
TCP connection for every call, a handshake per operation (on one host 1,900 against 2,350
gets/s measured; across a network one round trip more per call, twice the latency).

- Every key lives under ``prefix`` (one job's keys apart from another's on a shared etcd).
- ``add``, ``append`` and ``compare_set`` are transactions: a compare on the key's
  ``mod_revision`` (or its value) and a put, whose failure branch reads the key back, so a
  conflict costs one more round trip, not two. A conflict is retried, with jittered backoff
  past the first few, until the call's ``timeout_s``.
- Several endpoints (etcd is highly available by itself): a call goes to the one that last
  answered and moves on to the next when it cannot connect or gets no answer. A request
  that got no answer may have been applied all the same; sending it again must not apply
  it twice (an ``add`` counted twice would count a node twice). Reads and ``set`` are the
  same done twice; a write transaction also puts its number in this client's own marker
  key (``<prefix>.kv_etcd/<client id>``), and a copy whose compare fails reads the marker:
  its own number there says the first copy was applied. Exactly once, at the cost of one
  small key per client.
- Every call has ``timeout_s`` in all; it goes round the endpoints until then, each try
  with an equal share of the round's time left. A dead, stopped or unreachable etcd
  raises :class:`StoreError` naming each endpoint and what last failed there.
- A member whose leader dies answers the writes sent to it then only at etcd's request
  timeout (5 s + 2 election timeouts: 6 s measured with ``--election-timeout 500``, 7 s
  with the default 1000), while the others have a new leader within an election
  timeout or two. So with several endpoints, ``timeout_s`` should leave the second one
  at least that: more than twice the election timeout (4 s with etcd's defaults).

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
import uuid
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
        self._marker = _b64(self._prefix + f".kv_etcd/{uuid.uuid4().hex}".encode())
        self._writes = 0  # numbers this client's write transactions

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
            return self._update(key, lambda old: desired if not old else None, guess=(None, 0))
        k = self._key(key)
        compare = {"key": k, "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        with self._lock:
            applied, kvs = self._write(k, compare, desired, self._deadline())
        return desired if applied else (_value(kvs) or b"")

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
    ) -> bytes:
        """Put ``change(old)`` if the key's revision is still the one ``old`` was read at
        (``change`` returning None: leave it); the value the key holds afterwards.

        Starts from what this client last wrote there (else ``guess``, else "missing"): a
        wrong start costs one conflict, whose failure branch reads the key back."""
        k = self._key(key)
        with self._lock:
            old, revision = guess or self._seen.pop(key, (None, 0))
            deadline = self._deadline()
            conflicts = 0
            while True:
                new = change(old)
                if new is None:  # compare_set's mismatch; this read is the answer
                    return old or b""
                compare = {"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": revision}
                applied, kvs = self._write(k, compare, new, deadline)
                if applied:
                    if kvs:  # the revision it was written at, known when this copy wrote it
                        self._seen[key] = (new, int(kvs[0]["mod_revision"]))
                    return new
                old, revision = _value(kvs), (int(kvs[0]["mod_revision"]) if kvs else 0)
                conflicts += 1
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"{self.where}: {key!r} changed under {conflicts} tries in "
                        f"{self._timeout_s}s (too many writers at once: raise the timeout)"
                    )
                if conflicts > 2:  # many writers at once: spread them out
                    time.sleep(random.uniform(0, min(0.05, 0.001 * 2**conflicts)))

    def _write(
        self, k: str, compare: dict[str, Any], new: bytes, deadline: float
    ) -> tuple[bool, list[dict[str, Any]] | None]:
        """Put ``new`` at ``k`` (base64) if ``compare`` holds, exactly once however many
        endpoints it is sent to. Whether it was applied, and the key as it is then: as
        written when this copy wrote it (else None), or as found when it was not."""
        self._writes += 1
        number = _b64(str(self._writes).encode())
        body = {
            "compare": [compare],
            "success": [
                {"request_put": {"key": k, "value": _b64(new)}},
                {"request_put": {"key": self._marker, "value": number}},
            ],
            "failure": [{"request_range": {"key": k}}, {"request_range": {"key": self._marker}}],
        }
        answer = self._post("/v3/kv/txn", body, deadline)
        if answer.get("succeeded"):
            written = {"mod_revision": answer["header"]["revision"]}
            return True, [written]
        found, marker = (r["response_range"].get("kvs") for r in answer["responses"])
        if marker and marker[0].get("value") == number:  # an earlier copy was applied
            return True, None
        return False, found

    # -- HTTP ------------------------------------------------------------------------

    def _deadline(self) -> float:
        return time.monotonic() + self._timeout_s

    def _key(self, key: str) -> str:
        return _b64(self._prefix + key.encode())

    def _post(self, path: str, body: dict[str, Any], deadline: float) -> dict[str, Any]:
        """POST to the endpoint that last answered, then to the others in turn, round after
        round until ``deadline`` (a member restarting, an election: etcd answers again in
        seconds); each try gets an equal share of the round's time left. The answer's
        JSON, or StoreError naming each endpoint's last failure. A request may reach etcd
        more than once: every one here may (see ``_write``)."""
        failed: dict[str, str] = {}
        data = json.dumps(body).encode()
        n = len(self._endpoints)
        tries = 0
        while (left := deadline - time.monotonic()) > 0:
            i = (self._current + tries) % n
            share = left / (n - tries % n)
            tries += 1
            answer = self._try(i, path, data, share, failed)
            if answer is not None:
                self._current = i
                return answer
            if tries % n == 0:  # a round without an answer: let etcd recover, not spin
                pause = min(0.05 * 2 ** (tries // n), 1.0, deadline - time.monotonic())
                time.sleep(max(pause, 0.0))
        reasons = "; ".join(f"{name}: {why}" for name, why in failed.items()) or "no time"
        raise StoreError(
            f"{self.where}: no answer to {path} in {self._timeout_s}s ({tries} tries; last "
            f"from each: {reasons}). Is etcd running there and reachable?"
        )

    def _try(
        self, i: int, path: str, data: bytes, timeout_s: float, failed: dict[str, str]
    ) -> dict[str, Any] | None:
        """One request to endpoint ``i``: its answer, or None with why in ``failed``."""
        name = self._names[i]
        try:
            conn = self._connection(i, timeout_s)
        except OSError as err:
            failed[name] = f"cannot connect ({_why(err)})"
            return None
        try:
            status, reply = _exchange(conn, path, data, timeout_s)
        except (OSError, http.client.HTTPException) as err:
            self._drop(i)
            failed[name] = f"no answer ({_why(err)})"
            return None
        if status == 200:
            try:
                answer: dict[str, Any] = json.loads(reply)
                return answer
            except ValueError:
                failed[name] = f"not etcd's answer: {reply[:80]!r}"
                return None
        if 400 <= status < 500 and status not in (408, 429):  # the request, not the member
            raise StoreError(f"{self.where}: {name} refused {path}: {_etcd_error(reply)}")
        failed[name] = f"HTTP {status}: {_etcd_error(reply)}"
        return None

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
