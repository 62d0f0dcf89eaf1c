"""In-place recovery inside the ranks (issue 33; design: docs/dev/issue-33-design.md 3.2,
steps 3-8; the contract with the agent: :mod:`orchestrator.inplace_protocol`).

Under the agent (``ORCHESTRATOR_INPLACE=1``) a dead or hung rank is replaced alone. A
*survivor* sees the broken collective's error in Guard-owned code (``guard.backward``: DDP's
reducer all-reduce; ``guard.step``: the check's all-reduce), waits for the agent's word on
the control store, destroys its process group and joins the next generation's store with
the key layout an env:// init builds, rebinds what held the old group (the Guard's
:class:`Comm`, which every component shares; DDP: its constructor's collectives mirrored and
a new reducer, as ``benchmarks/proto_inplace_ddp.py``), and meets the *replacement* in one
agreement. The replacement runs the user's script from the top: its Guard starts with
collectives answered locally (:attr:`Comm.solo`: the survivors run no start-up) and joins
the agreement at its first ``guard.batches`` instead of resuming.

The agreement (one ``all_gather_object``) picks the step ``S``: the newest one every
survivor holds sealed in its ring and every replacement can load, its own shared-memory
slot where one is kept, else its rank's part of the durable tier (which carries the rank's
own RNG and data position, so the replay is bit for bit). Survivors roll back to their ring
slot ``S``, as an incident's rollback does; the replacement loads ``S`` as a resume does;
then the replicas' digests are compared in one collective before the first step. Anything
that does not fit (another engine, no common step, a digest mismatch, no word from the
agent) re-raises the collective's error: the agent's fallback, a full restart, follows.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from orchestrator import replicas
from orchestrator.comm import forget_for_exit, keep_for_exit
from orchestrator.crashes import collective_failure
from orchestrator.heartbeat import REJOIN
from orchestrator.inplace_protocol import (
    ENV_CONTROL_ADDR,
    NEXT_WAIT_S,
    PG_PREFIX,
    NextGeneration,
    joined_key,
    next_key,
    refused_key,
)
from orchestrator.rejoin_pick import (
    RejoinFailed,
    control_store,
    crc_of,
    group_timeout,
    inplace_on,
    pick,
    replacement_start,
    started_generation,
)
from orchestrator.rejoin_shm import shm_steps, without_node_part

if TYPE_CHECKING:
    from orchestrator.guard import Guard

logger = logging.getLogger(__name__)

DURABLE_TRIED = 3  # the newest durable snapshots a replacement checks (the ring holds fewer)


class Rejoin:
    """The Guard's side of in-place recovery (one per Guard)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.on = inplace_on() and guard.comm.world_size > 1
        self.gen = started_generation() if self.on else 0
        #: A replacement whose agreement is still to come (at its first guard.batches).
        self.replacement = self.on and self.gen > 0
        self.times: dict[str, float] = {}
        #: The inplace_recovery event, journaled once the first step after it committed.
        self.pending: dict[str, Any] | None = None
        self._ddp_sig: tuple[Any, ...] | None = None
        self._shm: dict[int, int] = {}  # a replacement's intact shared-memory slots by step

    # ------------------------------------------------------------------ survivor -------
    def survive(self, err: BaseException) -> bool:
        """A collective failed in the Guard's code: re-form and roll back in place.
        Returns True when the rank goes on (the step is abandoned); False: raise ``err``."""
        if not self.on or not collective_failure(err):
            return False
        g = self.guard
        t_detect = time.time()
        g.heartbeat.enter(REJOIN)  # judged by in_place_timeout_s meanwhile (launch/watch.py)
        why = self._unsupported()
        if why is not None:
            logger.warning("rank %d: no in-place recovery: %s", g.comm.global_rank, why)
            self._refuse(why)
            return False
        try:
            store = control_store()
            store.wait([next_key(self.gen)], timedelta(seconds=NEXT_WAIT_S))
            word = NextGeneration.decode(store.get(next_key(self.gen)))
        except (RuntimeError, dist.DistError, KeyError, ValueError) as wait_err:
            logger.warning("rank %d: no word from the agent (%r)", g.comm.global_rank, wait_err)
            return False
        if word.fallback is not None:
            logger.warning("rank %d: the agent falls back: %s", g.comm.global_rank, word.fallback)
            return False
        self.times = {"detect": t_detect, "leave": time.time(), "fault": word.time}
        try:
            self._rejoin(word, cause=repr(err)[:300])
        except (RejoinFailed, RuntimeError) as failed:
            # A second death during the heal, or no common state: the same on every rank
            # that sees it; the agent falls back to a full restart.
            logger.error("rank %d: in-place recovery failed: %r", g.comm.global_rank, failed)
            self._refuse(f"the re-form or heal failed: {failed!r}"[:500])
            return False
        return True

    def _refuse(self, why: str) -> None:
        """Tell the agent why this survivor gives up (it journals the reason with its
        fallback); best effort: the agent falls back on this rank's death anyway."""
        rank = self.guard.comm.global_rank
        try:
            control_store().set(refused_key(self.gen, rank), why)
        except (RuntimeError, dist.DistError) as e:
            logger.warning("rank %d: could not tell the agent why (%r)", rank, e)

    def _rejoin(self, word: NextGeneration, cause: str) -> None:
        """Re-form on the next generation, rebind the groups' holders, then agree."""
        g = self.guard
        live = g.global_step
        self._reform(word)
        g.engine.rebind()
        if g.health is not None:
            # Its own group died with the world: built again as the replacement's start
            # builds it, at the same point (after DDP's constructor, before the agreement).
            g.health.__init__(g.health.policy, g.comm, g.run_dir)  # type: ignore[misc]
        self.times["reform"] = time.time()
        g.engine.abandon()
        self._agree(word, live, cause)

    def _unsupported(self) -> str | None:
        """Why this rank cannot rebind its groups (None: it can)."""
        g = self.guard
        if g.comm.group is not dist.group.WORLD:
            return "the Guard runs on a subgroup (process_group=...): only the world is rebuilt"
        why = g.engine.rebind_unsupported()
        if why is not None:
            return why
        if g.investigation.active or g.recovery.open is not None:
            return "an incident was open"
        return None

    def _reform(self, word: NextGeneration) -> None:
        """Leave the broken group and join generation ``word.gen``'s, with the same rank,
        world size, backend and timeout; the Guard's Comm takes the new world group."""
        g = self.guard
        backend, timeout = dist.get_backend(), group_timeout()
        rank, world = dist.get_rank(), dist.get_world_size()
        forget_for_exit(g.comm.group)
        dist.destroy_process_group()
        client = dist.TCPStore(
            os.environ[ENV_CONTROL_ADDR], word.port, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(PG_PREFIX, client),
            rank=rank,
            world_size=world,
            timeout=timeout,
        )
        self.gen = word.gen
        g.comm.group = dist.group.WORLD
        keep_for_exit(g.comm.group)

    # ------------------------------------------------------------------ replacement ----
    def join(self) -> int:
        """The replacement's start, instead of a resume: meet the survivors' agreement and
        load the agreed step. Returns the step to run next."""
        g = self.guard
        self.times = {"start": time.time()}
        g.comm.solo = False
        g._suspect = None  # the dead process's marker: not this batch's doing
        self.replacement = False
        self._agree(None, None, cause=None)
        return g.global_step

    # ------------------------------------------------------------------ both -----------
    def _say(self, live: int | None) -> dict[str, Any]:
        """What this rank brings to the agreement."""
        g = self.guard
        said: dict[str, Any] = {"rank": g.comm.global_rank, "replacement": live is None}
        if live is not None:
            said["live"] = live
            said["ring"] = sorted(s.step for s in g.ring.snapshots() if s.sealed)
            said["token"] = getattr(g.durable, "_token", None)
        else:
            said["durable"] = self._durable_steps()
            self._shm = shm_steps(g.shm)  # its rank's slots, left by the dead process
            said["shm"] = sorted(self._shm)
            # A peer's copy fits where every rank holds the same state and data position.
            said["peer"] = g.engine.state_replicated and g.cursor.position()[1] is None
        return said

    def _durable_steps(self) -> dict[int, dict[str, Any]]:
        """The newest committed durable snapshots whose files this rank loads from (its
        part, and the shared one where the state is replicated; sizes and checksums
        checked), with their manifests."""
        g = self.guard
        found: dict[int, dict[str, Any]] = {}
        try:
            candidates = g.durable.store.candidates()
            listed = sorted(
                ((c.step, c.manifest) for c in candidates if c.committed and c.manifest),
                key=lambda sm: sm[0],
                reverse=True,
            )[:DURABLE_TRIED]
        except Exception as err:  # unreadable storage: no durable source
            logger.warning("rank %d: durable tier unreadable: %r", g.comm.global_rank, err)
            return found
        # Sharded state (FSDP2, ZeRO): the rank loads its own part alone (durable_resume's
        # _load), so rank 0's part, torn or not, does not decide whether the step is a source.
        parts = sorted({0, g.comm.rank}) if g.engine.state_replicated else [g.comm.rank]
        for step, manifest in listed:
            try:
                g.durable.store.validate_files(step, manifest, parts)
                found[step] = manifest
            except Exception as err:  # a part lost or torn: that step is no source here
                logger.warning("rank %d: durable step %d: %r", g.comm.global_rank, step, err)
        return found

    def _agree(self, word: NextGeneration | None, live: int | None, cause: str | None) -> None:
        """The one agreement of a re-formed group, the rollback or load, the verification."""
        g = self.guard
        said = g.comm.all_gather_object(self._say(live))
        step, sources = pick(said)
        without_node_part(g)  # before the replacement's ring takes the agreed step
        mine = sources[g.comm.global_rank]
        token = next(s["token"] for s in said if not s["replacement"])
        if live is None:
            g.durable._token = token  # this run's writes, named as the survivors name them
        if mine == "durable":
            self._load_durable(step, said[g.comm.rank]["durable"][step])
        elif mine == "shm" and g.shm is not None:
            self._load_tree(step, g.shm.load(self._shm[step]), f"shm://{g.shm.root}")
        elif live is not None:
            self._roll_back(step)
        if "peer" in sources.values():
            self._peer_heal(step, said, sources)
        self._verify(step)
        self.times["heal"] = time.time()
        self._finish(word, said, step, mine, cause)

    def _roll_back(self, step: int) -> None:
        """A survivor back to its ring slot ``step``, as an incident's rollback."""
        g = self.guard
        snap = g.ring.at(step)
        assert snap is not None
        g.engine.restore(snap, 1.0)
        meta = snap.materialize("guard", clone=False)
        data = snap.materialize("data", clone=True) if "data" in snap.skeleton else None
        g.cursor.rewind(step, meta, data)
        g.adjuster.load_state_dict(meta["adjust"])
        g.user_state.restore(snap)
        g.ring.drop_after(step)
        g.durable.invalidate_after(step)
        g.metrics.drop_update()
        g.metrics.restart_clock()
        g._rolled_back(step)

    def _load_durable(self, step: int, manifest: dict[str, Any]) -> None:
        """The replacement's state at ``step`` from its rank's part of the durable tier
        (files checked against the manifest's checksums), loaded as a resume loads it."""
        g = self.guard
        durable = g.durable
        tree, error, _ = durable._load(durable.store, step, manifest, None, 0)
        if tree is None:
            raise RejoinFailed(f"rank {g.comm.global_rank}: durable snapshot {step}: {error}")
        self._load_tree(step, tree, durable.store.url)

    def _peer_heal(self, step: int, said: list[dict[str, Any]], sources: dict[int, str]) -> None:
        """The replicated state of ``step`` from the first survivor's ring slot, in one
        broadcast with its CRC32 first checked by the receivers. The rank's own RNG and
        data position are not on the peer: the survivor's RNG is taken (journaled)."""
        g = self.guard
        src = next(s["rank"] for s in said if not s["replacement"])
        sent = None
        if g.comm.global_rank == src:
            snap = g.ring.at(step)
            assert snap is not None
            tree = {k: snap.materialize(k, clone=False) for k in snap.skeleton}
            sent = (crc_of(tree), tree)
        crc, tree = g.comm.broadcast_object(sent, src_rank=src)
        if sources[g.comm.global_rank] != "peer":
            return
        if crc_of(tree) != crc:
            raise RejoinFailed(
                f"rank {g.comm.global_rank}: the state rank {src} sent for step {step} does "
                "not match its checksum: in-place recovery falls back"
            )
        self._load_tree(step, tree, f"peer://rank{src}")

    def _load_tree(self, step: int, tree: dict[str, Any], url: str) -> None:
        """Load a whole state ``tree`` of ``step`` as a resume does (the ring's first slot)."""
        g = self.guard
        keeper, durable = g.keeper, g.durable
        snap = keeper._resumed_snapshot(step, tree)
        keeper._restore_resumed(snap, step, url)
        snap.digest = keeper.digest()
        snap.agreed = True  # compared below, as the survivors' slot of this step was
        g.cursor.rewind(step, tree["guard"], tree.get("data"))
        g.adjuster.load_state_dict(tree["guard"]["adjust"])
        g.user_state.restore(snap)
        durable.invalidate_after(step)
        g._rolled_back(step)

    def _verify(self, step: int) -> None:
        """The replicas' digests of the restored state, compared in one collective."""
        g = self.guard
        tensors, alike = g.engine.digest_tensors()
        if not alike:
            return
        d = replicas.digest(tensors)
        mine = None if d is None else int(d)
        if any(d != mine for d in g.comm.all_gather_object(mine)):
            raise RejoinFailed(
                f"rank {g.comm.global_rank}: the replicas' state differs after healing at "
                f"step {step}: in-place recovery falls back"
            )

    def _finish(
        self,
        word: NextGeneration | None,
        said: list[dict[str, Any]],
        step: int,
        source: str,
        cause: str | None,
    ) -> None:
        """Count this rank in, and journal the recovery once (rank 0 of the new group)."""
        g = self.guard
        sources = g.comm.all_gather_object((source, self.times, cause, word))
        control_store().add(joined_key(self.gen), 1)
        word = word or next(w for _, _, _, w in sources if w is not None)
        why = {
            "ring": "a survivor: its ring slot of the agreed step",
            "shm": "a replacement: its rank's shared-memory slot of the agreed step, left "
            "by the dead process and checked by CRC32 (its own RNG and data position)",
            "durable": "a replacement: its rank's durable snapshot of the agreed step (its "
            "own RNG and data position: bit for bit)",
            "peer": "a replacement: a survivor's ring slot, broadcast and checked by CRC32 "
            "(no durable snapshot of that step; its RNG is the survivor's)",
        }
        times = [t for _, t, _, _ in sources]
        detect = min((t["detect"] for t in times if "detect" in t), default=None)
        self.pending = dict(
            step=step,
            generation=self.gen,
            replaced=list(word.replaced),
            cause=word.cause,
            error=next((c for _, _, c, _ in sources if c), None),
            sources={str(s["rank"]): {"source": src, "why": why[src]}
                     for s, (src, _, _, _) in zip(said, sources, strict=True)},
            times={
                "fault": word.time or None,
                "detect": detect,
                "leave": max((t["leave"] for t in times if "leave" in t), default=None),
                "reform": max((t["reform"] for t in times if "reform" in t), default=None),
                "heal": max(t["heal"] for t in times),
            },
        )  # fmt: skip
        g._resumed = True

    def first_step(self) -> None:
        """The first step after the recovery committed: journal it, with that time."""
        assert self.pending is not None
        details, self.pending = self.pending, None
        details["times"]["first_step"] = time.time()
        self.guard._decide("inplace_recovery", details.pop("step"), **details)


__all__ = ["Rejoin", "RejoinFailed", "inplace_on", "replacement_start", "started_generation"]
