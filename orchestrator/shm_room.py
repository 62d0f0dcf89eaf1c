"""Where the snapshot ring lives: node shared memory or the process's own memory
(``snapshot.shared_memory``: true, false or auto, the default).

auto puts the ring in shared memory under the supervisor (``orchestrator launch``), when
``snapshot.shm_dir`` has room for the ring of every local rank plus headroom: a crash, an
OOM kill or a hang kill then costs ``snapshot.every_steps`` steps instead of
``persist.every_steps``, and a restart reads no storage. Without a supervisor nothing would
restart from the ring, and nothing would remove it after a crash, so auto keeps it private.

The headroom is for the other users of a node's /dev/shm, which fail in obscure ways when
it is full: NCCL's intra-node buffers, DataLoader workers' batches, other jobs. A
container's 64 MiB /dev/shm never has it, and the ring stays private, said once.

The choice is one for the whole group, from one all-gather of every rank's reading: ranks
of a node that read the free space at slightly different moments still choose alike, and
every node chooses alike (the resume's collectives over the ring need every rank in them,
and buddy replication copies rings that exist).
"""

from __future__ import annotations

import logging
import os
from dataclasses import astuple, dataclass

from orchestrator.comm import Comm
from orchestrator.engines import Engine
from orchestrator.journal import Decisions
from orchestrator.policy import SnapshotPolicy
from orchestrator.protocol import ENV_SHM_DIR, node_name, shm_root
from orchestrator.startup import _free_for, _ring_need, how_to_give_room

logger = logging.getLogger(__name__)

EVENT_SHM_FALLBACK = "shm_fallback"
# The ring leaves at least this much of shm_dir free (or a tenth of its size, if larger).
HEADROOM_BYTES = 256 * 2**20
HEADROOM_FRACTION = 0.1


@dataclass(frozen=True)
class Room:
    """One rank's reading of its node: what the ring needs there, what is free for it."""

    node: str
    need: int  # bytes the ring of every local rank needs on this node
    free: int  # bytes free for it under shm_dir (this run's earlier slots there included)
    supervised: bool  # under `orchestrator launch` (it owns the ring across attempts)


def headroom(need: int) -> int:
    """Bytes of shm_dir auto leaves free beside a ring of ``need`` bytes."""
    return max(HEADROOM_BYTES, int(need * HEADROOM_FRACTION))


def choose(mode: bool | str, rooms: list[Room]) -> tuple[bool, Room | None]:
    """Whether the ring goes to shared memory, from every rank's reading (alike on every
    rank), and, when auto keeps it private for want of room, the tightest node's reading.
    true is kept as asked: the memory check at start fails it where it does not fit."""
    if mode is not True and mode is not False:  # auto
        if not all(r.supervised for r in rooms):
            return False, None
        short = [r for r in rooms if r.need + headroom(r.need) > r.free]
        if short:
            return False, min(short, key=lambda r: (r.free - r.need, r.node))
        return True, None
    return bool(mode), None


def in_shared_memory(
    snap: SnapshotPolicy,
    comm: Comm,
    engine: Engine,
    run_dir: str,
    user_bytes: int,
    decide: Decisions,
) -> bool:
    """Whether this group keeps its ring in shared memory (collective under auto: call it
    on every rank). Rank 0 journals ``shm_fallback`` once, and says it, when auto keeps
    the ring private for want of room."""
    if snap.shared_memory is True or snap.shared_memory is False:
        return snap.shared_memory
    node = node_name()
    root = os.environ.get(ENV_SHM_DIR) or shm_root(snap.shm_dir, run_dir, node)
    need, _ = _ring_need(snap, engine, True, user_bytes)
    mine = Room(node, need, _free_for(root), ENV_SHM_DIR in os.environ)
    rooms = [Room(*r) for r in comm.all_gather_object(astuple(mine))]
    use, short = choose(snap.shared_memory, rooms)
    if short is not None:
        _say_fallback(snap.shm_dir, short, decide, comm.rank == 0)
    return use


def _say_fallback(shm_dir: str, short: Room, decide: Decisions, speaker: bool) -> None:
    mib = 2**20
    why = (
        f"snapshot.shared_memory: auto keeps the snapshot ring in private memory: it needs "
        f"{short.need / mib:.1f} MiB in {shm_dir} on node {short.node} plus "
        f"{headroom(short.need) / mib:.0f} MiB of headroom, and {short.free / mib:.1f} MiB "
        "is free there; a crash then resumes from the durable tier (up to "
        "persist.every_steps steps lost) instead of shared memory"
    )
    remedy = how_to_give_room(shm_dir)
    decide(
        EVENT_SHM_FALLBACK,
        0,
        need_bytes=short.need,
        headroom_bytes=headroom(short.need),
        free_bytes=short.free,
        path=shm_dir,
        node=short.node,
        why=why,
        remedy=remedy,
    )
    if speaker:
        logger.warning("%s. To keep it in shared memory: %s", why, remedy)
