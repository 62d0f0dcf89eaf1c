"""The durable tier's background writer: one daemon thread per rank that writes sealed
snapshots through :class:`orchestrator.store.DurableStore` (and the node-local copy), in
order with invalidations, retrying transient storage errors. It never decides on its own:
:mod:`orchestrator.durable` submits and reads its state into the step's all-reduce."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tenacity import RetryCallState, Retrying

from orchestrator.journal import Journal
from orchestrator.logs import RankLogger
from orchestrator.policy_sections import PersistPolicy
from orchestrator.retry import is_transient, storage_retry
from orchestrator.snapshot import Snapshot
from orchestrator.store import SNAPSHOT_ERRORS, DurableStore

logger = logging.getLogger(__name__)


@dataclass
class LocalTier:
    """The node-local copy (e.g. /dev/shm): the node's lowest rank writes the shared state,
    every rank its own part, and the leader commits once its node's parts are there."""

    store: DurableStore
    leader: int
    node_ranks: list[int]


@dataclass
class _Write:
    snap: Snapshot
    keys: list[str]
    local_keys: list[str]
    nonce: str
    native: dict[str, str]
    texts: dict[str, str]


@dataclass
class _Invalidate:
    after_step: int


@dataclass
class _Discard:
    step: int  # a write that failed on some rank: this rank's part of it is dead weight


class Persister:
    """One daemon thread per rank that writes sealed snapshots, one at a time, in order with
    invalidations of snapshots from an abandoned timeline.

    The training thread never waits for it. It never decides on its own either: the Guard
    reads ``busy`` into the step's all-reduce and submits, or skips, on every rank alike.
    The snapshot handed over stays held in the ring until the Guard sees every rank idle.
    """

    def __init__(
        self,
        policy: PersistPolicy,
        store: DurableStore,
        rank: int,
        world_size: int,
        journal: Journal,
        extra: dict[str, Any],
        local: LocalTier | None = None,
    ) -> None:
        self.policy = policy
        self.local = local
        self.store = store
        self.rank = rank
        self.log = RankLogger(logger, rank)
        self.world_size = world_size
        self.journal = journal
        self.extra = extra
        self.failed = False  # a write ran out of retries (read by the training thread)
        self.done: set[int] = set()  # steps whose write (rank 0: commit) succeeded
        self._q: queue.Queue[_Write | _Invalidate | _Discard | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="orchestrator-persist", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def submit(
        self,
        snap: Snapshot,
        keys: list[str],
        local_keys: list[str],
        nonce: str,
        native: dict[str, str] | None = None,
        texts: dict[str, str] | None = None,
    ) -> None:
        """Write this rank's part (``keys``; ``local_keys`` on the node-local tier) of
        ``snap``. ``nonce`` names this attempt at it, so no part left over from another
        attempt or timeline is ever committed with it. ``native``/``texts``: see
        :meth:`DurableStore.write_part`."""
        self._idle.clear()
        self._q.put(_Write(snap, keys, local_keys, nonce, native or {}, texts or {}))

    def invalidate_after(self, step: int) -> None:
        """Delete durable snapshots newer than ``step``, after the writes in flight: rank 0
        on the remote store, each node's leader on its local tier."""
        if self.rank == 0 or (self.local is not None and self.rank == self.local.leader):
            self._idle.clear()
            self._q.put(_Invalidate(step))

    def discard(self, step: int) -> None:
        """Remove this rank's part of the uncommitted snapshot of ``step``, whose write
        failed on some rank (after the writes in flight)."""
        self._idle.clear()
        self._q.put(_Discard(step))

    def _invalidate(self, step: int) -> None:
        stores = [self.store] if self.rank == 0 else []
        if self.local is not None and self.rank == self.local.leader:
            stores.append(self.local.store)
        for store in stores:
            gone = self._retrying("invalidate", step)(store.committed_after, step)
            if gone:  # journaled first: the audit must know they were withdrawn on purpose
                self.journal.write(
                    "persist_invalidate", step, {"uncommitted_steps": gone, "url": store.url}
                )
                self._retrying("invalidate", step)(store.uncommit, gone)

    def wait_idle(self, timeout_s: float) -> bool:
        return self._idle.wait(timeout_s)

    def close(
        self, timeout_s: float | None = None, abandon: Callable[[], bool] | None = None
    ) -> bool:
        """Finish what is queued (bounded by ``timeout_s``, and given up as soon as
        ``abandon()`` says so), then stop. True if it stopped."""
        self._q.put(None)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._thread.is_alive():
            if abandon is not None and abandon():
                return False
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self._thread.join(0.2 if left is None else min(0.2, left))
        return True

    def _run(self) -> None:
        while True:
            task = self._q.get()
            if task is None:
                return
            if isinstance(task, _Discard):
                self.store.remove_part(task.step, self.rank)  # best effort, never raises
                if self._q.empty():
                    self._idle.set()
                continue
            step = task.snap.step if isinstance(task, _Write) else task.after_step
            try:
                if isinstance(task, _Write):
                    self.failed = False  # this write's outcome, until the next one
                    self._persist(task)
                else:
                    self._invalidate(step)
            # Keep the thread alive (a dead writer would hang every rank waiting for it).
            except SNAPSHOT_ERRORS as err:
                self.failed = self.failed or isinstance(task, _Write)
                said = {"error": repr(err), "url": self.store.url, "transient": is_transient(err)}
                if isinstance(task, _Write):  # a full disk must not fill up with dead parts
                    self.store.remove_part(step, self.rank)
                    said.update(self._disk_full(task.snap))
                self.log.error("durable snapshot %d: %s", step, said.get("why", said["error"]))
                self.journal.write("persist_failed", step, said)
            finally:
                if self._q.empty():
                    self._idle.set()

    def _disk_full(self, snap: Snapshot) -> dict[str, Any]:
        """What a failed local write says when the disk is (nearly) full: torch's writer
        reports ENOSPC as "unexpected pos" in its zip container, which tells nobody."""
        free = self.store.free_bytes()
        if free is None or free >= max(snap.nbytes, 1 << 20):
            return {}
        return {
            "disk_full": True,
            "free_bytes": free,
            "transient": False,
            "why": f"no space left for snapshot {snap.step} under {self.store.url} ({free} "
            f"bytes free, this rank's part is about {snap.nbytes}): free space there, lower "
            "persist.keep, or point persist.url elsewhere; the committed snapshots are kept",
        }

    def _retrying(self, what: str, step: int) -> Retrying:
        def before_sleep(state: RetryCallState) -> None:
            err = state.outcome.exception() if state.outcome else None
            self.journal.write(
                "persist_retry",
                step,
                {"op": what, "attempt": state.attempt_number, "error": repr(err)},
            )

        return storage_retry(self.policy, before_sleep)

    def _persist_local(self, task: _Write) -> None:
        """Best effort: a failure here is journaled and the remote write goes on."""
        assert self.local is not None
        snap, local, t0 = task.snap, self.local, time.perf_counter()
        try:
            local.store.write_part(
                snap,
                self.rank,
                self.world_size,
                task.local_keys,
                task.nonce,
                task.native,
                task.texts if self.rank == local.leader else None,
            )
            if self.rank == local.leader:
                local.store.commit(
                    snap.step,
                    self.world_size,
                    task.nonce,
                    self.extra,
                    self.policy.commit_timeout_s,
                    ranks=local.node_ranks,
                )
                local.store.prune(1, None)
                self.journal.write(
                    "persist_local",
                    snap.step,
                    {"url": local.store.url, "seconds": round(time.perf_counter() - t0, 4)},
                )
        except Exception as err:
            self.journal.write(
                "persist_local_failed", snap.step, {"error": repr(err), "url": local.store.url}
            )

    def _persist(self, task: _Write) -> None:
        snap = task.snap
        t0 = time.perf_counter()
        snap.wait()
        if self.local is not None:
            self._persist_local(task)

        def write() -> int:
            return self.store.write_part(
                snap,
                self.rank,
                self.world_size,
                task.keys,
                task.nonce,
                task.native,
                task.texts if self.rank == 0 else None,
            )

        nbytes = self._retrying("write", snap.step)(write)
        written = time.perf_counter() - t0
        if self.rank != 0:
            self.done.add(snap.step)
            return
        manifest = self._retrying("commit", snap.step)(
            self.store.commit,
            snap.step,
            self.world_size,
            task.nonce,
            self.extra,
            self.policy.commit_timeout_s,
        )
        self.done.add(snap.step)
        try:
            self._after_commit(snap, manifest, nbytes, written, t0)
        except Exception as err:  # committed: a failure after it must not discard the step
            self.log.error(
                "snapshot %d is committed and kept, but journaling it or pruning older ones "
                "failed: %r. Older snapshots may pile up at %s: check its free space and "
                "permissions (the next write prunes again)",
                snap.step,
                err,
                self.store.url,
            )
            with contextlib.suppress(Exception):  # the journal's disk may be what failed
                self.journal.write(
                    "persist_prune_failed", snap.step, {"error": repr(err), "url": self.store.url}
                )

    def _after_commit(
        self, snap: Snapshot, manifest: dict[str, Any], nbytes: int, written: float, t0: float
    ) -> None:
        """Journal a committed write and apply retention."""
        self.journal.write(
            "persist",
            snap.step,
            {
                "url": self.store.url,
                "bytes": manifest["bytes"],
                "rank0_bytes": nbytes,
                "write_s": round(written, 4),
                "commit_s": round(time.perf_counter() - t0, 4),
            },
        )
        doomed = self._retrying("prune", snap.step)(
            self.store.retired, self.policy.keep, self.policy.keep_every_steps
        )
        if doomed:  # journaled first: a kill mid-delete leaves the intent on record
            self.journal.write("persist_prune", snap.step, {"deleted_steps": doomed})
            self._retrying("prune", snap.step)(self.store.delete, doomed, snap.step)
