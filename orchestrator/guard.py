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
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from orchestrator.check import Checked
from orchestrator.comm import Comm, note_error
from orchestrator.context import Context
from orchestrator.crashes import IN_BODY, IN_GUARD, collective_failure
from orchestrator.engines import Engine, engine_for
from orchestrator.errors import RunStop
from orchestrator.factory import Components, Hooks, Teardown, build, open_context
from orchestrator.framework_steps import FrameworkSteps
from orchestrator.incident import Incident
from orchestrator.inject import inject
from orchestrator.policy import Policy, load_policy
from orchestrator.rejoin import Rejoin, replacement_start
from orchestrator.rng import set_torch_rng_state, torch_rng_state
from orchestrator.stateful import UserState
from orchestrator.stepping import ACCUMULATE, COMMIT, INCIDENT, OVERFLOW_SKIP, PROBE
from orchestrator.tuning import Intervals, resolve_auto

__all__ = ["ACCUMULATE", "COMMIT", "INCIDENT", "OVERFLOW_SKIP", "PROBE", "Guard"]


logger = logging.getLogger(__name__)


class Guard(FrameworkSteps):
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

    _rejoined = False  # re-formed in place during this step's backward (rejoin.py)

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
        self.comm = comm = replacement_start(Comm(process_group))  # issue 33: rejoin.py
        self.engine: Engine = engine_for(
            model, optimizer, scheduler, scaler, engine, grad_accum_steps
        )
        comm.device = self.engine.state_device()
        self.global_step = 0  # committed steps so far = index of the next step (0-based)
        # The step being run: phase (idle, batch, backward, stepped), micro-batches so far.
        self._phase, self._micro = "idle", 0
        self._cur_ids: list[int] = []
        self._queued: list[list[int]] = []  # begin_step's micro-batches (integrations)
        self._loss: torch.Tensor | None = None
        self._given: torch.Tensor | None = None  # the tensor the loop gave to backward
        self._probing = False  # running a crash probe (forward only)
        self._resumed = False  # batches() resumed (or found nothing to resume from)
        self._stepped = False  # a step was committed in this process
        self._checked: Checked | None = None  # the last step's check, as every rank saw it
        # torch's generators as the step's first micro-batch found them: re-runs of the
        # step start from there, so a NaN tied to a dropout mask reproduces.
        self._step_rng: tuple[torch.Tensor, Any] | None = None
        teardown = Teardown()
        teardown.add(self.engine.release)  # detach from the user's objects
        try:
            self.engine.check_policy(p)
            ctx = open_context(p, comm, run_dir, fresh)
            teardown.add(ctx.journal.close)
            self._adopt(
                ctx,
                build(p, ctx, self.engine, intervals=self.intervals, user=self.user_state,
                      hooks=Hooks(lambda: self.global_step, self._event), teardown=teardown),
            )  # fmt: skip
            self.lifecycle.on_loop_error = self._loop_error  # an uncaught one, at exit
            inject(self)  # drills and tests: wraps the components their policy perturbs
            self.lifecycle.start(self._quarantined_at_start, lambda: self.global_step)
        except BaseException:
            # Start-up failed part way: stop the threads and close the files it opened.
            teardown.run()
            raise

    def _adopt(self, ctx: Context, c: Components) -> None:
        """Hold the built components (drills and tests reach them by name)."""
        self.ctx, self.run_dir, self.attempt, self.journal = (
            ctx,
            ctx.run_dir,
            ctx.attempt,
            ctx.journal,
        )
        self._decide = ctx.decide
        self.shm, self.ring, self.adjuster, self.cursor = c.shm, c.ring, c.adjuster, c.cursor
        self.marker, self.durable, self.heartbeat = c.marker, c.durable, c.heartbeat
        self.keeper, self.check, self.metrics, self.health = c.keeper, c.check, c.metrics, c.health
        self.investigation, self.recovery, self.lifecycle = c.investigation, c.recovery, c.lifecycle
        self.autotune, self._suspect, self._quarantined_at_start = (
            c.autotune,
            c.suspect,
            c.quarantined,
        )
        self.rejoin = Rejoin(self)  # in-place recovery under the agent (issue 33)
        # Replicas compare snapshot digests where every rank holds the state alike.
        self._replicated = self.comm.world_size > 1 and self.engine.digest_tensors()[1]

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
        return self._effective_lr()

    @property
    def loss(self) -> float | None:
        """The global mean loss of the last checked step (no extra sync; None before one)."""
        return self._checked.loss if self._checked is not None else None

    @property
    def grad_norm(self) -> float | None:
        """The global gradient norm of the last checked step, before any clipping."""
        return self._checked.grad_norm if self._checked is not None else None

    @property
    def micro(self) -> int:
        """The current micro-batch's index in its optimizer step (0-based; always 0 without
        gradient accumulation). A rollback sets it back to 0."""
        return self._micro

    @property
    def last_micro(self) -> bool:
        """The current micro-batch is the last of its optimizer step: the one whose backward
        communicates and whose ``guard.step`` may commit (where a loop clips by hand)."""
        return self._micro + 1 >= self.engine.micro_steps_per_step

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
        self._open_run(max_steps)
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
        try:
            self.engine.backward(loss)
        except RuntimeError as err:  # a peer died in DDP's all-reduce: in place if we can
            if not (real and self.rejoin.survive(err)):
                raise
            self._rejoined = True

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
        if self._rejoined:  # backward's collective broke: re-formed and rolled back
            self._rejoined = False
            return INCIDENT
        self.marker.set(self.global_step, self._micro, -1, IN_GUARD)
        assert self._loss is not None
        with self.lifecycle.closing_on_stop(lambda: self.global_step):
            if self.investigation.active:
                verdict = self.investigation.judge(self._loss)
                to = self.recovery.act(verdict) if verdict is not None else None
                if to is not None:
                    self._rolled_back(to)
                return PROBE
            try:
                return self._check()
            except RuntimeError as err:  # a peer died in the check's all-reduce
                if not self.rejoin.survive(err):
                    raise
                return INCIDENT

    def close(self, persist: bool = True) -> None:
        """Finish the run: persist its final state (``persist`` and between steps only),
        stop the writer, journal the end. Safe to call twice."""
        self._close(persist, keep_marker=False)

    def _close(self, persist: bool, keep_marker: bool) -> None:
        between_steps = self._phase == "idle" and self.recovery.open is None
        self.lifecycle.close(self.global_step, persist, between_steps and self._resumed)
        self.engine.release()
        self.marker.close(keep=keep_marker)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # An error mid-step leaves nothing worth persisting: only a clean exit persists.
        in_body = False
        if isinstance(exc, BaseException):
            self._loop_error(exc)
            if not isinstance(exc, RunStop):  # peers may be blocked in a collective
                note_error()
                in_body = self._phase in ("batch", "backward")
        # An error in the loop body keeps the marker: the next attempt probes those samples.
        self._close(exc is None or isinstance(exc, RunStop), keep_marker=in_body)

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
