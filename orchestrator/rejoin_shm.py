"""In-place recovery with the ring in shared memory (``snapshot.shared_memory``, issue 33).

A replacement's first choice is its own rank's slot of the agreed step, which the dead
process left in the node's shared memory: its own RNG and data position, no storage read.
A slot counts when its verdict is there, every rank that wrote a share of its node part
has a verdict naming the same node file, and this rank's bytes and share match their CRC32
(:meth:`ShmSlots.check`); the replicas' digests, compared after the heal, cover the shares
other ranks wrote.

From the recovery on, the group keeps no node part (the state every rank of the node holds
alike, once per node): the node files are named by a count the node's ranks advance in
step, and a replacement's count starts again at zero. Every rank then keeps its whole state
in its own files, as a ring of one rank per node does. A later full restart uses the slots
written since; an older one whose node part a replacement's verdict no longer names is
refused by :func:`node_refusal` (the durable tier then).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from orchestrator.shm import ShmSlots, node_refusal, verdicts

if TYPE_CHECKING:
    from orchestrator.guard import Guard

logger = logging.getLogger(__name__)


def shm_steps(shm: ShmSlots | None) -> dict[int, int]:
    """{step: slot} of this rank's shared-memory slots that a replacement heals from (none
    without the shared-memory ring): sealed, node part complete, bytes matching CRC32."""
    found: dict[int, int] = {}
    if shm is None:
        return found
    try:
        every = verdicts(shm.root)
    except OSError as err:  # the folder went away: no such source
        logger.warning("rank %d: shared-memory ring unreadable: %r", shm.rank, err)
        return found
    for step, (slot, v) in every.get(shm.rank, {}).items():
        if int(v.get("world_size", -1)) != shm.world_size:
            continue
        # The dead process's node ranks are the node's now (the agent restarts the same rank
        # on the same node): ask only that every share has its verdict.
        why = node_refusal(every, step, v, None) or shm.check(slot)
        if why is None:
            found[step] = slot
        else:
            logger.warning("rank %d: shared-memory slot %d: %s", shm.rank, slot, why)
    return found


def without_node_part(guard: Guard) -> None:
    """From this recovery on, every rank keeps its whole state in its own files (no node
    part, no collective of the node's ranks around a snapshot): see the module's doc."""
    shm = guard.shm
    if shm is None:
        return
    shm.node_ranks = [shm.rank]
    guard.keeper._shares_node = False
