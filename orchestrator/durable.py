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
from orchestrator.engines import Engine
from orchestrator.errors import PersistError
from orchestrator.policy import PersistPolicy
from orchestrator.protocol import local_tier_key
from orchestrator.retry import is_transient, storage_retry
from orchestrator.shm import ShmSlots, agreeable
from orchestrator.snapshot import Snapshot
from orchestrator.store import SNAPSHOT_ERRORS, DurableStore, default_url, signing_key
from orchestrator.tuning import Intervals
from orchestrator.writer import LocalTier, Persister

#: A state tree to restore, the manifest it came with, and the store URL it came from.
Resumable = tuple[dict[str, Any], dict[str, Any], str]


class DurableTier:
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

    # --- resume ---------------------------------------------------------------------------
    def find_resume(self) -> Resumable | None:
        """The newest snapshot valid on every rank (collective), or None if there is none.

        Raises:
            PersistError: committed snapshots exist but none is valid (starting from
                scratch silently could throw away days of training).
        """
        listing, unreachable = None, None
        if self.comm.rank == 0:
            try:
                listing = [
                    (c.step, c.manifest, c.problem)
                    for c in storage_retry(self.policy)(self.store.candidates)
                    if c.committed
                ]
            except Exception as err:
                unreachable = f"cannot list {self.store.url}: {err!r}"
        listing, unreachable = self.comm.broadcast_object((listing, unreachable))
        if unreachable is not None:
            raise self._unreachable(unreachable)
        assert listing is not None
        newest_remote = listing[0][0] if listing else -1
        in_shm = self._find_shm(newest_remote)
        if in_shm is not None:
            return in_shm
        local = self._find_local(newest_remote)
        if local is not None:
            return local
        rejected: list[tuple[int, list[str]]] = []
        for step, manifest, problem in listing:
            tree, error, transient = self._load(self.store, step, manifest, problem, 0)
            said = self.comm.all_gather_object((error, transient))
            errors = [e for e, _ in said if e]
            unreadable = [e for e, t in said if t]
            if unreadable:  # not invalid: unreadable now (a restart retries)
                raise self._unreachable(unreadable[0])
            if errors:
                rejected.append((step, errors))
                self.event("snapshot_invalid", snapshot_step=step, reasons=errors)
                continue
            assert tree is not None and manifest is not None
            return tree, manifest, self.store.url
        if not rejected and self.refused:
            # Slots were left in the node's shared memory (a crash of this job) and none
            # could be used: starting from scratch would silently throw that work away.
            raise PersistError(
                f"the node's shared-memory ring holds snapshots of this run but none can be "
                f"used ({len(self.refused)} refused; first: {self.refused[0]}) and there is no "
                f"durable snapshot under {self.store.url}. To start over anyway use "
                "`orchestrator launch --fresh` or persist.resume: false; to resume, start on "
                "the same nodes at the same world size"
            )
        if rejected:
            raise PersistError(
                f"{len(rejected)} committed snapshot(s) under {self.store.url}, none valid "
                f"(steps {[s for s, _ in rejected]}; first reason: {rejected[0][1][0]}). "
                "To start from scratch anyway set persist.resume: false or use another "
                "persist.url; to keep them, check the storage and run "
                f"`orchestrator snapshots {self.store.url}`"
            )
        return None

    def _unreachable(self, why: str) -> PersistError:
        """Journal (``storage_unreachable``) and return the error that stops the start."""
        self.event("storage_unreachable", error=why, url=self.store.url)
        return PersistError(
            f"the durable store cannot be read ({why}; transient errors retried up to "
            f"persist.retries={self.policy.retries} times): not resuming from an older "
            "snapshot nor from scratch, which could lose training. Under `orchestrator "
            "launch` the next attempt tries again; otherwise run the same command once the "
            "storage is back (or fix its permissions)"
        )

    def _find_shm(self, newest_remote: int) -> Resumable | None:
        """The node's shared-memory ring: the newest step every rank has sealed there whose
        bytes match their checksum on every rank, if not older than the newest durable
        snapshot. Refused slots are said in ``self.refused`` (the resume event shows it)."""
        if self.shm is None:
            return None
        steps, refused = self.shm.candidates()
        seen = self.comm.all_gather_object(({s: t for s, (_, t) in steps.items()}, refused))
        order, self.refused = agreeable(seen, newest_remote)  # alike on every rank
        for step in order:
            why = self.shm.check(steps[step][0])
            tree = None
            if why is None:
                try:
                    tree = self.shm.load(steps[step][0])
                except Exception as err:  # never raises before the agreement
                    why = f"step {step}: {err}"
            errors = [f"rank {r}: {e}" for r, e in enumerate(self.comm.all_gather_object(why)) if e]
            if errors:
                self.refused += errors
                continue
            assert tree is not None
            return tree, {"world_size": self.comm.world_size}, f"shm://{self.shm.root}"
        return None

    def _find_local(self, newest_remote: int) -> Resumable | None:
        """The node-local tier, if every rank has the same valid step there and it is not
        older than the newest remote snapshot."""
        if self.local is None:
            return None
        found: tuple[int, dict[str, Any]] | None = None
        for c in self.local.store.candidates():
            if c.committed and c.manifest is not None:
                found = (c.step, c.manifest)
                break
        tree = None
        if found is not None and found[0] >= newest_remote:
            tree, _, _ = self._load(self.local.store, *found, None, self.local.leader)
        steps = self.comm.all_gather_object(found[0] if tree is not None and found else None)
        if steps[0] is None or any(s != steps[0] for s in steps):
            return None
        assert tree is not None and found is not None
        return tree, found[1], self.local.store.url

    def _load(
        self,
        store: DurableStore,
        step: int,
        manifest: dict[str, Any] | None,
        problem: str | None,
        shared_rank: int,
    ) -> tuple[dict[str, Any] | None, str | None, bool]:
        """This rank's state from one snapshot (the shared state from ``shared_rank``'s
        part), or why it cannot be used and whether that may pass (storage unreachable, not
        the snapshot invalid). Never raises, so every rank reaches the agreement that
        follows."""
        rank = self.comm.rank
        try:
            if manifest is None:
                raise PersistError(problem or f"snapshot {step}: manifest.json is unreadable")
            saved = manifest.get("ranks") or list(range(int(manifest["world_size"])))
            own = rank if rank in saved else shared_rank  # a new rank takes the shared RNG
            sharded = not self.engine.state_replicated
            if sharded and int(manifest["world_size"]) != self.comm.world_size:
                if not self.engine.can_reshard:
                    raise PersistError(
                        f"snapshot {step} holds shards of {manifest['world_size']} ranks and "
                        f"{self.engine.name} cannot reshard: resume at that world size"
                    )

                def reshard() -> dict[str, Any]:
                    store.validate_files(step, manifest, saved)
                    parts = [store.load_part(step, r) for r in saved]
                    return self.engine.reshard(parts, saved.index(own))

                return storage_retry(self.policy)(reshard), None, False

            # Sharded state: each rank reads its own part only.
            first = own if sharded else shared_rank

            def read() -> dict[str, Any]:
                store.validate_files(step, manifest, sorted({first, own}))
                tree = store.load_part(step, first)
                if own != first:
                    tree.update(store.load_part(step, own))
                return tree

            return storage_retry(self.policy)(read), None, False
        except SNAPSHOT_ERRORS as err:  # anything wrong with this snapshot: try an older one
            return None, f"rank {rank}: {err}", is_transient(err)

    def tier_of(self, url: str) -> str:
        if url.startswith("shm://"):
            return "shm"
        return "local" if self.local is not None and url == self.local.store.url else "remote"
