"""The Guard's durable tier: when to persist, what each rank writes, and resume on start.

Storage itself is in :mod:`orchestrator.store` (written by :mod:`orchestrator.writer`); this
module holds the decisions, which must be identical on every rank. They are functions of
the step and of the step's all-reduced control slots only (rank 0's persist timer, any
writer busy, any write failed), never of a rank's own writer state, so no rank ever waits
for a part that another rank decided not to write.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from orchestrator.context import Context
from orchestrator.detect import PERSIST_BUSY, PERSIST_FAILED, PERSIST_REQUEST
from orchestrator.durable_resume import Resumable, ResumeFinder
from orchestrator.engines import Engine
from orchestrator.errors import PersistError
from orchestrator.policy import PersistPolicy
from orchestrator.protocol import local_tier_key
from orchestrator.shm import ShmSlots
from orchestrator.snapshot import Snapshot
from orchestrator.store import DurableStore, default_url, signing_key
from orchestrator.tuning import Intervals
from orchestrator.writer import LocalTier, Persister

__all__ = ["DurableTier", "Resumable"]


class DurableTier(ResumeFinder):
    def __init__(
        self,
        ctx: Context,
        persist: PersistPolicy,
        engine: Engine,
        event: Callable[..., None],
        *,
        intervals: Intervals,
        policy_digest: str,
        shm: ShmSlots | None = None,
    ) -> None:
        comm, journal, run_dir = ctx.comm, ctx.journal, ctx.run_dir
        self.policy = persist
        # The persist interval in force (every_steps: auto changes it while training).
        self.intervals = intervals
        self.shm = shm  # the ring's shared-memory slots, when snapshot.shared_memory
        self.refused: list[str] = []  # why newer snapshots were not resumed from
        self.comm = comm
        self.engine = engine
        self.event = event  # journals a collective decision once (rank 0)
        self.store = DurableStore(
            self.policy.url or default_url(run_dir),
            key=signing_key(self.policy.signing_key_file),
        )
        self.local = (
            self._local_tier(run_dir) if self.policy.enabled and self.policy.local_dir else None
        )
        self.persister: Persister | None = None
        self._extra = {"policy_digest": policy_digest, "engine": engine.name}
        if self.policy.enabled:
            self.persister = Persister(
                self.policy,
                self.store,
                comm.rank,
                comm.world_size,
                journal,
                extra=self._extra,
                local=self.local,
            )
        self.submitted = 0  # writes handed to the writer by on_sealed (the tuner counts them)
        self.requested = False  # persist the next sealed snapshot (rank 0's timer said so)
        self.busy = False  # some rank's writer was busy at the last all-reduce
        self.held: Snapshot | None = None  # handed to the writers, not yet released
        self.mark = 0  # newest sealed step considered for persisting
        self._last_time = time.monotonic()
        # Names this run's writes, so no part of an earlier attempt is ever committed.
        self._token = comm.broadcast_object(os.urandom(4).hex())

    # --- the per-step control slots -------------------------------------------------------
    def control(self) -> tuple[float, float, float]:
        """Local (persist request, write failed, writer busy) for the step's all-reduce."""
        if self.persister is None:
            return 0.0, 0.0, 0.0
        every_s = self.policy.every_s
        timer = (
            every_s is not None
            and self.comm.rank == 0  # one clock decides; the all-reduce tells the others
            and time.monotonic() - self._last_time >= every_s
        )
        return float(timer), float(self.persister.failed), float(self.persister.busy)

    def observe(self, vals: list[float], step: int) -> None:
        """Act on the all-reduced control slots (identical on every rank).

        Raises:
            PersistError: a write failed on some rank and ``persist.required`` is set.
        """
        if vals[PERSIST_REQUEST] > 0:
            self.requested = True
            self._last_time = time.monotonic()
        self.busy = vals[PERSIST_BUSY] > 0
        if not self.busy and self.held is not None:
            if vals[PERSIST_FAILED] > 0 and self.persister is not None:
                # Its write failed somewhere: it will never commit, and its parts on the
                # ranks whose writes succeeded would only fill the storage.
                self.persister.discard(self.held.step)
            self.held.held = False  # every rank's writer is done with it: same step on all
            self.held = None
        if vals[PERSIST_FAILED] > 0 and self.policy.required:
            self.event("persist_required_failed", url=self.store.url)
            raise PersistError(
                f"[step {step}] a durable snapshot could not be written to {self.store.url} "
                "and persist.required is true: fix the storage (see persist_failed in the "
                "journal) and restart; training resumes from the newest committed snapshot"
            )

    # --- persisting -----------------------------------------------------------------------
    def on_sealed(self, snap: Snapshot, rollbacks: int) -> None:
        """Persist ``snap`` if it is due, unless a write is still in flight somewhere."""
        every = self.intervals.persist_steps
        crossed = every is not None and snap.step // every > self.mark // every
        self.mark = max(self.mark, snap.step)
        if self.persister is None or not (crossed or self.requested):
            return
        if self.busy or self.held is not None:
            self.event("persist_skipped", snapshot_step=snap.step, reason="previous write busy")
            return
        self.requested = False
        snap.held = snap.persisted = True
        self.held = snap
        self.submitted += 1
        self.persister.submit(
            snap,
            self._part_keys(snap, writer=0),
            self._part_keys(snap, writer=self.local.leader if self.local else 0),
            nonce=f"{self._token}-{rollbacks}",
            native=self.engine.native_files(snap.step),
            texts=self.engine.native_texts(snap.step),
        )

    def persist_now(
        self,
        capture: Callable[[], Snapshot | None],
        rollbacks: int,
        timeout_s: float,
        beat: Callable[[], None],
        together: bool = False,
    ) -> bool:
        """Outside the step protocol (end of run, preemption): wait for this rank's writer,
        snapshot the current state, persist it and wait for that too, each wait bounded by
        ``timeout_s`` and calling ``beat`` so the supervisor sees the rank alive.
        ``together``: the snapshot's buffers are shared with other ranks (a node part in
        shared memory), so every rank's writer must be idle before any captures, and every
        rank must have captured before any writes (two all-reduces).

        Returns:
            True if this snapshot was written (on rank 0: committed).
        """
        if self.persister is None:
            return False
        idle = self._wait(timeout_s, beat)
        if together:
            idle = not self.comm.all_reduce_max(0 if idle else 1)
        if not idle:
            return False  # a writer still reads the held snapshot: do not reuse it
        if self.held is not None:
            self.held.held = False
            self.held = None
        self.busy = False
        snap = capture()
        if snap is not None:
            snap.wait()  # its copies landed (a page-locked node part: asynchronous ones)
        if together and self.comm.all_reduce_max(0 if snap is not None else 1):
            return False  # (after every rank's share of the node part is copied)
        if snap is None:
            return False
        snap.sealed = True  # its own step is not run: finiteness is checked on load instead
        self.requested = True
        self.on_sealed(snap, rollbacks)
        return self._wait(timeout_s, beat) and snap.step in self.persister.done

    def settle(self) -> bool:
        """Wait (up to persist.commit_timeout_s) until this rank's writes in flight are done;
        True when they are (or nothing persists)."""
        p = self.persister
        return p is None or p.wait_idle(self.policy.commit_timeout_s)

    def _wait(self, timeout_s: float, beat: Callable[[], None]) -> bool:
        assert self.persister is not None
        deadline = time.monotonic() + timeout_s
        while not self.persister.wait_idle(min(1.0, max(deadline - time.monotonic(), 0))):
            beat()
            if time.monotonic() >= deadline:
                return False
        return True

    def plan(self, snap: Snapshot) -> dict[str, Any]:
        """What this rank's durable part of ``snap`` holds, for a writer outside the process
        (orchestrator/flush.py writes a shared-memory slot as this rank's writer would)."""
        return {
            "keys": self._part_keys(snap, writer=0),
            "native": self.engine.native_files(snap.step),
            "texts": self.engine.native_texts(snap.step),
            "extra": self._extra,
        }

    def _part_keys(self, snap: Snapshot, writer: int) -> list[str]:
        """What this rank writes when rank ``writer`` holds the shared (replicated) state."""
        return self.engine.part_keys(list(snap.skeleton), holds_shared=self.comm.rank == writer)

    def _local_tier(self, run_dir: str) -> LocalTier:
        """Group the ranks by host: each node keeps its own copy under persist.local_dir."""
        hosts = self.comm.all_gather_object(socket.gethostname())
        node_ranks = [r for r, h in enumerate(hosts) if h == hosts[self.comm.rank]]
        run_key = local_tier_key(run_dir)
        assert self.policy.local_dir is not None
        url = f"{self.policy.local_dir.rstrip('/')}/{run_key}"
        store = DurableStore(url, key=self.store.key)
        return LocalTier(store, leader=min(node_ranks), node_ranks=node_ranks)

    def invalidate_after(self, step: int) -> None:
        """Durable snapshots newer than ``step`` belong to a timeline that was abandoned
        (rolled back, or not valid on resume): never resume from them."""
        self.mark = step
        if self.persister is not None:
            self.persister.invalidate_after(step)

    def close(self, abandon: Callable[[], bool] | None = None) -> bool:
        """Let the write in flight finish (at most ``persist.commit_timeout_s``); with
        ``abandon``, stop waiting as soon as it says so (the step stays uncommitted).
        True if nothing was left in flight."""
        return self.persister is None or self.persister.close(self.policy.commit_timeout_s, abandon)
