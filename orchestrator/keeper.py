"""The state keeper: snapshots of this rank's state into the host ring, the durable
snapshot written outside the step protocol (end of run, preemption), and the resume at
start. Every snapshot holds the Guard's counters and the shared data position under the
``guard`` key, a user pipeline's per-rank loader state under ``data``, and the user's own
registered objects under ``user`` (:mod:`orchestrator.stateful`).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from orchestrator import replicas
from orchestrator.adjust import LRAdjuster
from orchestrator.context import Context
from orchestrator.cursor import DataCursor
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine
from orchestrator.errors import PersistError
from orchestrator.heartbeat import Heartbeat
from orchestrator.policy import (
    DetectPolicy,
    PersistPolicy,
    Policy,
    SnapshotPolicy,
    SupervisorPolicy,
)
from orchestrator.shm import ShmSlots
from orchestrator.snapshot import Snapshot, SnapshotRing
from orchestrator.startup import MemoryBudget
from orchestrator.stateful import USER_KEY, UserState, tensors_in

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeeperPolicy:
    """The policy sections the keeper reads, named as the :class:`Policy`'s: ``snapshot``
    (sealing), ``detect`` (replica digests), ``persist`` and ``supervisor`` (how long a
    final write may take)."""

    snapshot: SnapshotPolicy
    detect: DetectPolicy
    persist: PersistPolicy
    supervisor: SupervisorPolicy

    @classmethod
    def of(cls, p: Policy) -> KeeperPolicy:
        return cls(p.snapshot, p.detect, p.persist, p.supervisor)


class StateKeeper:
    def __init__(
        self,
        ctx: Context,
        policy: KeeperPolicy,
        engine: Engine,
        ring: SnapshotRing,
        durable: DurableTier,
        *,
        cursor: DataCursor,
        adjuster: LRAdjuster,
        heartbeat: Heartbeat,
        shm: ShmSlots | None = None,
        user: UserState | None = None,
        budget: MemoryBudget | None = None,
    ) -> None:
        self.policy, self.comm, self.engine, self.ring = policy, ctx.comm, engine, ring
        decide = ctx.decide
        self.user = user if user is not None else UserState()
        self.durable, self.cursor, self.adjuster = durable, cursor, adjuster
        self.heartbeat, self.decide, self.shm = heartbeat, decide, shm
        self.budget = budget  # the ring's host memory (the Guard's; None in bare tests)
        # Snapshots keep what every rank holds alike once per node, each rank copying its
        # share: nobody may read the whole before every rank has copied. In training the
        # step's all-reduce orders that: it is queued after the fence, so on a GPU no rank's
        # contribution leaves before its asynchronous copies into the (page-locked) node
        # part have landed, and every rank's host waits for the all-reduce. Resume copies
        # from the host (synchronous); persist_now waits for its own copies before its
        # all-reduce.
        self._shares_node = shm is not None and len(shm.node_ranks or []) > 1
        self.stalls: collections.deque[float] = collections.deque(maxlen=20)  # recent, seconds

    def _sealed(
        self, snap: Snapshot, checked_through: int | None = None, rollbacks: int = 0
    ) -> None:
        """A snapshot is sealed (the steps after it, through ``checked_through``, were
        finite): in shared memory, its slot gets its verdict (a restart on this node may
        use it from now on)."""
        if self.shm is not None:
            plan = self.durable.plan(snap)
            self.shm.seal(snap, self._seal_failed, plan, checked_through, rollbacks)

    def _seal_failed(self, err: Exception) -> None:
        logger.warning(
            "cannot write a shared-memory snapshot's verdict under %s (%r): a restart will "
            "not use that slot; check the free space of snapshot.shm_dir",
            self.shm.root if self.shm else "?",
            err,
        )

    def _alike(self, state: dict[str, Any]) -> frozenset[str]:
        """The keys of ``state`` every rank holds alike (those the durable tier takes from
        rank 0 only): in shared memory, kept once per node."""
        if self.shm is None:
            return frozenset()
        keys = list(state)
        return frozenset(keys) - set(self.engine.part_keys(keys, holds_shared=False))

    def capture(self, step: int, initial: bool = False) -> Snapshot | None:
        """Copy the state at ``step`` into the ring (asynchronously where the device allows);
        the starting state (``initial``) is trusted as is, so it is sealed at once."""
        t0 = time.perf_counter()
        state = self.engine.state()
        # The Guard's counters and the data position: shared by every rank (the Guard's
        # sampler: samples of the unfiltered order, valid at any world size), or this
        # rank's own (a user pipeline's loader state).
        shared, local = self.cursor.position()
        state["guard"] = {"step": step, **shared, "adjust": self.adjuster.state_dict()}
        if local is not None:
            state["data"] = local
        user = self.user.state()
        if user is not None:
            state[USER_KEY] = user
        # The loop body may update the user's objects in place before the step's fence
        # (a counter before guard.step): their copies land before it runs, as the buffers'.
        written = [*self.engine.forward_writes(), *tensors_in(user)]
        volatile = frozenset(t.data_ptr() for t in written)
        snap = self.ring.capture(step, state, self._alike(state), volatile)
        if snap is not None:
            snap.digest = self.digest()
        if snap is None:
            # Every slot is either the newest sealed one or still being persisted.
            self.decide(
                "snapshot_skipped",
                step,
                reason="every ring slot holds the newest sealed snapshot or one still being "
                "written to durable storage; raise snapshot.keep (3 when persisting often)",
            )
            return None
        if initial:
            # Rolling back to the starting state is a restart.
            snap.wait()
            snap.sealed = True
            self._sealed(snap)
        stall_s = time.perf_counter() - t0
        if not initial:
            self.stalls.append(stall_s)  # what an automatic interval weighs (tuning.py)
        self.decide(
            "snapshot",
            step,
            tier="shm" if self.shm is not None else "memory",
            bytes=snap.nbytes,
            copied_bytes=snap.copied,  # rank 0's; less where a node part is shared
            stall_ms=round(stall_s * 1e3, 3),
            initial=initial,
        )
        return snap

    def digest(self) -> torch.Tensor | None:
        """The live state's digest (:mod:`orchestrator.replicas`), queued on its device;
        None with ``detect.replicas`` off."""
        if not self.policy.detect.replicas.enabled:
            return None
        return replicas.digest(self.engine.digest_tensors()[0])

    def seal_through(self, step: int, rollbacks: int) -> None:
        """Step ``step`` is committed: seal the snapshots old enough (the steps after them
        were finite) and hand the durable tier those it should persist."""
        for snap in self.ring.seal_through(step, self.policy.snapshot.seal_after_steps):
            self._sealed(snap, checked_through=step, rollbacks=rollbacks)
            self.durable.on_sealed(snap, rollbacks)

    def persist_now(self, step: int, rollbacks: int, phase: str) -> bool:
        """Snapshot the current state and write it to durable storage, waiting for it
        (bounded by ``persist.commit_timeout_s``, and by ``supervisor.grace_s`` when
        preempting; the heartbeat says ``phase`` meanwhile). True if it was written."""
        p = self.policy
        timeout_s = p.persist.commit_timeout_s
        if phase == "preempting":
            timeout_s = min(p.supervisor.grace_s, timeout_s)
        return self.durable.persist_now(
            lambda: self.capture(step),
            rollbacks,
            timeout_s=timeout_s,
            beat=lambda: self.heartbeat.beat(step, phase=phase, force=True),
            together=self._shares_node,
        )

    def check_budget(self) -> None:
        """Before the first snapshot (at the first ``guard.batches``): the ring's host-memory
        budget counts the user's objects registered since the Guard was built, and fails
        as at the start if they do not fit (collective).

        Raises:
            PolicyError: the ring, their state included, does not fit this host.
        """
        if self.budget is not None:
            self.budget.check(again=True)

    def resume(self) -> int | None:
        """Load the newest valid durable snapshot (collective) into the live state (engine,
        data position, LR adjuster) and make it the ring's first, sealed, snapshot. Returns
        its step, or None when there is nothing to resume from.

        Raises:
            PersistError: a snapshot was found but does not fit this model or optimizer.
        """
        found = self.durable.find_resume()
        if found is None:
            return None
        tree, manifest, url = found
        g = tree["guard"]
        step = int(g["step"])
        snap = self._resumed_snapshot(step, tree)
        self._restore_resumed(snap, step, url)
        snap.digest = self.digest()  # of the state as loaded: compared at its first check
        local = tree.get("data")
        self.cursor.rewind(step, g, local)
        self.adjuster.load_state_dict(g["adjust"])
        self.user.restore(snap)
        self.durable.invalidate_after(step)
        self._journal_resume(step, url, manifest, g, local is not None)
        return step

    def _resumed_snapshot(self, step: int, tree: dict[str, Any]) -> Snapshot:
        """The loaded ``tree`` as the ring's first snapshot, copied in and sealed
        (collective where ranks share a node's memory)."""
        snap = self.ring.capture(step, tree, self._alike(tree))
        assert snap is not None  # the ring is empty at start
        if self._shares_node:
            self.comm.all_reduce_max(0)  # every rank's share copied before any restores
        snap.wait()
        snap.sealed = True
        self._sealed(snap)
        return snap

    def _restore_resumed(self, snap: Snapshot, step: int, url: str) -> None:
        """Restore the resumed snapshot into the engine, or say that it does not fit."""
        try:
            self.engine.restore(snap, 1.0)
        except (RuntimeError, KeyError, ValueError) as err:
            raise PersistError(
                f"snapshot {step} under {url} does not fit this model or optimizer ({err}). "
                "Resume with the model it was written by, or set persist.resume: false (or "
                "another persist.url) to start from scratch"
            ) from err

    def _journal_resume(
        self, step: int, url: str, manifest: dict[str, Any], g: dict[str, Any], per_rank: bool
    ) -> None:
        """Journal the resume at ``step`` and, on rank 0, say what it restored and how to
        start over instead (``per_rank``: the data position is each rank's loader's)."""
        self.decide(
            "resume",
            step,
            snapshot_step=step,
            url=url,
            tier=self.durable.tier_of(url),
            refused=self.durable.refused,
            saved_world_size=manifest["world_size"],
            world_size=self.comm.world_size,
            **{k: g[k] for k in ("epoch", "offset") if k in g},
            data_position="per rank" if per_rank else "shared",
        )
        if self.comm.rank == 0:
            mult = self.adjuster.multiplier()
            logger.warning(
                "RESUMED at step %d from the %s snapshot %s (saved at world size %s). From the "
                "snapshot: model, optimizer, scheduler%s, RNG, data position (%s)%s. To start "
                "over instead: `orchestrator launch --fresh` or another run dir",
                step,
                self.durable.tier_of(url),
                url,
                manifest["world_size"],
                " and loss scale" if self.engine.has_loss_scaler else "",
                "the loader's state" if per_rank else f"epoch {g['epoch']}, offset {g['offset']}",
                f", LR multiplier {mult:g}" if mult != 1.0 else "",
            )
