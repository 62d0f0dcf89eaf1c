"""The Guard's start and stop: the run directory, the host-memory check, stop signals,
the run's start record, preemption and close."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from orchestrator import events
from orchestrator.comm import (
    end_process_groups,
    ending_on_error,
    fence_gloo_at_exit,
    keep_for_exit,
    note_error,
)
from orchestrator.context import Context
from orchestrator.cursor import DataCursor
from orchestrator.durable import DurableTier
from orchestrator.errors import (
    GaveUp,
    Preempted,
    PreemptedUnsaved,
    Unhealthy,
)
from orchestrator.health import HealthChecker
from orchestrator.heartbeat import Heartbeat
from orchestrator.journal import read_journal
from orchestrator.keeper import StateKeeper
from orchestrator.lifeline import watch_supervisor
from orchestrator.metrics import Metrics
from orchestrator.policy import Policy
from orchestrator.protocol import (
    ENV_SHM_DIR,
    EVENT_PREEMPTING,
    POLICY_NAME,
)
from orchestrator.recovery import Recovery
from orchestrator.rundir import write_policy


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
    writers and checkers stopped, ``run_end``). It takes the whole policy: it records it
    (the run's policy file, its digest in ``run_start``)."""

    def __init__(
        self,
        ctx: Context,
        policy: Policy,
        *,
        keeper: StateKeeper,
        durable: DurableTier,
        heartbeat: Heartbeat,
        metrics: Metrics,
        health: HealthChecker | None,
        recovery: Recovery,
        cursor: DataCursor,
    ) -> None:
        comm, self.run_dir, self.journal = ctx.comm, ctx.run_dir, ctx.journal
        self.policy, self.comm = policy, comm
        self.keeper, self.durable, self.heartbeat, self.metrics = (
            keeper,
            durable,
            heartbeat,
            metrics,
        )
        self.health, self.recovery, self.cursor = health, recovery, cursor
        self.decide = ctx.decide
        self.signals = StopSignals()
        self.closed = False
        # The Guard's account of an exception that left the loop body (``close_forgotten``).
        self.on_loop_error: Callable[[BaseException], None] | None = None
        self._step: Callable[[], int] = lambda: 0  # the Guard's counter, for close_forgotten
        # How many faults drills and tests armed (the policy's and $ORCHESTRATOR_FAULTS's),
        # set by orchestrator.faults.install: run_start says it.
        self.faults = 0

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
            faults=self.faults,
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
            record = events.Preempted(
                persisted=written,
                url=url,
                durable_step=step if written else newest,
                steps_lost=lost or 0,
            )
            self.decide.emit(step, record)
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
        self._stop(step, on_exit)
        extra: dict[str, Any] = {
            "attempt_incidents": len(self.recovery.incidents),
            "attempt_rollbacks": self.recovery.rollbacks,
        }
        if self.metrics.unwritten:  # the disk stayed full to the end: say what is missing
            extra["metrics_unwritten"] = self.metrics.unwritten
            logger.error(
                "rank %d: %d metrics rows could not be written to %s (its disk refused "
                "writes until the end); the journal and snapshots are unaffected",
                self.comm.rank,
                self.metrics.unwritten,
                self.metrics.path,
            )
        incidents: int | None = None  # None: not written (skip_none)
        rollbacks: int | None = None
        seen: int | None = None
        if self.comm.rank == 0:  # the run's, earlier attempts' included (rank 0 journals them)
            kinds = [e["kind"] for e in read_journal(self.run_dir)]
            incidents, rollbacks = kinds.count("incident"), kinds.count("rollback")
        if self.cursor.source is not None:
            seen = self.cursor.samples_seen()
            extra["quarantined_fraction"] = self.cursor.samples_lost() / seen
        end = events.RunEnd(
            status=status or ("finished" if finished else "stopped"),
            steps=step,
            quarantined=sorted(self.cursor.quarantined),
            samples_seen=seen,
            incidents=incidents,
            rollbacks=rollbacks,
        )
        self.decide.emit(step, end, skip_none=True, **extra)
        self.journal.close()
        # Last: a launcher's SIGTERM during close (it tears the job down when a peer
        # died) is noted, not fatal, until the run's end is journaled.
        self.signals.restore()

    def _stop(self, step: int, on_exit: bool) -> None:
        """Write what the ledger held back; stop the writer (abandoning a write in flight
        on a SIGTERM ``on_exit``), the ring, metrics, checkers and heartbeat."""
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
