"""The Guard: the per-step protocol inside every rank, a thin facade over its components.

Healthy step (hot path): ``guard.backward(loss)``; ``guard.step()`` has the engine judge the
step (:mod:`orchestrator.engines.base`), packs the local finite flags, the loss and the
grad-norm^2 into one tensor, all-reduces it once, and every rank takes the same branch:
commit (the engine applies the step, maybe a snapshot is sealed) or incident. Every
``snapshot.every_steps`` steps, at the step boundary, the state is copied into the host ring.

Incident (cold path, may cost seconds): :class:`Recovery` opens it; a non-finite step is
re-run through the user's own loop by the :class:`Investigation` (isolation, forensics),
whose :class:`Verdict` recovery acts on: quarantine, roll back to the newest sealed snapshot
old enough, adjust; the :class:`DataCursor` rewinds the data. ``docs/ARCHITECTURE.md`` shows
who calls whom.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from orchestrator.adjust import LRAdjuster
from orchestrator.check import Checked, StepCheck
from orchestrator.comm import Comm, note_error
from orchestrator.crashes import (
    IN_BODY,
    IN_GUARD,
    CrashProbe,
    StepMarker,
    collective_failure,
)
from orchestrator.cursor import DataCursor
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine, engine_for
from orchestrator.errors import RunStop, UsageError
from orchestrator.health import HealthChecker
from orchestrator.heartbeat import Heartbeat
from orchestrator.incident import Incident
from orchestrator.inject import inject
from orchestrator.investigate import Investigation
from orchestrator.journal import Decisions, Journal, per_attempt, read_journal
from orchestrator.keeper import StateKeeper
from orchestrator.lifecycle import (
    Lifecycle,
    agree_attempt,
    check_memory,
    load_ledger,
    open_shm,
    resolve_run_dir,
)
from orchestrator.metrics import Metrics
from orchestrator.policy import Policy, load_policy
from orchestrator.protocol import ENV_SHM_DIR, LEDGER_NAME
from orchestrator.quarantine import Ledger
from orchestrator.recovery import Recovery
from orchestrator.rng import rng_state, set_rng_state, set_torch_rng_state, torch_rng_state
from orchestrator.snapshot import SnapshotRing
from orchestrator.stateful import UserState
from orchestrator.tuning import Intervals, Measured, Tuner, resolve_auto, ring_min_steps

# Outcomes of Guard.step.
COMMIT, OVERFLOW_SKIP, ACCUMULATE = "commit", "overflow_skip", "accumulate"
INCIDENT, PROBE = "incident", "probe"
__all__ = ["ACCUMULATE", "COMMIT", "INCIDENT", "OVERFLOW_SKIP", "PROBE", "Guard"]


logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _History:
    """What a job saw before this process (``every_steps: auto``'s inputs)."""

    incidents: int = 0
    restarts: int = 0
    seconds: float = 0.0  # since the job's first start
    write_cost: float | None = None  # the last journaled cost of a durable write


class Guard:
    """Detect, roll back, quarantine, adjust, resume: wraps one rank's training loop.

    Args:
        policy: a :class:`Policy` (``None``: :func:`load_policy`, i.e. $ORCHESTRATOR_POLICY or
            the defaults).
        model, optimizer, scheduler, scaler: the torch objects of the loop. ``model`` may be
            wrapped in ``DistributedDataParallel`` or FSDP. The Guard steps the optimizer,
            the scheduler and the scaler; user code must not.
        engine: instead of the above, the engine ``deepspeed.initialize`` returned (ZeRO
            stage 1, 2 or 3). ``guard.backward`` calls ``engine.backward`` and
            ``guard.step`` calls ``engine.step``; user code calls neither. Or the name of an
            engine registered with ``orchestrator.engines.register_engine``, built from
            the arguments above (docs/engines.md).
        process_group: the group whose ranks decide together (default: the world group when
            torch.distributed is initialized, else single-process).
        run_dir: journal, ledger and what drills injected; default $ORCHESTRATOR_RUN_DIR, else
            a fresh ``./runs/<time>-<pid>`` chosen by rank 0.
        grad_accum_steps: micro-batches per optimizer step: one batch each, ``guard.step``
            returns ``"accumulate"`` until the last (the only one that communicates); each
            loss is divided by it, as DeepSpeed does (whose config sets it instead).
        fresh: start a new run even if ``run_dir`` holds an earlier one (its files move to
            ``run_dir/archive/<time>/``; nothing is deleted); a torchrun restart still
            resumes. Under ``orchestrator launch`` use ``launch --fresh``.
        state: your own objects to keep in every snapshot, by name (an EMA model, a
            counter): anything with ``state_dict()`` and ``load_state_dict(state)``; rolled
            back with the model and resumed after a restart (see :meth:`register_state`).

    Raises:
        PolicyError: the policy cannot be met here (e.g. not enough host memory for the ring).
    """

    def __init__(
        self,
        policy: Policy | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: torch.amp.GradScaler | None = None,
        engine: Any = None,
        process_group: dist.ProcessGroup | None = None,
        run_dir: str | None = None,
        grad_accum_steps: int | None = None,
        fresh: bool = False,
        state: Mapping[str, Any] | None = None,
    ) -> None:
        self.user_state = UserState()
        for name, obj in (state or {}).items():
            self.user_state.register(name, obj)
        p = policy if policy is not None else load_policy()
        if p.snapshot.auto_every_steps or p.persist.auto_every_steps:
            p = resolve_auto(p)  # a copy with the starting intervals
        self.policy = p
        self.intervals = Intervals.of(p)  # what every_steps: auto changes while training
        self.comm = comm = Comm(process_group)
        self.engine: Engine = engine_for(
            model, optimizer, scheduler, scaler, engine, grad_accum_steps
        )
        comm.device = self.engine.state_device()
        try:
            self.engine.check_policy(p)
            self.run_dir = resolve_run_dir(comm, run_dir, fresh, p)
            self.attempt = agree_attempt(comm)
            self.global_step = 0  # committed steps so far = index of the next step (0-based)
            self.journal = Journal(self.run_dir, comm.global_rank, self.attempt)
            self._decide = Decisions(self.journal, comm.rank == 0)
            self.shm = open_shm(p, comm, self.run_dir, self.attempt)  # None: private memory
            reserve = self.engine.estimate_state_bytes()
            if self.shm is not None:
                self.shm.reserve_bytes = reserve
                self.shm.reserve_alike = self.engine.state_replicated
            self.ring = SnapshotRing(
                p.snapshot.keep,
                alloc=self.shm.alloc if self.shm else None,
                on_drop=self.shm.drop if self.shm else None,
                reserve_bytes=0 if self.shm else reserve,
            )
            self.adjuster = LRAdjuster(p.adjust)
            ledger = Ledger(p.quarantine.ledger_url or os.path.join(self.run_dir, LEDGER_NAME))
            # Rank 0 reads, every rank gets the same set: shards must never overlap. Entries
            # an earlier process quarantined but could not write count as well.
            # The previous attempt's death in a loop body, if it died there (crashes.py),
            # is read with the ledger: before any rank's marker of this attempt replaces it.
            in_ledger, held, self._suspect = load_ledger(
                comm, ledger, self.run_dir, self._decide, self.attempt
            )
            crashed = self._suspect.culprits if self._suspect is not None else []
            in_ledger |= set(crashed)  # quarantined from the start: the replay skips them
            self.marker = StepMarker(self.run_dir, comm.global_rank, self.attempt)
            self._probing = False  # running a crash probe (forward only)
            self.cursor = DataCursor(comm, in_ledger, p.quarantine.window_steps)
            self.durable = DurableTier(
                p,
                comm,
                self.engine,
                self.run_dir,
                self.journal,
                self._event,
                self.shm,
                intervals=self.intervals,
            )
            self.heartbeat = Heartbeat(
                self.run_dir,
                comm.global_rank,
                self.attempt,
                p.supervisor.heartbeat_interval_s,
                on_error=lambda err: self.journal.write(
                    "heartbeat_failed", self.global_step, {"error": repr(err)}
                ),
            )
            self.keeper = StateKeeper(
                p, comm, self.engine, self.ring, self.durable, cursor=self.cursor,
                adjuster=self.adjuster, heartbeat=self.heartbeat, decide=self._decide, shm=self.shm,
                user=self.user_state,
            )  # fmt: skip
            self.check = StepCheck(p, comm, self.engine, self.durable, self.heartbeat, self._decide)
            # Replicas compare snapshot digests where every rank holds the state alike.
            self._replicated = comm.world_size > 1 and self.engine.digest_tensors()[1]
            # The step being run: phase (idle, batch, backward, stepped), micro-batches so far.
            self._phase, self._micro = "idle", 0
            self._cur_ids: list[int] = []
            self._loss: torch.Tensor | None = None
            self._given: torch.Tensor | None = None  # the tensor the loop gave to backward
            self._resumed = False  # batches() resumed (or found nothing to resume from)
            self._stepped = False  # a step was committed in this process
            self._checked: Checked | None = None  # the last step's check, as every rank saw it
            # torch's generators as the step's first micro-batch found them: re-runs of the
            # step start from there, so a NaN tied to a dropout mask reproduces.
            self._step_rng: tuple[torch.Tensor, Any] | None = None
            check_memory(p, comm, self.engine, self.shm.root if self.shm else None)
            self.metrics = Metrics(
                p.metrics, self.run_dir, self.attempt, comm.rank == 0, p.export.tensorboard_dir,
                on_error=lambda err: self.journal.write(
                    "write_failed", self.global_step,
                    {"file": "metrics", "path": self.metrics.path, "error": repr(err)},
                ),
                on_low=lambda step, low: self._decide("update_ratio_low", step, **low),
            )  # fmt: skip
            self.health = HealthChecker.for_policy(p, comm, self.run_dir)
            self.investigation = Investigation(p, comm, self.engine, self._decide)
            self.recovery = Recovery(
                p, comm, self.engine, ring=self.ring, cursor=self.cursor, adjuster=self.adjuster,
                ledger=ledger, durable=self.durable, metrics=self.metrics, heartbeat=self.heartbeat,
                health=self.health, journal=self.journal, user=self.user_state,
            )  # fmt: skip
            self.recovery.hold(held)
            if self._suspect is not None:
                if crashed:
                    self.recovery.quarantine_crashed(self._suspect)
                    self._suspect = None
                else:
                    s = self._suspect
                    self._decide("crash_suspected", s.step, micro=s.micro, ranks=s.ranks)
            self.lifecycle = Lifecycle(
                p, comm, self.run_dir, journal=self.journal, keeper=self.keeper,
                durable=self.durable, heartbeat=self.heartbeat, metrics=self.metrics,
                health=self.health, recovery=self.recovery, cursor=self.cursor,
            )  # fmt: skip
            self.tuner = Tuner(
                p.tune,
                p.snapshot.auto_every_steps,
                p.persist.auto_every_steps,
                p.snapshot.shared_memory,
                ring_min_steps(p.snapshot),
            )
            self._started = time.monotonic()
            self._writes_from = 0  # durable writes submitted by the last tuning
            self._step_times: list[tuple[float, bool]] = []  # (seconds, a write in flight)
            self._last_commit: float | None = None
            self._history = self._job_history() if self.tuner.active else _History()
            self._write_cost = self._history.write_cost  # training lost per durable write
            self.lifecycle.on_loop_error = self._loop_error  # an uncaught one, at exit
            inject(self)  # drills and tests: wraps the components their policy perturbs
            self.lifecycle.start(len(in_ledger), lambda: self.global_step)
        except BaseException:
            self._abandon_start()
            raise

    def _abandon_start(self) -> None:
        """Start-up failed part way: stop the threads and close the files it had opened (the
        persist and heartbeat threads, the shared-memory ring, the health group, the
        journal) and detach from the user's objects, so a script that catches the error and
        goes on holds none of them."""
        for close in (
            lambda: self.durable.close(),
            lambda: self.heartbeat.close(),
            lambda: self.health.close() if self.health is not None else None,
            lambda: self.shm.close(remove=ENV_SHM_DIR not in os.environ) if self.shm else None,
            lambda: self.journal.close(),
            lambda: self.marker.close(),
            lambda: self.engine.release(),
        ):
            try:
                close()
            except AttributeError:
                pass  # not built yet
            except Exception as err:  # closing failed: say so, go on with the rest
                logger.debug("abandoning a failed start: %r", err)

    # ------------------------------------------------------------------ public API ----
    @property
    def incidents(self) -> list[Incident]:
        return self.recovery.incidents

    @property
    def rollbacks(self) -> int:
        return self.recovery.rollbacks

    @property
    def lr(self) -> float | None:
        """The effective LR of the next step (first parameter group): the scheduler's value,
        which ``param_groups`` show, times the Guard's multiplier after an incident."""
        lr = self.engine.lr()
        return None if lr is None else lr * self.adjuster.multiplier()

    @property
    def loss(self) -> float | None:
        """The global mean loss of the last checked step (no extra sync; None before one)."""
        return self._checked.loss if self._checked is not None else None

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last checked step, before any clipping."""
        return self._checked.grad_norm if self._checked is not None else None

    @property
    def quarantined(self) -> frozenset[int]:
        """Sample ids (dataset indices) quarantined so far, the ledger's included."""
        return self.cursor.quarantined

    def register_state(self, name: str, obj: Any) -> None:
        """Keep ``obj``'s state in every snapshot under ``name``, as ``Guard(state=...)``
        does: ``obj.state_dict()`` is copied with each snapshot (each rank its own objects';
        they may differ between ranks) and ``obj.load_state_dict(state)`` gets it back on a
        rollback, with the model, and on resume. Update the object only on a step that
        returned ``"commit"``. Must be called before the first ``guard.batches``.

        Raises:
            UsageError: called after the first batch, ``name`` taken, ``obj`` lacks
                ``state_dict``/``load_state_dict``, or its state holds a value a durable
                snapshot cannot store (not a tensor, number, string, None, dict or list).
        """
        self.user_state.register(name, obj)

    def dataloader(self, dataset: Dataset[Any], batch_size: int, **options: Any) -> Any:
        """The loader to give ``guard.batches``: ``batch_size`` samples per rank, resumable
        (its position is saved with every snapshot), quarantined samples filtered out.

        A map-style dataset gets the Guard's sampler: deterministic in (seed, epoch),
        sharded over the group's ranks, the last incomplete global batch dropped; options
        ``shuffle=True``, ``seed=0`` and any ``DataLoader`` argument; sample ids are the
        dataset indices. Your own pipeline (needs torchdata) goes through its
        ``StatefulDataLoader``: an ``IterableDataset`` with ``sample_id=`` (the key of each
        sample's integer id, or a function of the sample) that yields this rank's samples;
        or a map-style dataset with ``sampler=`` (this rank's indices, e.g. a
        ``DistributedSampler``; the Guard calls its ``set_epoch``). See docs/loop.md.
        """
        return self.cursor.dataloader(dataset, batch_size, **options)

    def batches(self, loader: Any, max_steps: int) -> Iterator[Any]:
        """Yield batches until ``max_steps`` steps are committed, rewinding after rollbacks.

        During an incident it may also yield sub-batches of the bad step (re-runs for
        isolation); ``guard.step`` then returns ``"probe"`` and nothing is applied.
        """
        self.cursor.check_loader(loader)
        if not self._resumed:
            self._resumed = True
            step = self.keeper.resume() if self.policy.persist.resume else None
            self.global_step = self.global_step if step is None else step
            self.lifecycle.say_if_done(self.global_step, max_steps)
        if not self.ring.snapshots():
            self.keeper.capture(self.global_step, initial=True)
        while True:
            every = self.intervals.snapshot_steps  # tune may change it (every_steps: auto)
            if self.investigation.active:
                with self.investigation.rerun() as ids:
                    batch = self.cursor.rerun_batch(ids)
                    self._begin_batch(ids)
                    if self._step_rng is not None:
                        set_torch_rng_state(self._step_rng)
                    yield batch
                self._end_batch()
                continue
            if self.global_step >= max_steps:
                return
            self.cursor.open(loader, self.recovery.ledger.url)
            step = self.global_step
            if self._micro == 0 and step % every == 0 and not self.ring.has(step):
                self.keeper.capture(step)
            fetched = self.cursor.fetch()
            if fetched is None:
                continue  # end of an epoch
            s = self._suspect
            if s is not None and (s.step, s.micro) == (step, self._micro):
                yield from self._probe_crash(fetched[0])
            self._begin_batch(fetched[0])
            self.marker.set(step, self._micro, -1, IN_BODY)
            last = self._micro + 1 >= self.engine.micro_steps_per_step
            if self._micro == 0:
                self._step_rng = torch_rng_state()
            with contextlib.nullcontext() if last else self.engine.no_sync():
                yield fetched[1]  # a micro-batch before the last: no communication
            self._end_batch()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass of this step's loss. Must be called once per step, before step()."""
        if self._phase != "batch":
            raise self._misuse(
                "guard.backward was called "
                + (
                    "twice for one batch: call guard.backward and guard.step once per batch "
                    "(for gradient accumulation pass Guard(grad_accum_steps=N) and run one "
                    "batch per micro-batch; with DeepSpeed its gradient_accumulation_steps)"
                    if self._phase == "backward"
                    else "outside a guard.batches iteration"
                )
            )
        self._given = loss
        self._phase = "backward"
        real = not self.investigation.active and not self._probing
        self.heartbeat.enter("backward")
        if self._probing:
            return  # a crash probe: the forward was the test
        detached = loss.detach()
        if real and self._micro > 0 and self._loss is not None:
            self._loss = self._loss + detached  # gradient accumulation: checked as the mean
        else:
            self._loss = detached
        self._phase = "backward"
        if not real and not self.investigation.needs_backward:
            return  # a re-run judged by its loss alone needs no gradients
        self.engine.backward(loss)

    def step(self, loss: torch.Tensor | None = None) -> str:
        """Finite check, then commit or the incident pipeline. Must follow backward().

        Args:
            loss: optional; if given, the tensor given to ``backward`` (the check judges
                what backward saw, so a different tensor is refused).

        Returns:
            ``"commit"``, ``"overflow_skip"`` (a loss scaler skipped an overflowed step),
            ``"incident"`` (rolled back or isolating), ``"probe"`` (an isolation re-run) or
            ``"accumulate"`` (a micro-batch that is not the last of its step).

        Raises:
            GaveUp: the incident or data budget is spent (exit code 71 when uncaught).
            Unhealthy: a health check failed (exit code 72 when uncaught).
            Preempted: SIGTERM/SIGINT reached a rank; a durable snapshot of the state after
                this step was written (exit code 73 when uncaught).
        """
        if self._phase != "backward":
            raise self._misuse("guard.step needs guard.backward(loss) first, once per step")
        if loss is not None and loss is not self._given:
            raise self._misuse(
                "guard.step(loss) got another tensor than guard.backward: pass the same loss, "
                "or call guard.step()"
            )
        self._phase, self._given = "stepped", None
        if self._probing:
            return PROBE
        self.marker.set(self.global_step, self._micro, -1, IN_GUARD)
        assert self._loss is not None
        with self.lifecycle.closing_on_stop(lambda: self.global_step):
            if self.investigation.active:
                verdict = self.investigation.judge(self._loss)
                to = self.recovery.act(verdict) if verdict is not None else None
                if to is not None:
                    self._rolled_back(to)
                return PROBE
            return self._check()

    def close(self, persist: bool = True) -> None:
        """Finish the run: persist its final state (``persist`` and between steps only),
        stop the writer, journal the end. Safe to call twice."""
        between_steps = self._phase == "idle" and self.recovery.open is None
        self.lifecycle.close(self.global_step, persist, between_steps and self._resumed)
        self.engine.release()
        self.marker.close()

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # An error mid-step leaves nothing worth persisting: only a clean exit persists.
        if isinstance(exc, BaseException):
            self._loop_error(exc)
            if not isinstance(exc, RunStop):  # peers may be blocked in a collective
                note_error()
        self.close(persist=exc is None or isinstance(exc, RunStop))

    def _loop_error(self, err: BaseException) -> None:
        """An exception left the loop body (with ``with Guard(...)``, or uncaught at exit):
        journal the step and this rank's samples with it. The marker stays: the next
        attempt re-runs those samples one at a time (orchestrator/crashes.py)."""
        if self._phase not in ("batch", "backward") or isinstance(err, RunStop):
            return
        self.journal.write(
            "loop_error",
            self.global_step,
            {"micro": self._micro, "samples": list(self._cur_ids), "probe": self._probing,
             "error": repr(err)[:500], "collective": collective_failure(err)},
        )  # fmt: skip

    # ------------------------------------------------------------------ the step -------
    def _probe_crash(self, ids: list[int]) -> Iterator[Any]:
        """The previous attempt died in the loop body of this micro-batch: before it runs,
        each rank that was in its loop body runs its samples one at a time (forward only),
        the marker naming each; every rank runs as many (fillers), so collectives inside
        the model stay matched. Returns once all passed (journaled: a death in the batch
        after that quarantines them together)."""
        s = self._suspect
        assert s is not None
        self._suspect = None
        suspects = list(ids) if self.comm.global_rank in s.ranks else []
        probe = CrashProbe(suspects, ids[:1], self.comm.all_reduce_max(len(suspects)))
        self._probing = True
        rng = rng_state()  # the probes' forwards draw (dropout): the real batch must not see it
        try:
            while probe.pending:
                group, sample = probe.next()
                self.marker.set(s.step, s.micro, sample, IN_BODY)
                batch = self.cursor.rerun_batch(group)
                self._begin_batch(group)
                with self.engine.local_grads():
                    yield batch
                self._end_batch()
        finally:
            self._probing = False
        set_rng_state(rng)
        if suspects:
            self.journal.write(
                "crash_probes_clean", s.step, {"micro": s.micro, "samples": suspects}
            )

    def _begin_batch(self, ids: list[int]) -> None:
        self._cur_ids = ids
        self._phase = "batch"

    def _end_batch(self) -> None:
        if self._phase != "stepped":
            raise self._misuse(
                "the loop body must call guard.backward(loss) and guard.step() once per batch"
            )
        self._phase = "idle"

    def _check(self) -> str:
        """The finite check of a real step: one all-reduce, then the same branch everywhere."""
        assert self._loss is not None
        gas = self.engine.micro_steps_per_step
        if self._micro + 1 < gas:
            self.engine.accumulate()
            self._micro += 1
            self.cursor.micro_done()
            return ACCUMULATE
        self.ring.fence()  # snapshot copies in flight must land before anything mutates
        if self.comm.rank == 0 and self.metrics.ratio_due(self.global_step):
            self.metrics.before_update(list(self.engine.core.parameters()))
        snap = self.ring.at(self.global_step)  # taken at this step: its digest is compared
        digest = snap.digest if snap is not None and snap.agreed is None else None
        mult = self.adjuster.multiplier()
        grads = self.engine.judge(mult)
        loss = self._loss if gas == 1 else self._loss / gas
        ratio = self.metrics.pending()  # the last measured update ratio (rank 0)
        c = self._checked = self.check.run(
            self.global_step, loss, grads, self.lifecycle.signals.requested,
            digest=digest if self._replicated else None, extra=ratio,
        )  # fmt: skip
        if ratio is not None:
            self.metrics.resolve(c.extra)
        if snap is not None and c.agreed is not None:
            snap.agreed = c.agreed
            if c.agreed and c.digest is not None:
                self.recovery.replicas_agreed(self.global_step, c.digest)
        if c.reason is None:
            outcome = self._commit(
                OVERFLOW_SKIP if c.overflow else COMMIT, c.loss, c.grad_norm, mult
            )
        else:
            to = self.recovery.on_incident(self.global_step, c, self._loss, self.investigation)
            if to is not None:
                self._rolled_back(to)
            outcome = INCIDENT
        if c.stop and not self.investigation.active and self.recovery.open is None:
            # Some rank was asked to stop: all stop here, together.
            self.lifecycle.preempt(self.global_step)
        return outcome

    def _commit(self, outcome: str, loss: float, grad_norm: float, lr_multiplier: float) -> str:
        max_norm, coef = self.policy.clip.max_norm, None
        if max_norm is not None and outcome == COMMIT and grad_norm > max_norm:
            # torch's clip_grad_norm_ formula, by the norm the check all-reduced: every rank
            # scales its own (local or sharded) gradients by the same global factor.
            coef = max_norm / (grad_norm + 1e-6)
        # The check's verdict on the gradients, where it judged them: a loss scaler skips
        # by it (every rank alike, and no host sync of its own).
        overflow = outcome == OVERFLOW_SKIP if self.check.check_grads else None
        self.engine.commit(lr_multiplier, coef, overflow)
        checked = self._checked
        self.metrics.after_step(
            self.global_step, outcome, loss, grad_norm, lambda: self.lr, self._loss_scale,
            check_s=checked.seconds if checked is not None else None,
            writing=checked is not None and checked.writing,
        )  # fmt: skip
        self.cursor.commit(self.global_step)
        self._micro = 0
        self.keeper.seal_through(self.global_step, self.rollbacks)
        if not self._stepped:  # the goodput ledger's end of (re)start: one event per process
            self._stepped = True
            self._event("first_step", resumed=self._resumed)
        self.global_step += 1
        if self.tuner.active:
            now = time.monotonic()
            if self._last_commit is not None:
                checked = self._checked
                self._step_times.append(
                    (now - self._last_commit, bool(checked and checked.writing))
                )
            self._last_commit = now
            if self.tuner.due(self.global_step):
                self._retune()
        self.heartbeat.beat(self.global_step)
        phase = self.adjuster.on_commit()
        if phase is not None:
            self._event("adjust", phase=phase, lr_multiplier=self.adjuster.multiplier())
        return outcome

    def _loss_scale(self) -> float | None:
        """The loss scale for the metrics row: the check's read of it on an overflow step
        (one host sync a step, not two: tests/gpu counts them), else read now."""
        c = self._checked
        return (
            c.loss_scale
            if c is not None and c.loss_scale is not None
            else (self.engine.loss_scale())
        )

    def _rolled_back(self, step: int) -> None:
        self.global_step, self._micro = step, 0
        self.check.rewind(step)
        self._last_commit = None  # the incident's time is not a step's

    # ------------------------------------------------------------------ auto intervals --
    def _job_history(self) -> _History:
        """What the job saw before this process, from the journal (rank 0 reads; every rank
        gets the same). The write cost carries over: a job whose attempts crash before
        their first write must not measure it from scratch each time."""
        said = None
        if self.comm.rank == 0:
            events = list(read_journal(self.run_dir))
            starts = [
                float(e["time"]) for e in events if e["kind"] in ("run_start", "attempt_start")
            ]
            costs = [
                float(e["details"]["cost_s"])
                for e in events
                if e["kind"] == "interval"
                and e["details"].get("tier") == "persist"
                and e["details"].get("cost_s")
            ]
            supervised = any(e["kind"] == "attempt_start" for e in events)
            said = _History(
                incidents=sum(1 for e in events if e["kind"] == "incident"),
                # The supervisor's restarts (one per attempt, whichever node said it; a
                # preemption is not one); without it, torchrun's restarts.
                restarts=len(per_attempt(events, "restart")) if supervised else self.attempt,
                seconds=time.time() - min(starts) if starts else 0.0,
                write_cost=costs[-1] if costs else None,
            )
        out: _History = self.comm.broadcast_object(said)
        return out

    def _retune(self) -> None:
        """Every tune.every_steps steps (every rank at once): rank 0 measures and chooses,
        every rank applies the same intervals; a change is journaled with its inputs."""
        choice = None
        if self.comm.rank == 0:
            try:  # never leave the other ranks in the broadcast below
                choice = self._choose()
            except Exception as err:
                logger.warning("every_steps: auto: choosing failed (%r); intervals kept", err)
        said: tuple[Measured, dict[str, Any]] | None = self.comm.broadcast_object(choice)
        self._writes_from = self.durable.submitted
        self._step_times = []
        if said is None:
            return
        m, chosen = said
        for tier in ("snapshot", "persist"):
            c, old = chosen.get(tier), getattr(self.intervals, f"{tier}_steps")
            if c is None or c.every_steps == old:
                continue
            self._event(
                "interval", tier=tier, old=old, new=c.every_steps,
                optimum_s=round(c.interval_s, 4), cost_s=round(c.cost_s, 6),
                mtbf_s=round(c.mtbf_s, 1), step_s=round(c.step_s, 6), bounded_by=c.bounded_by,
                incidents=m.incidents, restarts=m.restarts, trained_s=round(m.trained_s, 1),
            )  # fmt: skip
            setattr(self.intervals, f"{tier}_steps", c.every_steps)

    def _choose(self) -> tuple[Measured, dict[str, Any]] | None:
        """Rank 0: what was measured since the last tuning and the intervals it gives
        (None: no step measured, e.g. right after a rollback)."""
        every = [s for s, _ in self._step_times]  # commit to commit, no incident inside
        if not every:
            return None
        idle = [s for s, w in self._step_times if not w]
        busy = [s for s, w in self._step_times if w]
        writes = self.durable.submitted - self._writes_from
        if idle and busy and writes >= 1:  # the loop's slowdown per durable write
            excess = sum(busy) - len(busy) * statistics.median(idle)
            if excess > 0:  # else noise: keep the last estimate
                self._write_cost = excess / writes
        stalls = list(self.keeper.stalls)
        h = self._history
        m = Measured(
            step_s=statistics.mean(every),
            snapshot_s=statistics.mean(stalls) if stalls else None,
            write_s=self._write_cost,  # the last measured (an earlier attempt's at first)
            incidents=h.incidents + len(self.recovery.incidents),
            restarts=h.restarts,
            trained_s=h.seconds + (time.monotonic() - self._started),
        )
        i = self.intervals
        return m, self.tuner.retune(m, i.snapshot_steps, i.persist_steps)

    # ------------------------------------------------------------------ helpers --------
    def _misuse(self, what: str) -> UsageError:
        return UsageError(f"[rank {self.comm.global_rank} step {self.global_step}] {what}")

    def _event(self, kind: str, **details: Any) -> None:
        """Journal a collective decision once (rank 0 of the group), at the current step."""
        self._decide(kind, self.global_step, **details)
