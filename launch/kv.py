"""The few key-value operations the supervisors agree through (launch/store_peers.py), and
torch's ``TCPStore`` behind them.

The store outlives attempts: the supervisor of the node that holds the launcher's
rendezvous serves it for the whole job (:func:`serve_tcp`), every node's supervisor is a
client (:class:`TCPKV`). Every call has a timeout and raises :class:`StoreError` when
the store does not answer: the caller decides what that means (launch/store_peers.py: the
store's host is lost, exit 77 naming it). torch is imported here only when a store is used,
so ``launch/`` stays light for one node.

etcd (launch/kv_etcd.py) implements the same protocol for clusters that run one.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any, Protocol


class StoreError(RuntimeError):
    """The store did not answer (its host is gone, the network is cut, or it timed out)."""


class KV(Protocol):
    """What the supervisors need from a store. Values are bytes; a missing key reads None.

    ``where`` names the store for messages (``tcp://host:port``)."""

    where: str

    def get(self, key: str) -> bytes | None: ...

    def set(self, key: str, value: bytes) -> None: ...

    def add(self, key: str, amount: int) -> int:
        """Add to a counter (a missing key counts 0) and return its new value."""
        ...

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Set ``desired`` if the value is ``expected`` (a missing key matches ``b""``);
        return the value the key holds afterwards."""
        ...

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Many keys in one round trip."""
        ...

    def append(self, key: str, value: bytes) -> None: ...

    def close(self) -> None: ...


class TCPKV:
    """A client of a torch ``TCPStore`` (one connection; calls serialized by a lock, since
    the supervisor's beat thread and main thread share it)."""

    def __init__(self, host: str, port: int, timeout_s: float, *, store: Any = None) -> None:
        self.where = f"tcp://{host}:{port}"
        self.serving = store is not None  # this process serves the store
        self.ops = 0  # round trips made (benchmarks/bench_scale.py counts them)
        self._lock = threading.Lock()
        self._known: set[str] = set()  # keys seen to exist: keys are never deleted
        if store is None:
            TCPStore = _tcpstore()

            # A refused or unroutable port fails here, fast and without the GIL: torch's
            # client retries a refused connection past its timeout (up to 3x).
            try:
                socket.create_connection((host, port), timeout_s).close()
            except OSError as err:
                raise StoreError(f"{self.where}: {err}") from err
            try:
                store = TCPStore(
                    host,
                    port,
                    is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s),
                    use_libuv=True,
                )
            except RuntimeError as err:
                raise StoreError(f"{self.where}: {_first_line(err)}") from err
        self._store = store

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, a torch store error raised as :class:`StoreError`. Not bounded:
        torch's client waits without end for a store that stopped answering without closing
        its connections (a SIGSTOPped process, a host gone silent), so launch/store_peers.py
        counts a call that has not returned toward ``node_timeout_s`` and never waits on one
        from the supervisor's main thread for long. (Each call in a thread of its own bounds
        it here, but was tried and failed the simulation: many clients in one process
        stopped connecting and leaked.)"""
        with self._lock:
            self.ops += 1
            try:
                return fn(*args)
            except RuntimeError as err:  # DistNetworkError, DistStoreError
                raise StoreError(f"{self.where}: {_first_line(err)}") from err

    def get(self, key: str) -> bytes | None:
        # TCPStore.get waits for a missing key (for its timeout): look first, once.
        if key not in self._known:
            if not self._call(self._store.check, [key]):
                return None
            self._known.add(key)
        return bytes(self._call(self._store.get, key))

    def set(self, key: str, value: bytes) -> None:
        # TCPStore does not answer a set: the check's answer (same connection, taken in
        # order) says it is applied, so that every client sees it once this returns.
        self._call(_acked, self._store.set, key, value)

    def add(self, key: str, amount: int) -> int:
        return int(self._call(self._store.add, key, amount))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self._call(self._store.compare_set, key, expected, desired))

    def multi_get(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = list(keys)
        missing = [k for k in keys if k not in self._known]
        if missing and not self._call(self._store.check, missing):
            return [self.get(k) for k in keys]  # rare: a node that has not written yet
        self._known.update(missing)
        return [bytes(v) for v in self._call(self._store.multi_get, keys)] if keys else []

    def append(self, key: str, value: bytes) -> None:
        self._call(_acked, self._store.append, key, value)

    def close(self) -> None:
        self._store = None


def serve_tcp(port: int, timeout_s: float, host: str = "0.0.0.0") -> TCPKV | None:
    """Serve a ``TCPStore`` on ``port`` from this process, on every address, and return a
    client of it (``host``: what messages call it); None when the port is taken (another
    node on this machine serves it: nodes simulated on one host)."""
    TCPStore = _tcpstore()
    try:
        store = TCPStore(
            "0.0.0.0",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            use_libuv=True,
        )
    except RuntimeError:  # DistNetworkError: the port is taken
        return None
    return TCPKV(host, port, timeout_s, store=store)


def _tcpstore() -> Any:
    """torch's TCPStore, imported quietly when this process imports torch first (the
    supervisor does): its C++ log prints a stack for every failed store call, hundreds of
    lines a minute while a store is lost, where our own messages say what happened. The
    workers the supervisor starts get the environment as it was."""
    import sys

    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        from torch.distributed import TCPStore

        return TCPStore
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"  # read once, when c10 loads
    try:
        from torch.distributed import TCPStore
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    return TCPStore


def _first_line(err: BaseException) -> str:
    """torch's store errors carry a C++ stack after the first line."""
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _acked(write: Any, key: str, value: bytes) -> None:
    write(key, value)
    write.__self__.check([key])
