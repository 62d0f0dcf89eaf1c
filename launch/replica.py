"""Buddy replication of the node's shared-memory ring (``snapshot.replicate: buddy``).

Losing a whole node loses its shared memory. So each node's supervisor copies its node's
newest complete sealed step (every local rank's verdict, bytes and node part, one timeline)
into the shared memory of one other node, its buddy: the next node by name, cyclically.
The copy goes from supervisor to supervisor over TCP, off the training processes entirely,
and the buddy keeps the newest one under its own ring folder, ``held-for-<node>/``, so it
goes when the buddy's supervisor removes its ring.

A supervisor whose node's ring holds no complete step when an attempt starts (a replaced
node, or one whose ring was wiped) asks the others for what they hold for it, and writes the
newest into its own ring before the workers start: they resume from it as from their own
slots (orchestrator/shm.py; the checksums in the verdicts catch a copy torn by a slot being
rewritten while it was sent). The ranks must run on the same node as before (the node part
names them; torchrun's ``--node-rank`` does that).

The wire format, one connection per request: a JSON line, then the files' bytes in order,
then (a put) a line ``commit`` or ``abort``. Every request carries the run's key, read from
``RUN_DIR/supervisors/replica.key`` (created by the first supervisor, mode 0600): a stray
connection is refused. The key guards against mistakes, not an attacker on the cluster
network (no encryption).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from io import BufferedIOBase
from typing import Any

from orchestrator.protocol import (
    EVENT_BUDDY_RESTORE,
    EVENT_REPLICATE_FAILED,
    EVENT_REPLICATED,
    SUPERVISORS_DIR,
)
from orchestrator.shm_index import node_refusal, verdicts

logger = logging.getLogger(__name__)

HELD = "held-for-"
CHUNK = 1 << 22


def run_key(run_dir: str) -> str:
    """The run's replica key: created once (first supervisor), read by the others."""
    path = os.path.join(run_dir, SUPERVISORS_DIR, "replica.key")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
    except FileExistsError:
        pass
    deadline = time.monotonic() + 10
    while True:  # another supervisor may be writing it this instant
        with open(path, encoding="ascii") as f:
            key = f.read().strip()
        if key or time.monotonic() > deadline:
            return key
        time.sleep(0.05)


def newest_complete(root: str) -> tuple[int, list[str]] | None:
    """The newest step of ``root``'s ring that every rank of its newest attempt sealed on
    one timeline, node part complete, and its files (relative to ``root``)."""
    found = verdicts(root)
    if not found:
        return None
    newest = max(int(v["attempt"]) for steps in found.values() for _, v in steps.values())
    ranks = [
        r for r, steps in found.items() if any(v["attempt"] == newest for _, v in steps.values())
    ]
    for step in sorted(set.intersection(*(set(found[r]) for r in ranks)), reverse=True):
        vs = {r: found[r][step] for r in ranks}
        if len({v.get("timeline") for _, v in vs.values()}) != 1 or any(
            node_refusal(found, step, v, None) for _, v in vs.values()
        ):
            continue
        files: set[str] = set()
        for r, (slot, v) in vs.items():
            d = f"slot{slot}"
            files.update({f"{d}/rank{r}.json", f"{d}/{v['file']}"})
            if "pickle" in v:
                files.add(f"{d}/{v['pickle']['file']}")
            if "node" in v:
                files.add(f"{d}/{v['node']['file']}")
        # The verdicts last: on the receiving side, bytes without a verdict are never used.
        return step, sorted(files, key=lambda f: (f.endswith(".json"), f))
    return None


def _recv_exact(f: BufferedIOBase, n: int, out: BufferedIOBase | None) -> None:
    while n > 0:
        chunk = f.read(min(CHUNK, n))
        if not chunk:
            raise ConnectionError("the connection closed mid-file")
        if out is not None:
            out.write(chunk)
        n -= len(chunk)


def _stream(wfile: BufferedIOBase, root: str, files: list[tuple[str, int]]) -> None:
    """The files' bytes, as many as the header said, from files that may be rewritten
    meanwhile (a restore from the copy checks the verdicts' checksums)."""
    for rel, size in files:
        with open(os.path.join(root, rel), "rb") as f:
            left = size
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:  # shrunk under us: pad; the checksum refuses it later
                    chunk = bytes(min(CHUNK, left))
                wfile.write(chunk)
                left -= len(chunk)


def _receive(rfile: BufferedIOBase, dest: str, files: list[list[Any]]) -> None:
    for rel, size in files:
        path = os.path.normpath(os.path.join(dest, rel))
        if not path.startswith(dest + os.sep):
            raise ValueError(f"a file outside the copy: {rel!r}")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as out:
            _recv_exact(rfile, int(size), out)


class ReplicaServer:
    """Holds other nodes' copies under ``root`` (this node's ring folder) and hands them
    back; a thread per connection."""

    def __init__(self, root: str, key: str) -> None:
        self.root, self.key = root, key
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                try:
                    outer._handle(self.rfile, self.wfile)
                except Exception as err:  # a bad or broken request: refuse, keep serving
                    logger.warning("replica: a request failed: %r", err)
                    try:
                        self.wfile.write((json.dumps({"error": repr(err)}) + "\n").encode())
                    except OSError:
                        pass

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("0.0.0.0", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="replica-server", daemon=True
        )
        self._thread.start()

    def _handle(self, rfile: BufferedIOBase, wfile: BufferedIOBase) -> None:
        head = json.loads(rfile.readline())
        if head.get("key") != self.key:
            raise PermissionError("wrong run key: a supervisor of another run?")
        node = str(head["node"]).replace("/", "_")
        held = os.path.join(self.root, HELD + node)
        if head["op"] == "put":
            tmp = f"{held}.tmp-{secrets.token_hex(4)}"
            try:
                _receive(rfile, tmp, head["files"])
                if rfile.readline().strip() != b"commit":
                    raise ConnectionError("the sender aborted (its slot moved on)")
                with open(os.path.join(tmp, "step"), "w", encoding="ascii") as f:
                    f.write(str(int(head["step"])))
                old = f"{held}.old-{secrets.token_hex(4)}"
                if os.path.isdir(held):
                    os.rename(held, old)
                os.rename(tmp, held)
                shutil.rmtree(old, ignore_errors=True)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            wfile.write(b'{"ok": true}\n')
        elif head["op"] == "get":
            step, files = -1, []
            try:
                with open(os.path.join(held, "step"), encoding="ascii") as f:
                    step = int(f.read())
                for d, _, names in os.walk(held):
                    for name in names:
                        if name != "step":
                            path = os.path.join(d, name)
                            files.append((os.path.relpath(path, held), os.path.getsize(path)))
            except (OSError, ValueError):
                step, files = -1, []
            wfile.write((json.dumps({"step": step, "files": files}) + "\n").encode())
            _stream(wfile, held, files)
        else:
            raise ValueError(f"unknown op {head['op']!r}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _connect(addr: str, timeout_s: float) -> socket.socket:
    host, _, port = addr.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=timeout_s)


def put(addr: str, key: str, node: str, root: str, step: int, files: list[str]) -> int:
    """Send ``root``'s ``files`` of ``step`` to the holder at ``addr``; returns the bytes.
    Aborted (the holder keeps its older copy) if the step's verdicts changed meanwhile."""
    sized = [(rel, os.path.getsize(os.path.join(root, rel))) for rel in files]
    before = {rel: _read(os.path.join(root, rel)) for rel in files if rel.endswith(".json")}
    with _connect(addr, 60.0) as sock, sock.makefile("rwb") as f:
        head = {"op": "put", "key": key, "node": node, "step": step, "files": sized}
        f.write((json.dumps(head) + "\n").encode())
        _stream(f, root, sized)
        intact = all(_read(os.path.join(root, rel)) == data for rel, data in before.items())
        f.write(b"commit\n" if intact else b"abort\n")
        f.flush()
        reply = json.loads(f.readline() or b"{}")
    if not reply.get("ok"):
        raise ConnectionError(reply.get("error") or "the holder did not take the copy")
    return sum(size for _, size in sized)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def get(addr: str, key: str, node: str, dest: str) -> tuple[int, int]:
    """What the holder at ``addr`` keeps for ``node``, written into ``dest`` (this node's
    ring folder); returns (step, bytes), step -1 when it holds nothing."""
    with _connect(addr, 10.0) as sock, sock.makefile("rwb") as f:
        f.write((json.dumps({"op": "get", "key": key, "node": node}) + "\n").encode())
        f.flush()
        head = json.loads(f.readline() or b"{}")
        if "error" in head:
            raise ConnectionError(head["error"])
        if int(head["step"]) < 0:
            return -1, 0
        _receive(f, os.path.abspath(dest), head["files"])
    return int(head["step"]), sum(int(size) for _, size in head["files"])


class Replicator:
    """This node's side: serve the others' copies, send ours to our buddy, fetch ours back.

    ``peers()``: the other supervisors' files (node -> dict, with ``replica`` = host:port);
    ``event(kind, step, details)``: journal."""

    def __init__(
        self,
        run_dir: str,
        node: str,
        root: str,
        peers: Callable[[], dict[str, dict[str, Any]]],
        event: Callable[[str, int, dict[str, Any]], object],
        interval_s: float,
    ) -> None:
        self.node, self.root, self.peers, self.event = node, root, peers, event
        self.interval_s = interval_s
        self.key = run_key(run_dir)
        os.makedirs(root, exist_ok=True)
        self.server = ReplicaServer(root, self.key)
        host = os.environ.get("ORCHESTRATOR_REPLICA_HOST") or socket.gethostname()
        self.address = f"{host}:{self.server.port}"
        self._sent = -1
        self._failing: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replica-send", daemon=True)

    def start(self) -> None:
        """Start sending (once; later calls do nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    def buddy(self) -> tuple[str, str] | None:
        """(node, address) of the node that holds our copy: the next live one by name."""
        others = {
            n: str(i["replica"])
            for n, i in self.peers().items()
            if i.get("replica") and i.get("state") == "running"
        }
        if not others:
            return None
        names = sorted([*others, self.node])
        after = names[(names.index(self.node) + 1) % len(names)]
        return (after, others[after]) if after != self.node else None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.send_newest()

    def send_newest(self) -> None:
        found = newest_complete(self.root)
        buddy = self.buddy()
        if found is None or buddy is None or found[0] <= self._sent:
            return
        step, files = found
        t0 = time.monotonic()
        try:
            nbytes = put(buddy[1], self.key, self.node, self.root, step, files)
        except (OSError, ValueError, ConnectionError) as err:
            why = f"{type(err).__name__}: {err}"
            if why != self._failing:  # once per kind of failure, not every interval
                self._failing = why
                self.event(EVENT_REPLICATE_FAILED, step, {"to": buddy[0], "reason": why})
            return
        self._sent, self._failing = step, None
        self.event(
            EVENT_REPLICATED,
            step,
            {"to": buddy[0], "bytes": nbytes, "seconds": round(time.monotonic() - t0, 3)},
        )

    def fetch_if_empty(self) -> None:
        """Before an attempt: if this node's ring holds no complete step, write the newest
        copy another node holds for it into the ring (journaled as ``buddy_restore``)."""
        if newest_complete(self.root) is not None:
            return
        best: tuple[int, str, str] | None = None
        for n, info in self.peers().items():
            addr = info.get("replica")
            if not addr or info.get("state") != "running":
                continue
            staging = os.path.join(self.root, f".fetch-{n}")
            shutil.rmtree(staging, ignore_errors=True)
            try:
                step, _ = get(str(addr), self.key, self.node, staging)
            except (OSError, ValueError, ConnectionError) as err:
                logger.warning("replica: cannot ask %s for our copy: %r", n, err)
                continue
            if step >= 0 and (best is None or step > best[0]):
                if best is not None:
                    shutil.rmtree(best[2], ignore_errors=True)
                best = (step, n, staging)
            else:
                shutil.rmtree(staging, ignore_errors=True)
        if best is None:
            return
        step, holder, staging = best
        nbytes = 0
        for d, _, names in os.walk(staging):
            for name in sorted(names, key=lambda x: x.endswith(".json")):  # verdicts last
                src = os.path.join(d, name)
                dst = os.path.join(self.root, os.path.relpath(src, staging))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                nbytes += os.path.getsize(src)
                os.replace(src, dst)
        shutil.rmtree(staging, ignore_errors=True)
        self.event(EVENT_BUDDY_RESTORE, step, {"from": holder, "bytes": nbytes})

    def close(self) -> None:
        """Stop sending and serving (safe to call twice)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        self.server.close()
