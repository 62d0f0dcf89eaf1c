"""The Guard's start-up checks and agreements: the run directory, the attempt id, the
quarantine ledger as rank 0 read it, the shared-memory slots and the host-memory check.
Every function here is collective over the group: call them on every rank, in order."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from typing import Any

from orchestrator.comm import Comm
from orchestrator.crashes import Suspicion, read_marks, suspicion
from orchestrator.engines import Engine
from orchestrator.errors import (
    LedgerError,
    LedgerUnreadable,
    OrchestratorError,
    PolicyError,
    UsageError,
)
from orchestrator.idset import IdSet
from orchestrator.journal import Decisions, read_journal
from orchestrator.policy import Policy, SnapshotPolicy
from orchestrator.protocol import (
    ENV_ATTEMPT,
    ENV_RUN_DIR,
    ENV_SHM_DIR,
    EVENT_GAVE_UP,
    node_name,
    shm_root,
)
from orchestrator.quarantine import Entry, Ledger, held_back
from orchestrator.rundir import archive_run_dir
from orchestrator.shm import ShmSlots
from orchestrator.snapshot import SnapshotRing, slot_bytes
from orchestrator.stateful import UserState

logger = logging.getLogger(__name__)


def resolve_run_dir(comm: Comm, run_dir: str | None, fresh: bool, policy: Policy) -> str:
    """``run_dir``, else $ORCHESTRATOR_RUN_DIR, else a fresh ``./runs/<time>-<pid>``, as
    rank 0 of the group chooses it (ranks may see different environments or clocks).
    ``fresh``: rank 0 archives what an earlier run left there, on the first start only."""
    chosen = run_dir or os.environ.get(ENV_RUN_DIR)
    if not chosen:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        chosen = os.path.join("runs", f"{stamp}-{os.getpid()}")
    chosen = os.path.abspath(comm.broadcast_object(chosen))
    if fresh and ENV_ATTEMPT in os.environ:
        raise UsageError(
            "Guard(fresh=True) under `orchestrator launch`: the supervisor owns the run "
            "directory; start it with `orchestrator launch --fresh` instead"
        )
    # A restart by torchrun (--max-restarts) continues the run it restarts.
    if fresh and comm.rank == 0 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        for line in archive_run_dir(chosen, policy):
            logger.warning("Guard(fresh=True): %s", line)
    if fresh:
        comm.broadcast_object(None)  # nobody opens the journal before the archive is done
    os.makedirs(chosen, exist_ok=True)
    return chosen


def agree_attempt(comm: Comm) -> int:
    """The attempt id every rank of the group runs under (each node's supervisor sets it).

    Raises:
        OrchestratorError: when the ranks' ids differ: their supervisors disagree (a node
            came back late). The workers exit; the supervisors' next attempt agrees
            (launch/nodes.py), so this costs one restart, never a mixed journal.
    """
    mine = int(os.environ.get(ENV_ATTEMPT, "0"))
    ids = comm.all_gather_object(mine)
    if len(set(ids)) > 1:
        by_rank = {r: a for r, a in enumerate(ids)}
        raise OrchestratorError(
            f"the ranks started under different attempt ids ({by_rank}, by rank): their "
            "nodes' supervisors disagree; exiting so that they restart together under one"
        )
    return mine


def load_ledger(
    comm: Comm, ledger: Ledger, run_dir: str, decide: Decisions, attempt: int
) -> tuple[IdSet, list[Entry], Suspicion | None]:
    """The quarantined ids every rank trains without (rank 0 reads, every rank gets the same
    set: shards must never overlap), the entries an earlier process quarantined but could
    not write (rank 0's, to write now; empty elsewhere), and what the last attempt's death
    in a loop body says (orchestrator/crashes.py; read before this attempt's markers).

    Raises:
        LedgerUnreadable: on every rank, when a line of the ledger does not parse; rank 0
            journals ``gave_up`` first (file, line, what to do), so the supervisor stops
            instead of restarting into the same error.
        OrchestratorError: rank 0 could not read the ledger (its storage failed); rank 0
            raises the storage's own error.
    """
    said: tuple[str, Any] | None = None
    held: list[Entry] = []
    failure: BaseException | None = None
    if comm.rank == 0 or comm.solo:  # solo: a replacement reads it itself (rejoin.py)
        try:
            loaded = ledger.load()
            events = list(read_journal(run_dir))
            held = held_back(events, loaded)
            for ids, _, _, spans in held:
                loaded.update(ids)
                for lo, hi in spans:
                    loaded.add_range(lo, hi)
            said = ("ok", (loaded, suspicion(read_marks(run_dir), attempt, events)))
        except LedgerError as err:
            decide(EVENT_GAVE_UP, 0, why=str(err), reason="ledger_unreadable",
                   ledger=err.url, line=err.line)  # fmt: skip
            logger.error("STOPPING: %s", err)
            said = ("unreadable", str(err))
        except Exception as err:  # never leave the other ranks in the broadcast below
            failure = err
            said = ("failed", f"rank 0 could not read the quarantine ledger {ledger.url}: {err!r}")
    kind, value = comm.broadcast_object(said)
    if kind == "unreadable":
        raise LedgerUnreadable(value)
    if kind == "failed":
        raise failure if failure is not None else OrchestratorError(value)
    loaded, found = value
    return loaded, held, found


def open_shm(
    snap: SnapshotPolicy, comm: Comm, run_dir: str, attempt: int, enabled: bool
) -> ShmSlots | None:
    """This rank's slots of the shared-memory ring (``enabled``: snapshot.shared_memory as
    orchestrator/shm_room.py chose it), in the folder the supervisor named for this run and
    node, else in one of our own under shm_dir."""
    if not enabled:
        return None
    node = node_name()
    root = os.environ.get(ENV_SHM_DIR) or shm_root(snap.shm_dir, run_dir, node)
    # Which of the group's ranks share this node (they keep the state they hold alike once
    # per node), and a name for their node files, the same on all of them.
    ranks = comm.all_gather_object((comm.global_rank, node, os.urandom(4).hex()))
    mine = sorted((r, token) for r, n, token in ranks if n == node)
    return ShmSlots(
        root,
        comm.global_rank,
        comm.world_size,
        snap.keep,
        attempt,
        node_ranks=[r for r, _ in mine],
        token=mine[0][1],
    )


class MemoryBudget:
    """The snapshot ring's host-memory budget: the engine's state and the tensors of the
    user's registered objects (:mod:`orchestrator.stateful`, each rank's own), checked by
    :func:`check_memory`, with the ring's (or the shared-memory slots') reserve sized for
    both. Checked when the Guard is built, and again at the first ``guard.batches`` when
    objects were registered since (``guard.register_state``): a big EMA model must not
    overrun the host silently."""

    def __init__(
        self,
        snap: SnapshotPolicy,
        comm: Comm,
        engine: Engine,
        user: UserState,
        ring: SnapshotRing,
        shm: ShmSlots | None,
    ) -> None:
        self.snap, self.comm, self.engine, self.user = snap, comm, engine, user
        self.ring, self.shm = ring, shm
        self.user_bytes = 0  # the user's objects' tensors, as last checked
        self.need = 0  # bytes the ring needs on this node, as last checked

    def check(self, again: bool = False) -> None:
        """Size the reserve and check that the ring fits (collective). ``again``: only if
        some rank's objects changed since the last check (decided alike on every rank).

        Raises:
            PolicyError: the ring does not fit (see :func:`check_memory`).
        """
        user_bytes = self.user.nbytes()
        if again and not self.comm.all_reduce_max(int(user_bytes != self.user_bytes)):
            return
        self.user_bytes = user_bytes
        engine_bytes = self.engine.estimate_state_bytes()
        if self.shm is not None:
            self.shm.reserve_own = user_bytes
        else:  # one arena per slot holds both
            self.ring.reserve(engine_bytes + user_bytes)
        self.need = check_memory(
            self.snap, self.comm, self.engine, self.shm.root if self.shm else None, user_bytes
        )


def check_memory(
    snap: SnapshotPolicy,
    comm: Comm,
    engine: Engine,
    shm_root: str | None = None,
    user_bytes: int = 0,
) -> int:
    """Fail at start, on every rank alike, if the snapshot ring cannot fit on this host
    (in host memory, or, with ``shm_root``, in the shared-memory file system it lives on).
    ``user_bytes``: the tensors of this rank's registered objects, in every slot too.

    Returns:
        The bytes the ring needs on this node.

    Raises:
        PolicyError: with what the ring needs and what to change.
    """
    need, detail = _ring_need(snap, engine, shm_root is not None, user_bytes)
    gib = 2**30
    problem = None
    remedy = "lower snapshot.keep, or free host memory, or raise snapshot.max_host_memory_gb"
    if snap.max_host_memory_gb is not None and need > snap.max_host_memory_gb * gib:
        problem = f"{detail}, over snapshot.max_host_memory_gb={snap.max_host_memory_gb}"
    elif shm_root is not None:
        free = _free_for(shm_root)
        if need > free:
            problem = (
                f"snapshot.shared_memory: {str(snap.shared_memory).lower()}: "
                f"{detail.replace('of host memory', f'in {snap.shm_dir}')}, but "
                + (
                    f"only {free / gib:.2f} GiB is free there"
                    if os.path.isdir(snap.shm_dir)
                    else "it does not exist"
                )
            )
            instead = " (or auto: shared memory where it has room, else private)"
            remedy = (
                f"free or {how_to_give_room(snap.shm_dir)}, or set snapshot.shared_memory: "
                f"false{instead if snap.shared_memory is True else ''}"
            )
    else:
        avail = _available_host_bytes()
        if avail is not None and need > 0.8 * avail:
            problem = f"{detail}, but only {avail / gib:.2f} GiB is free (80% usable)"
    problems = [p for p in comm.all_gather_object((problem, remedy)) if p[0]]
    if problems:
        raise PolicyError(f"{problems[0][0]}: {problems[0][1]}")
    return need


def how_to_give_room(shm_dir: str) -> str:
    """What a person can do when ``shm_dir`` is too small for the ring."""
    return (
        f"enlarge {shm_dir} (`df -h {shm_dir}`; a container's /dev/shm is often 64 MiB: "
        "`docker run --shm-size=16g`, or in Kubernetes an emptyDir volume with medium: "
        "Memory mounted at /dev/shm), point snapshot.shm_dir at a tmpfs with room, or "
        "lower snapshot.keep"
    )


def _ring_need(
    snap: SnapshotPolicy, engine: Engine, in_shm: bool, user_bytes: int
) -> tuple[int, str]:
    """The bytes the ring needs on this node, and how they add up (for the error)."""
    local_ranks = local_world_size()
    # In shared memory, state every rank holds alike is kept once per node; the user's
    # objects' state is each rank's own.
    once = in_shm and engine.state_replicated
    # The size of each slot, exactly: a private arena, or a shared-memory slot's file.
    per_rank = slot_bytes(engine.estimate_state_bytes() + (0 if once else user_bytes))
    own = slot_bytes(user_bytes) if once and user_bytes else 0
    copies = 1 if once else local_ranks
    need = (per_rank * copies + own * local_ranks) * snap.keep
    gib = 2**30
    detail = (
        f"snapshot.keep={snap.keep} needs {need / gib:.2f} GiB of host memory on this node "
        + (
            f"({local_ranks} local rank(s) x {snap.keep} slots x {per_rank / gib:.3f} GiB)"
            if copies > 1
            else f"({snap.keep} slots x {per_rank / gib:.3f} GiB, kept once per node)"
        )
        + (
            f", your registered objects' state ({user_bytes / gib:.3f} GiB a rank) included"
            if user_bytes
            else ""
        )
    )
    return need, detail


def local_world_size() -> int:
    """Ranks on this node: torchrun says LOCAL_WORLD_SIZE, the deepspeed launcher
    LOCAL_SIZE (one process per node, as a 1, would budget the ring 8x low under
    ``deepspeed --num_gpus 8``)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name)
        if value:
            return int(value)
    return 1


def _free_for(root: str) -> int:
    """Bytes the ring may take under ``root``: the free space of its file system plus what
    this run's earlier slots there hold (a restart replaces them)."""
    parent = os.path.dirname(root)
    if not os.path.isdir(parent):
        return 0
    held = 0
    for d, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):  # replaced while we look
                held += os.path.getsize(os.path.join(d, f))
    return shutil.disk_usage(parent).free + held


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
