"""The supervisors of one job's nodes, agreeing through a key-value store (issue 34).

The same promises as the files of launch/nodes.py (one attempt id agreed before the
launchers start, one end, a lost node named within ``supervisor.node_timeout_s``), with a
constant number of store operations per node per interval instead of every node reading
every node's file from the shared file system:

- each node's beat thread adds 1 to ``beat/<node>`` every ``heartbeat_interval_s``, and
  reads ``view``, ``end`` and ``watcher`` in one round trip twice an interval; it sets
  ``rec/<node>`` (host, pid, attempt, phase, state, addresses) only when that changes;
- one node, the watcher, also reads every node's counter and record (three round trips)
  and publishes ``view`` (launch/store_view.py), twice an interval: who is alive, the
  highest attempt proposed, whether every node is at it, who is quiet or missing and the
  lost-node verdict.

A lost node is named ``node_timeout_s`` after the watcher saw its last beat, plus the age of
the view a node read: each at most half an interval, so within ``node_timeout_s`` plus one
interval of its last beat, and never before ``node_timeout_s`` (both lags are counted
against the verdict, not for it). Each node's supervisor wakes when its verdict is due.
- the first node that stops for good sets ``end`` (compare-and-set: the first one wins).

The watcher is whoever holds ``watcher``: every node tries to take it at start (one wins); a
node that sees ``view`` not change for ``stale_s`` takes it over from the silent holder with
a compare-and-set, so only the store itself must outlive a node.

When the store does not answer (its host is lost, the network is cut), the node keeps trying
and counts the time toward ``node_timeout_s``; then :meth:`StorePeers.lost` names the store
and its node, and the job ends with exit 77 like any lost node. Nothing here raises a store
error to the supervisor, and no call waits longer than the store client's timeout.

``supervisors/<node>.json`` is still written, on each change and every ``STATUS_EVERY_S``,
for ``orchestrator status`` and the hang watch's check that the run directory takes writes;
no node reads another's file.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from launch.kv import KV, StoreError
from launch.nodes import RUNNING, Ended, FilePeers, agree_view
from launch.store_view import Watching, judge, resume

logger = logging.getLogger(__name__)
STATUS_EVERY_S = 30.0  # supervisors/<node>.json for `orchestrator status` (not for peers)


class StorePeers:
    """This node's supervisor among the others, through ``connect()``'s store."""

    def __init__(
        self,
        run_dir: str,
        node: str,
        nnodes: int,
        interval_s: float,
        connect: Callable[[], KV],
        *,
        node_timeout_s: float,
        store_words: str,
        where: str,
        linger_s: float = 30.0,
        wake: threading.Event | None = None,
    ) -> None:
        self.node, self.nnodes, self.interval_s = node, nnodes, interval_s
        self.stale_s = max(10.0, 5 * interval_s)  # as the files: no change this long, not alive
        # Set when this node's thread reads a new view or end: the supervisor's loop looks
        # then, not up to a poll later (the lost-node bound: node_timeout_s plus the
        # watcher's look and this node's read, nothing more).
        self.wake = wake
        self.node_timeout_s, self.store_words, self.linger_s = node_timeout_s, store_words, linger_s
        self.where = where  # the store, for messages (tcp://host:port)
        self.files = FilePeers(run_dir, node, nnodes, STATUS_EVERY_S, watch_others=False)
        self._connect = connect
        self._kv: KV | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._token = f"{node}:{os.getpid()}:{time.time_ns()}"
        self._view: dict[str, Any] = {}
        self._view_raw: bytes | None = None
        self._view_at = time.monotonic()  # when this node read it (its own clock)
        self._view_seen: tuple[Any, float] = (None, time.monotonic())  # (seq, when it changed)
        self._end: bytes | None = None
        self._old_end: bytes | None = None  # an end already there: an earlier job's
        self._watcher: bytes = b""
        self._watching: Watching | None = None
        self._down: tuple[float, str] | None = None  # (since, why) the store does not answer
        self._inflight: float | None = None  # when the call now on the store began
        self._retry_at = 0.0  # no connect before this (monotonic), after a failed one
        self.call_timeout_s = max(5.0, 4 * interval_s)  # a call older than this: not answered
        self._others: tuple[float, dict[str, dict[str, Any]]] = (-float("inf"), {})
        self._published: bytes = b""
        self._joined = False
        self._recs: dict[str, tuple[bytes, dict[str, Any]]] = {}  # parsed once per change

    @property
    def poll_s(self) -> float:
        """How long the supervisor's loop may wait before its next look (a cached read):
        an interval, or less when the view this node holds makes the lost-node verdict due
        sooner (the loop also wakes on ``wake``, when a new view is read)."""
        if self.nnodes <= 1:
            return self.interval_s
        due = [float("inf")]
        waited = float(self._view.get("incomplete_for", -1.0))
        if waited >= 0:
            due.append(self._view_at + self.node_timeout_s - waited)
        if (down := self._down) is not None:
            due.append(down[0] + self.node_timeout_s)
        if (began := self._inflight) is not None:
            due.append(began + max(self.call_timeout_s, self.node_timeout_s))
        return min(self.interval_s, max(0.01, min(due) - time.monotonic() + 0.01))

    @property
    def failing(self) -> str | None:
        return self.files.failing

    # --- this node ---------------------------------------------------------------------------
    def start(self) -> None:
        self.files.start()
        self._beat()  # connect, say who we are, take the watch if nobody holds it
        self._thread = threading.Thread(target=self._run, name="supervisor-store", daemon=True)
        self._thread.start()

    def publish(self, **fields: Any) -> None:
        self.files.publish(**fields)
        self._publish()

    def at(self, attempt: int, phase: str) -> None:
        self.files.at(attempt, phase)
        self._publish()

    def refresh(self) -> str | None:
        return self.files.refresh()

    def exited(self, code: int, reason: str) -> None:
        """Say how this node ended: in its record and, if first, in ``end``; a node that
        serves the store keeps serving (and watching) until the others have seen it."""
        self.files.exited(code, reason)
        self._publish()
        mine = json.dumps({**self.files.record(), "token": self._token}).encode()
        self._store(lambda kv: kv.compare_set("end", self._old_end or b"", mine))
        deadline = time.monotonic() + self.linger_s
        while self._serving() and time.monotonic() < deadline and self._others_running():
            time.sleep(self.interval_s)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)

    # --- the others (from the view this node's thread last read) -----------------------------
    def propose(self, attempt: int) -> tuple[int, bool]:
        """One look at the agreement (launch/nodes.py :func:`agree_view`). Once agreed, the
        others' records are read (once an attempt): who they are is then known should the
        store be lost with its node (the lost-node words name it)."""
        top, start = agree_view(attempt, self._view, self.node)
        if start:
            self.others()
        return top, start

    def lost(self, timeout_s: float) -> str | None:
        if self.nnodes <= 1:
            return None
        down = self._down
        began = self._inflight  # a call that never returns (a store stopped, a host silent)
        if down is None and began is not None and time.monotonic() - began > self.call_timeout_s:
            down = (began, f"a call to it has not returned for {time.monotonic() - began:.0f} s")
        if down is not None and time.monotonic() - down[0] > timeout_s:
            server = [f"node {n} (host {r.get('host')})" for n, r in self._others[1].items()
                      if r.get("serves_store")]  # fmt: skip
            return (
                f"the supervisors' store {self.where} has not answered for "
                f"{time.monotonic() - down[0]:.0f} s ({down[1]}; supervisor.node_timeout_s="
                f"{timeout_s:g}){self.store_words}"
                + (f"; {server[0]} served it" if server else "")
                + ": if its node is lost, requeue the job (a new store starts with it); the "
                "run resumes from its newest durable snapshot"
            )
        # The view says how long the job has been incomplete when the watcher looked; add
        # the time since this node read it, on its own clock (no clock is shared).
        v = self._view
        waited = float(v.get("incomplete_for", -1.0))
        if waited < 0 or waited + time.monotonic() - self._view_at <= timeout_s:
            return None
        return (
            f"{v.get('missing')}, for {waited + time.monotonic() - self._view_at:.0f} s "
            f"(supervisor.node_timeout_s={timeout_s:g}): bring the node back (or replace it) "
            "and start the same command there, or requeue the job; the run resumes from its "
            "newest durable snapshot"
        )

    def ended(self, fresh: bool = True) -> Ended | None:
        if fresh:
            self._store(self._read_shared)
        if not self._end or self._end == self._old_end:
            return None
        info = json.loads(self._end)
        if info.get("token") == self._token:
            return None
        return Ended(
            str(info.get("node")), int(info.get("exit_code", 1)), str(info.get("reason", ""))
        )

    def ahead(self, attempt: int) -> str | None:
        v = self._view
        if int(v.get("top", -1)) > attempt and v.get("top_node") != self.node:
            return f"{v.get('top_node')} (host {v.get('top_host')}) is at attempt {v.get('top')}"
        return None

    def others(self) -> dict[str, dict[str, Any]]:
        """Every other node's record: one read of all of them, at most every interval
        (the buddy map and the lost-node words need them; nothing polls them)."""
        now = time.monotonic()
        if now - self._others[0] >= self.interval_s:
            got = self._store(self._read_records)
            if got is not None:
                self._others = (now, {n: r for n, r in got.items() if n != self.node})
        return self._others[1]

    def live(self) -> dict[str, dict[str, Any]]:
        down = set(self._view.get("down", ()))
        return {n: r for n, r in self.others().items()
                if r.get("state") == RUNNING and n not in down}  # fmt: skip

    def silent(self, seconds: float) -> list[str]:
        """The running peers that stay quiet for ``seconds`` (waited for; early once two
        fresh views show none quiet)."""
        seq0, deadline = self._view.get("seq"), time.monotonic() + seconds
        while time.monotonic() < deadline:
            quiet = {n: s for n, s in self._view.get("quiet", {}).items() if n != self.node}
            fresh = isinstance(seq0, int) and int(self._view.get("seq", 0)) >= seq0 + 2
            if fresh and not quiet:
                return []
            time.sleep(min(0.2, self.interval_s))
        quiet = self._view.get("quiet", {})
        return sorted(n for n, s in quiet.items()
                      if n != self.node and s >= seconds - 2 * self.interval_s)  # fmt: skip

    # --- the beat thread ---------------------------------------------------------------------
    def _run(self) -> None:
        looks = 0
        # Two looks an interval: a lost node is then seen by the watcher, and its verdict
        # read by every node, each within half an interval (the bound: one interval).
        while not self._stop.wait(self.interval_s / 2):
            looks += 1
            self._beat(beat=looks % 2 == 0)

    def _beat(self, beat: bool = True) -> None:
        """One look: beat (every other look: once an interval), read the shared keys, watch
        if ours to, take the watch over from a silent watcher."""
        if beat:
            self._store(lambda kv: kv.add(f"beat/{self.node}", 1))
        self._store(self._read_shared)
        if self._watcher == self._token.encode():
            self._store(self._watch)
        else:
            self._watching = None
            seq = self._view.get("seq")
            if seq != self._view_seen[0]:
                self._view_seen = (seq, time.monotonic())
            elif not self._watcher or time.monotonic() - self._view_seen[1] > self.stale_s:
                self._store(self._take_watch)

    def _read_shared(self, kv: KV) -> None:
        view, end, watcher = kv.multi_get(["view", "end", "watcher"])
        news = view != self._view_raw or end != self._end
        self._view, self._view_at = (json.loads(view) if view else {}), time.monotonic()
        self._view_raw, self._end, self._watcher = view, end, watcher or b""
        if news and self.wake is not None:
            self.wake.set()

    def _take_watch(self, kv: KV) -> None:
        self._watcher = kv.compare_set("watcher", self._watcher, self._token.encode())
        if self._watcher == self._token.encode():
            logger.info("node %s watches the supervisors through %s", self.node, kv.where)

    def _watch(self, kv: KV) -> None:
        now = time.monotonic()
        recs = self._read_records(kv)
        got = kv.multi_get([f"beat/{n}" for n in recs])
        beats = {n: int(b) for n, b in zip(recs, got, strict=True) if b is not None}
        if self._watching is None:  # taken over: the last view's silences carry on
            old = self._view.get("watcher")
            self._watching = resume(
                self._view, self._view_at, now, beats,
                old_watcher_since=self._view_seen[1] if old not in (None, self.node) else None,
            )  # fmt: skip
        # A node silent for node_timeout_s is not alive whatever stale_s says: lost within
        # node_timeout_s (plus the looks' intervals), as the issue promises.
        view = judge(
            self._watching, now, beats, recs, nnodes=self.nnodes,
            stale_s=min(self.stale_s, self.node_timeout_s),
            quiet_s=2 * self.interval_s, watcher=self.node,
        )  # fmt: skip
        kv.set("view", json.dumps(view).encode())
        self._view = view

    def _read_records(self, kv: KV) -> dict[str, dict[str, Any]]:
        members = list(dict.fromkeys((kv.get("members") or b"").decode().split()))
        got = kv.multi_get([f"rec/{n}" for n in members])
        for n, raw in zip(members, got, strict=True):
            if raw and self._recs.get(n, (b"",))[0] != raw:
                self._recs[n] = (raw, json.loads(raw))
        return {n: self._recs[n][1] for n in members if n in self._recs}

    def _publish(self) -> None:
        rec = json.dumps(self.files.record()).encode()
        if rec != self._published:
            if self._store(lambda kv: kv.set(f"rec/{self.node}", rec)) is not None:
                self._published = rec

    def _others_running(self) -> bool:
        return any(r.get("state") == RUNNING for r in self.live().values())

    def _serving(self, kv: KV | None = None) -> bool:
        return bool(getattr(kv or self._kv, "serving", False))

    def _store(self, op: Callable[[KV], Any]) -> Any:
        """Run ``op`` on the store, connecting first if need be; on a store error, note since
        when it fails and return None (never raise: the verdict is :meth:`lost`'s). A call
        another thread has in flight is waited for one interval at most: the supervisor's
        main thread goes on (and :meth:`lost` counts the stuck call) rather than hang."""
        if self._kv is None and time.monotonic() < self._retry_at:
            return None  # still down: the next connect is spread out (a thousand nodes
            # reconnecting every interval would keep a recovering store down)
        if not self._lock.acquire(timeout=self.interval_s):
            return None
        try:
            self._inflight = time.monotonic()
            try:
                if self._kv is None:
                    self._kv = self._join(self._connect())
                out = op(self._kv)
                if self._down is not None:
                    logger.warning("the supervisors' store %s answers again", self._kv.where)
                self._down = None
                return True if out is None else out
            except StoreError as err:
                if self._down is None:
                    logger.error(
                        "the supervisors' store does not answer (%s)%s; the job ends with exit "
                        "77 if it does not within supervisor.node_timeout_s",
                        err,
                        self.store_words,
                    )
                    self._down = (time.monotonic(), str(err))
                if self._kv is not None:
                    self._kv.close()
                    self._kv = None  # a connection that broke or timed out: a new one next
                self._retry_at = time.monotonic() + random.uniform(0, 4 * self.interval_s)
                return None
        finally:
            self._inflight = None
            self._lock.release()

    def _join(self, kv: KV) -> KV:
        """A new connection: say who we are (idempotent), note an end already there."""
        for key in ("end", "view"):  # made to exist (empty): a read of all keys is one trip
            kv.compare_set(key, b"", b"")
        # Said in this node's file (`orchestrator status`, and whoever looks for the store).
        self.files.publish(store=self.where, serves_store=self._serving(kv))
        if not self._joined:  # an end there before us is an earlier job's (same run, requeued)
            self._old_end, self._joined = kv.get("end"), True
        kv.add(f"beat/{self.node}", 1)
        rec = json.dumps(self.files.record()).encode()
        kv.set(f"rec/{self.node}", rec)
        self._published = rec
        kv.append("members", f"{self.node}\n".encode())
        self._watcher = kv.compare_set("watcher", b"", self._token.encode())
        return kv
