"""The Guard's start and stop: the run directory, the host-memory check, stop signals,
the run's start record, preemption and close."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from orchestrator.comm import (
    Comm,
    end_process_groups,
    ending_on_error,
    fence_gloo_at_exit,
    keep_for_exit,
    note_error,
)
from orchestrator.crashes import Suspicion, read_marks, suspicion
from orchestrator.cursor import DataCursor
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine
from orchestrator.errors import (
    GaveUp,
    LedgerError,
    LedgerUnreadable,
    OrchestratorError,
    PolicyError,
    Preempted,
    PreemptedUnsaved,
    Unhealthy,
    UsageError,
)
from orchestrator.health import HealthChecker
from orchestrator.heartbeat import Heartbeat
from orchestrator.journal import Decisions, Journal, read_journal
from orchestrator.keeper import StateKeeper
from orchestrator.lifeline import watch_supervisor
from orchestrator.metrics import Metrics
from orchestrator.policy import Policy
from orchestrator.protocol import (
    ENV_ATTEMPT,
    ENV_RUN_DIR,
    ENV_SHM_DIR,
    EVENT_GAVE_UP,
    EVENT_PREEMPTED,
    EVENT_PREEMPTING,
    EVENT_RUN_END,
    POLICY_NAME,
    node_name,
    shm_root,
)
from orchestrator.quarantine import Ledger, held_back
from orchestrator.recovery import Recovery
from orchestrator.rundir import archive_run_dir, write_policy
from orchestrator.shm import ShmSlots
from orchestrator.snapshot import slot_bytes


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
) -> tuple[set[int], list[tuple[list[int], int, str]], Suspicion | None]:
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
    held: list[tuple[list[int], int, str]] = []
    failure: BaseException | None = None
    if comm.rank == 0:
        try:
            loaded = ledger.load()
            events = list(read_journal(run_dir))
            held = held_back(events, loaded)
            loaded |= {i for ids, _, _ in held for i in ids}
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


def open_shm(policy: Policy, comm: Comm, run_dir: str, attempt: int) -> ShmSlots | None:
    """This rank's slots of the shared-memory ring (snapshot.shared_memory), in the folder
    the supervisor named for this run and node, else in one of our own under shm_dir."""
    if not policy.snapshot.shared_memory:
        return None
    node = node_name()
    root = os.environ.get(ENV_SHM_DIR) or shm_root(policy.snapshot.shm_dir, run_dir, node)
    # Which of the group's ranks share this node (they keep the state they hold alike once
    # per node), and a name for their node files, the same on all of them.
    ranks = comm.all_gather_object((comm.global_rank, node, os.urandom(4).hex()))
    mine = sorted((r, token) for r, n, token in ranks if n == node)
    return ShmSlots(
        root,
        comm.global_rank,
        comm.world_size,
        policy.snapshot.keep,
        attempt,
        node_ranks=[r for r, _ in mine],
        token=mine[0][1],
    )


def check_memory(policy: Policy, comm: Comm, engine: Engine, shm_root: str | None = None) -> None:
    """Fail at start, on every rank alike, if the snapshot ring cannot fit on this host
    (in host memory, or, with ``shm_root``, in the shared-memory file system it lives on).

    Raises:
        PolicyError: with what the ring needs and what to change.
    """
    snap = policy.snapshot
    local_ranks = local_world_size()
    per_rank = engine.estimate_state_bytes()
    if shm_root is None:
        per_rank = slot_bytes(per_rank)  # the size of each private slot's arena, exactly
    # In shared memory, state every rank holds alike is kept once per node.
    copies = 1 if shm_root is not None and engine.state_replicated else local_ranks
    need = per_rank * snap.keep * copies
    gib = 2**30
    problem = None
    detail = (
        f"snapshot.keep={snap.keep} needs {need / gib:.2f} GiB of host memory on this node "
        + (
            f"({local_ranks} local rank(s) x {snap.keep} slots x {per_rank / gib:.3f} GiB)"
            if copies > 1
            else f"({snap.keep} slots x {per_rank / gib:.3f} GiB, kept once per node)"
        )
    )
    remedy = "lower snapshot.keep, or free host memory, or raise snapshot.max_host_memory_gb"
    if snap.max_host_memory_gb is not None and need > snap.max_host_memory_gb * gib:
        problem = f"{detail}, over snapshot.max_host_memory_gb={snap.max_host_memory_gb}"
    elif shm_root is not None:
        free = _free_for(shm_root)
        if need > free:
            problem = f"{detail.replace('of host memory', f'in {snap.shm_dir}')}, but " + (
                f"only {free / gib:.2f} GiB is free there"
                if os.path.isdir(snap.shm_dir)
                else "it does not exist"
            )
            remedy = (
                f"free or enlarge {snap.shm_dir} (`df -h {snap.shm_dir}`; a container's "
                "/dev/shm is often 64 MiB: docker --shm-size), lower snapshot.keep, or set "
                "snapshot.shared_memory: false"
            )
    else:
        avail = _available_host_bytes()
        if avail is not None and need > 0.8 * avail:
            problem = f"{detail}, but only {avail / gib:.2f} GiB is free (80% usable)"
    problems = [p for p in comm.all_gather_object((problem, remedy)) if p[0]]
    if problems:
        raise PolicyError(f"{problems[0][0]}: {problems[0][1]}")


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


class StopSignals:
    """SIGTERM/SIGINT become a collective stop at the next step boundary (``requested``
    rides the step's all-reduce). SIGTERM stays caught (torchrun and a supervisor may both
    send it); a second SIGINT gets Python's default: KeyboardInterrupt.

    A handler the script installed before the Guard is chained, not replaced: it runs
    after the stop is recorded (and takes the second SIGINT instead of KeyboardInterrupt).
    Python's own defaults are not called (they would raise or kill before the snapshot)."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def on_signal(signum: int, frame: Any) -> None:
            self.requested = True
            previous = self._old.get(signum)
            theirs = previous if callable(previous) else None
            if theirs is signal.default_int_handler:
                theirs = None
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, theirs or signal.default_int_handler)
            if theirs is not None:
                theirs(signum, frame)

        self._old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._old.items():
                signal.signal(sig, handler)
        self._old = {}


logger = logging.getLogger(__name__)
_OPEN: weakref.WeakSet[Lifecycle] = weakref.WeakSet()  # started, not closed
_STARTED = [False]  # a Guard ran in this process


def close_forgotten() -> None:
    """Close every run its script did not close (``atexit``, and ``exit_process``)."""
    for lifecycle in list(_OPEN):
        lifecycle.close_forgotten()


def _at_exit() -> None:
    """A script that simply returns must end as well as one that calls ``exit_process``:
    close what it left open, fence the gloo groups so that no gloo worker thread frees a
    tensor during interpreter finalization (that aborts a finished run, SIGABRT: see
    :func:`orchestrator.comm.fence_gloo_at_exit`), then end the process groups: destroyed,
    or aborted when the process ends on an error (:func:`orchestrator.comm.end_process_groups`)."""
    close_forgotten()
    if not _STARTED[0]:
        return
    try:
        fence_gloo_at_exit()
        end_process_groups()  # the script may have destroyed them: then nothing to do
    except Exception as err:  # at exit: never mask the script's own outcome
        logger.warning("ending the process groups at exit failed: %r", err)


atexit.register(_at_exit)


class Lifecycle:
    """The run's start and end on this rank: the policy file and ``run_start`` record, the
    preflight health check, stop signals, preemption, and close (final durable snapshot,
    writers and checkers stopped, ``run_end``)."""

    def __init__(
        self,
        policy: Policy,
        comm: Comm,
        run_dir: str,
        *,
        journal: Journal,
        keeper: StateKeeper,
        durable: DurableTier,
        heartbeat: Heartbeat,
        metrics: Metrics,
        health: HealthChecker | None,
        recovery: Recovery,
        cursor: DataCursor,
    ) -> None:
        self.policy, self.comm, self.run_dir, self.journal = policy, comm, run_dir, journal
        self.keeper, self.durable, self.heartbeat, self.metrics = (
            keeper,
            durable,
            heartbeat,
            metrics,
        )
        self.health, self.recovery, self.cursor = health, recovery, cursor
        self.decide = Decisions(journal, comm.rank == 0)
        self.signals = StopSignals()
        self.closed = False
        # The Guard's account of an exception that left the loop body (``close_forgotten``).
        self.on_loop_error: Callable[[BaseException], None] | None = None
        self._step: Callable[[], int] = lambda: 0  # the Guard's counter, for close_forgotten

    def say_if_done(self, step: int, max_steps: int) -> None:
        """A run started again after it finished trains nothing: say so, on rank 0."""
        if step >= max_steps and self.comm.rank == 0:
            logger.warning(
                "the run in %s is already at step %d (max_steps=%d): nothing to train. To "
                "train further raise max_steps; to start over pass Guard(fresh=True) or "
                "`orchestrator launch --fresh`, or use another run dir",
                self.run_dir,
                step,
                max_steps,
            )

    def start(self, quarantined: int, step: Callable[[], int]) -> None:
        """Record the run's start; run the preflight health check if the policy asks.

        Raises:
            Unhealthy: the preflight check failed (the run is closed).
        """
        p = self.policy
        watch_supervisor()  # under `orchestrator launch`: end with it, never outlive it
        if self.comm.rank == 0:
            path = os.path.join(self.run_dir, POLICY_NAME)
            try:
                write_policy(path, p)
            except OSError as err:  # bookkeeping: the run goes on (the policy is in memory)
                logger.error("rank 0: %s cannot be written (%s); training goes on", path, err)
                self.journal.write("write_failed", 0, {"file": POLICY_NAME, "path": path,
                                                       "error": repr(err)})  # fmt: skip
        self.decide(
            "run_start",
            0,
            world_size=self.comm.world_size,
            run_dir=self.run_dir,
            policy_digest=p.digest(),
            quarantined=quarantined,
            faults=len(p.faults),
        )
        if self.health is not None and p.health.preflight:
            with self.closing_on_stop(lambda: 0):
                self.recovery.check_health("preflight", 0)
        self.signals.install()  # last: a failed start must not keep them
        self._step = step
        _OPEN.add(self)
        _STARTED[0] = True
        if self.comm.enabled:
            keep_for_exit(self.comm.group)

    def close_forgotten(self) -> None:
        """The script ended without ``guard.close()``: flush metrics, stop the writer and
        journal ``run_end`` (status ``not_closed``) anyway, and say what was lost."""
        if self.closed:
            return
        err = getattr(sys, "last_value", None)  # the exception that ended the script
        if err is not None and self.on_loop_error is not None:
            try:
                self.on_loop_error(err)
            except Exception as e:  # at exit: never mask the script's own outcome
                logger.warning("journaling the loop's error failed: %r", e)
        step = self._step()
        if self.comm.rank == 0:
            logger.warning(
                "guard.close() was not called (run %s, step %d): metrics and the journal are "
                "closed at exit, but the final durable snapshot was not written; end the "
                "training loop with guard.close() or use `with Guard(...) as guard:`",
                self.run_dir,
                step,
            )
        try:
            self.close(step, persist=False, status="not_closed", on_exit=True)
        except Exception as err:  # at exit: never mask the script's own outcome
            logger.warning("closing the forgotten run failed: %r", err)

    @contextlib.contextmanager
    def closing_on_stop(self, step: Callable[[], int]) -> Iterator[None]:
        """Close the run (nothing persisted) when a budget or health stop leaves the block."""
        try:
            yield
        except (GaveUp, Unhealthy) as err:
            if isinstance(err, Unhealthy):  # a rank may be absent or frozen: abort at the end
                note_error()
            self.close(step(), persist=False)
            raise

    def preempt(self, step: int) -> NoReturn:
        """Write a durable snapshot of the current state, journal, and stop. The intent is
        journaled first: a worker killed while writing was still preempted.

        Raises:
            Preempted: the snapshot was written (exit 73).
            PreemptedUnsaved: it was not (exit 143): rank 0 says on the console how many
                steps are lost, and the ``preempted`` event has them.
        """
        self.decide(EVENT_PREEMPTING, step)
        written = self.keeper.persist_now(step, self.recovery.rollbacks, "preempting")
        said = None
        if self.comm.rank == 0:  # it commits: its word is what was written
            url = self.durable.store.url
            newest = None if written else self._newest_durable(step)
            lost = None if written else step - (newest if newest is not None else 0)
            self.decide(EVENT_PREEMPTED, step, persisted=written, url=url,
                        durable_step=step if written else newest, steps_lost=lost or 0)  # fmt: skip
            if not written:
                logger.error(
                    "PREEMPTED WITHOUT A DURABLE SNAPSHOT at step %d: the write to %s failed "
                    "or did not finish within supervisor.grace_s (see persist_failed in the "
                    "journal). %s: %d step(s) are lost and will be trained again. Exit %d, "
                    "not %d",
                    step,
                    url,
                    f"The newest durable snapshot is step {newest}"
                    if newest is not None
                    else "There is no durable snapshot: a restart starts from step 0",
                    lost,
                    PreemptedUnsaved.exit_code,
                    Preempted.exit_code,
                )
            said = written
        # Every rank exits with rank 0's code (a rank's own part may be written while the
        # commit failed).
        written = bool(self.comm.broadcast_object(said))
        self.close(step, persist=False)
        if not written:
            raise PreemptedUnsaved(f"stopped on request at step {step}: no durable snapshot")
        raise Preempted(f"stopped on request at step {step} after a durable snapshot")

    def _newest_durable(self, step: int) -> int | None:
        """The newest committed durable snapshot at or before ``step`` (None: none, or the
        store cannot be listed)."""
        try:
            steps = [s for s in self.durable.store.committed_steps() if s <= step]
        except Exception as err:  # a failing store is why we are here: say what we know
            logger.warning(
                "cannot list %s for its newest snapshot: %r", self.durable.store.url, err
            )
            return None
        return max(steps, default=None)

    def close(
        self,
        step: int,
        persist: bool,
        between_steps: bool = False,
        status: str | None = None,
        on_exit: bool = False,
    ) -> None:
        """With ``persist``, a run that ended ``between_steps`` persists its state; stop the
        writer and checkers, journal the end. Safe to call twice. ``on_exit``: the process
        is ending without ``guard.close()`` (often because a peer died): a SIGTERM (the
        launcher tearing the job down) stops the wait for a durable write in flight, whose
        commit may wait for a dead rank's part."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        finished = persist and between_steps
        if finished:
            self.heartbeat.beat(step, phase="closing", force=True)
            if step > self.durable.mark and step > 0:
                # A finished run can be picked up (or resumed at another world size) from
                # its last step.
                self.keeper.persist_now(step, self.recovery.rollbacks, "closing")
        self.recovery.flush_ledger()  # entries a storage failure held back, if any
        if not self.durable.close(abandon=(lambda: self.signals.requested) if on_exit else None):
            logger.warning(
                "rank %d: a durable write was still in flight at exit and was abandoned; "
                "its step stays uncommitted (committed snapshots are unchanged)",
                self.comm.rank,
            )
        if self.keeper.shm is not None:  # without a supervisor, nobody else removes it
            self.keeper.shm.close(remove=ENV_SHM_DIR not in os.environ)
        self.keeper.ring.close()
        self.metrics.flush()
        if self.health is not None:
            self.health.close(abort=on_exit or ending_on_error())
        self.heartbeat.beat(step, phase="done", force=True)
        self.heartbeat.close()
        summary: dict[str, Any] = {
            "attempt_incidents": len(self.recovery.incidents),
            "attempt_rollbacks": self.recovery.rollbacks,
        }
        if self.metrics.unwritten:  # the disk stayed full to the end: say what is missing
            summary["metrics_unwritten"] = self.metrics.unwritten
            logger.error(
                "rank %d: %d metrics rows could not be written to %s (its disk refused "
                "writes until the end); the journal and snapshots are unaffected",
                self.comm.rank,
                self.metrics.unwritten,
                self.metrics.path,
            )
        if self.comm.rank == 0:  # the run's, earlier attempts' included (rank 0 journals them)
            kinds = [e["kind"] for e in read_journal(self.run_dir)]
            summary.update(incidents=kinds.count("incident"), rollbacks=kinds.count("rollback"))
        if self.cursor.source is not None:
            seen = self.cursor.samples_seen()
            summary.update(
                samples_seen=seen, quarantined_fraction=len(self.cursor.quarantined) / seen
            )
        self.decide(
            EVENT_RUN_END,
            step,
            status=status or ("finished" if finished else "stopped"),
            steps=step,
            quarantined=sorted(self.cursor.quarantined),
            **summary,
        )
        self.journal.close()
        # Last: a launcher's SIGTERM during close (it tears the job down when a peer
        # died) is noted, not fatal, until the run's end is journaled.
        self.signals.restore()
