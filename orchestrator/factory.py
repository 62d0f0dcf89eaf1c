"""Builds a Guard's components, in order, each from the shared :class:`Context` and only the
policy section(s) it reads; and tears down what a failed start had built.

The order is the protocol's: every rank runs the same collectives in the same order (the
run directory, the attempt id, the ledger, the shared-memory slots, the memory check...),
so a component is built after everything it agrees on with the other ranks.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.adjust import LRAdjuster
from orchestrator.autotune import AutoTune
from orchestrator.check import StepCheck
from orchestrator.comm import Comm
from orchestrator.context import Clock, Context
from orchestrator.crashes import StepMarker, Suspicion
from orchestrator.cursor import DataCursor
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine
from orchestrator.health import HealthChecker
from orchestrator.heartbeat import Heartbeat
from orchestrator.idset import IdSet
from orchestrator.investigate import Investigation, InvestigationPolicy
from orchestrator.keeper import KeeperPolicy, StateKeeper
from orchestrator.lifecycle import Lifecycle
from orchestrator.metrics import Metrics
from orchestrator.policy import Policy, SnapshotPolicy
from orchestrator.protocol import ENV_SHM_DIR, LEDGER_NAME
from orchestrator.quarantine import Entry, Ledger
from orchestrator.recovery import Recovery
from orchestrator.recovery_policy import RecoveryPolicy
from orchestrator.shm import ShmSlots
from orchestrator.shm_room import in_shared_memory
from orchestrator.snapshot import SnapshotRing
from orchestrator.startup import (
    MemoryBudget,
    agree_attempt,
    load_ledger,
    open_shm,
    resolve_run_dir,
)
from orchestrator.stateful import UserState
from orchestrator.tuning import Intervals, Tuner, ring_min_steps

logger = logging.getLogger(__name__)

Held = list[Entry]  # ledger entries an earlier process did not write


class Teardown:
    """What a start built that must be stopped if it fails part way: closed newest first
    (threads before the files they write, the journal last), each failure logged and the
    rest still closed, so a script that catches the error holds none of them."""

    def __init__(self) -> None:
        self._closers: list[Callable[[], Any]] = []

    def add(self, close: Callable[[], Any]) -> None:
        self._closers.append(close)

    def run(self) -> None:
        while self._closers:
            close = self._closers.pop()
            try:
                close()
            except Exception as err:  # closing failed: say so, go on with the rest
                logger.debug("abandoning a failed start: %r", err)


@dataclass
class Components:
    """A Guard's components, as :func:`build` made them."""

    ctx: Context
    shm: ShmSlots | None
    ring: SnapshotRing
    adjuster: LRAdjuster
    cursor: DataCursor
    marker: StepMarker
    durable: DurableTier
    heartbeat: Heartbeat
    keeper: StateKeeper
    check: StepCheck
    metrics: Metrics
    health: HealthChecker | None
    investigation: Investigation
    recovery: Recovery
    lifecycle: Lifecycle
    autotune: AutoTune
    suspect: Suspicion | None  # the last attempt died in a loop body: probe that batch
    quarantined: int  # sample ids quarantined at start


@dataclass(frozen=True)
class Hooks:
    """What components call back into the Guard for: its step counter and its journaling
    of a collective decision at that step."""

    step: Callable[[], int]
    event: Callable[..., None]


def open_context(
    policy: Policy, comm: Comm, run_dir: str | None, fresh: bool, clock: Clock | None = None
) -> Context:
    """Agree on the run directory and attempt id; open this rank's journal (collective)."""
    chosen = resolve_run_dir(comm, run_dir, fresh, policy)
    return Context.open(comm, chosen, agree_attempt(comm), clock)


def build(
    policy: Policy,
    ctx: Context,
    engine: Engine,
    *,
    intervals: Intervals,
    user: UserState,
    hooks: Hooks,
    teardown: Teardown,
) -> Components:
    """Build the components after ``ctx`` (collective: every rank in the same order); each
    one that holds a thread, a file or shared memory is added to ``teardown`` once built.

    Raises:
        PolicyError: the policy cannot be met here (e.g. host memory for the ring).
        LedgerUnreadable: the quarantine ledger does not parse.
    """
    p, comm = policy, ctx.comm
    shm, ring = _ring(p.snapshot, ctx, engine, user, teardown)
    adjuster = LRAdjuster(p.adjust)
    ledger, in_ledger, held, suspect = _ledger(p, ctx)
    marker = StepMarker(ctx.run_dir, comm.global_rank, ctx.attempt)
    teardown.add(marker.close)
    cursor = DataCursor(comm, in_ledger, p.quarantine.window_steps)
    durable = DurableTier(
        ctx, p.persist, engine, hooks.event, intervals=intervals, policy_digest=p.digest(), shm=shm
    )
    teardown.add(durable.close)
    heartbeat = _heartbeat(p, ctx, hooks)
    teardown.add(heartbeat.close)
    budget = MemoryBudget(p.snapshot, comm, engine, user, ring, shm)
    keeper = StateKeeper(
        ctx, KeeperPolicy.of(p), engine, ring, durable, cursor=cursor, adjuster=adjuster,
        heartbeat=heartbeat, shm=shm, user=user, budget=budget,
    )  # fmt: skip
    check = StepCheck(ctx, p.detect, engine, durable, heartbeat)
    budget.check()  # the ring fits this host, the user's objects registered so far included
    metrics = _metrics(p, ctx, hooks)
    health = HealthChecker.for_policy(p.health, p.diagnose, comm, ctx.run_dir)
    if health is not None:
        teardown.add(health.close)
    recovery = Recovery(
        ctx, RecoveryPolicy.of(p), engine, ring=ring, cursor=cursor, adjuster=adjuster,
        ledger=ledger, durable=durable, metrics=metrics, heartbeat=heartbeat, health=health,
        user=user,
    )  # fmt: skip
    suspect = _settle_crash(recovery, ctx, held, suspect)
    lifecycle = Lifecycle(
        ctx, p, keeper=keeper, durable=durable, heartbeat=heartbeat, metrics=metrics,
        health=health, recovery=recovery, cursor=cursor,
    )  # fmt: skip
    autotune = AutoTune(
        ctx, _tuner(p, shm is not None), intervals, durable=durable, keeper=keeper,
        recovery=recovery, event=hooks.event,
    )  # fmt: skip
    return Components(
        ctx, shm, ring, adjuster, cursor, marker, durable, heartbeat, keeper, check, metrics,
        health, Investigation(ctx, InvestigationPolicy.of(p), engine), recovery, lifecycle,
        autotune, suspect, len(in_ledger),
    )  # fmt: skip


def _ring(
    snap: SnapshotPolicy, ctx: Context, engine: Engine, user: UserState, teardown: Teardown
) -> tuple[ShmSlots | None, SnapshotRing]:
    """The host ring: in this rank's shared-memory slots (``snapshot.shared_memory``, auto:
    where the node has room, orchestrator/shm_room.py) or in private memory."""
    use = in_shared_memory(snap, ctx.comm, engine, ctx.run_dir, user.nbytes(), ctx.decide)
    shm = open_shm(snap, ctx.comm, ctx.run_dir, ctx.attempt, use)  # None: private memory
    if shm is not None:
        teardown.add(lambda: shm.close(remove=ENV_SHM_DIR not in os.environ))
    reserve = engine.estimate_state_bytes()
    if shm is not None:
        shm.reserve_bytes = reserve
        shm.reserve_alike = engine.state_replicated
    ring = SnapshotRing(
        snap.keep,
        alloc=shm.alloc if shm else None,
        on_drop=shm.drop if shm else None,
        reserve_bytes=0 if shm else reserve,
    )
    return shm, ring


def _ledger(p: Policy, ctx: Context) -> tuple[Ledger, IdSet, Held, Suspicion | None]:
    """The quarantine ledger, the ids quarantined from the start, the entries an earlier
    process did not write, and what the last attempt died on (collective)."""
    ledger = Ledger(p.quarantine.ledger_url or os.path.join(ctx.run_dir, LEDGER_NAME))
    # Rank 0 reads, every rank gets the same set: shards must never overlap. Entries
    # an earlier process quarantined but could not write count as well.
    # The previous attempt's death in a loop body, if it died there (crashes.py),
    # is read with the ledger: before any rank's marker of this attempt replaces it.
    in_ledger, held, suspect = load_ledger(ctx.comm, ledger, ctx.run_dir, ctx.decide, ctx.attempt)
    crashed = suspect.culprits if suspect is not None else []
    in_ledger |= set(crashed)  # quarantined from the start: the replay skips them
    return ledger, in_ledger, held, suspect


def _heartbeat(p: Policy, ctx: Context, hooks: Hooks) -> Heartbeat:
    """This rank's heartbeat file; a failed write is journaled."""
    return Heartbeat(
        ctx.run_dir,
        ctx.comm.global_rank,
        ctx.attempt,
        p.supervisor.heartbeat_interval_s,
        on_error=lambda err: ctx.journal.write(
            "heartbeat_failed", hooks.step(), {"error": repr(err)}
        ),
    )


def _tuner(p: Policy, in_shm: bool) -> Tuner:
    """``every_steps: auto``'s chooser (inactive when no interval is automatic); ``in_shm``:
    the ring is in shared memory (restarts resume from it too)."""
    return Tuner(
        p.tune,
        p.snapshot.auto_every_steps,
        p.persist.auto_every_steps,
        in_shm,
        ring_min_steps(p.snapshot),
    )


def _metrics(p: Policy, ctx: Context, hooks: Hooks) -> Metrics:
    """Rank 0's metrics rows; a failed write or a low update ratio is journaled."""
    metrics: Metrics | None = None

    def on_error(err: OSError) -> None:
        path = metrics.path if metrics is not None else None
        ctx.journal.write(
            "write_failed", hooks.step(), {"file": "metrics", "path": path, "error": repr(err)}
        )

    metrics = Metrics(
        p.metrics, ctx.run_dir, ctx.attempt, ctx.comm.rank == 0, p.export.tensorboard_dir,
        on_error=on_error,
        on_low=lambda step, low: ctx.decide("update_ratio_low", step, **low),
    )  # fmt: skip
    return metrics


def _settle_crash(
    recovery: Recovery, ctx: Context, held: Held, suspect: Suspicion | None
) -> Suspicion | None:
    """Write the ledger entries an earlier process held back; quarantine what the last
    attempt died on, if it is known, else journal the suspicion (the batch is probed
    before it runs again). Returns what is left to probe."""
    recovery.hold(held)
    if suspect is None:
        return None
    if suspect.culprits:
        recovery.quarantine_crashed(suspect)
        return None
    s = suspect
    ctx.decide("crash_suspected", s.step, micro=s.micro, ranks=s.ranks)
    return suspect
