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

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from orchestrator.adjust import LRAdjuster
from orchestrator.check import StepCheck
from orchestrator.comm import Comm
from orchestrator.cursor import DataCursor
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine, engine_for
from orchestrator.errors import RunStop, UsageError
from orchestrator.faults import FaultInjector
from orchestrator.health import HealthChecker
from orchestrator.heartbeat import Heartbeat
from orchestrator.incident import Incident
from orchestrator.investigate import Investigation
from orchestrator.journal import Decisions, Journal
from orchestrator.keeper import StateKeeper
from orchestrator.lifecycle import Lifecycle, check_memory, resolve_run_dir
from orchestrator.metrics import Metrics
from orchestrator.policy import Policy, load_policy
from orchestrator.protocol import ENV_ATTEMPT, LEDGER_NAME
from orchestrator.quarantine import Ledger
from orchestrator.recovery import Recovery
from orchestrator.snapshot import SnapshotRing

# Outcomes of Guard.step.
COMMIT, OVERFLOW_SKIP, ACCUMULATE = "commit", "overflow_skip", "accumulate"
INCIDENT, PROBE = "incident", "probe"
__all__ = ["ACCUMULATE", "COMMIT", "INCIDENT", "OVERFLOW_SKIP", "PROBE", "Guard"]


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
            ``guard.step`` calls ``engine.step``; user code calls neither.
        process_group: the group whose ranks decide together (default: the world group when
            torch.distributed is initialized, else single-process).
        run_dir: journal, ledger and fault memory; default $ORCHESTRATOR_RUN_DIR, else a fresh
            ``./runs/<time>-<pid>`` chosen by rank 0.

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
    ) -> None:
        self.policy = p = policy if policy is not None else load_policy()
        self.comm = comm = Comm(process_group)
        self.engine: Engine = engine_for(model, optimizer, scheduler, scaler, engine)
        self.engine.check_policy(p)
        self.run_dir = resolve_run_dir(comm, run_dir)
        self.attempt = int(os.environ.get(ENV_ATTEMPT, "0"))
        self.global_step = 0  # committed steps so far = index of the next step (0-based)
        self.journal = Journal(self.run_dir, comm.global_rank, self.attempt)
        self._decide = Decisions(self.journal, comm.rank == 0)
        self.ring = SnapshotRing(p.snapshot.keep)
        self.adjuster = LRAdjuster(p.adjust)
        self.faults = FaultInjector(p.faults, comm.global_rank, self.run_dir, self.journal)
        ledger = Ledger(p.quarantine.ledger_url or os.path.join(self.run_dir, LEDGER_NAME))
        # Rank 0 reads, every rank gets the same set: shards must never overlap.
        in_ledger = comm.broadcast_object(ledger.load() if comm.rank == 0 else None)
        self.cursor = DataCursor(comm.rank, comm.world_size, in_ledger, p.quarantine.window_steps)
        self.durable = DurableTier(
            p, comm, self.engine, self.run_dir, self.journal, self.faults, self._event
        )
        self.heartbeat = Heartbeat(
            self.run_dir, comm.global_rank, self.attempt, p.supervisor.heartbeat_interval_s
        )
        self.keeper = StateKeeper(
            p, comm, self.engine, self.ring, self.durable, self.heartbeat, self._decide
        )
        self.check = StepCheck(p, comm, self.engine, self.durable, self.heartbeat)
        # The step being run: phase idle -> batch -> backward -> stepped, its micro-batches
        # so far (gradient accumulation), the ids of the batch and the loss it checks.
        self._phase = "idle"
        self._micro = 0
        self._cur_ids: list[int] = []
        self._loss: torch.Tensor | None = None
        self._given: torch.Tensor | None = None  # the tensor the loop gave to backward
        self._resumed = False

        check_memory(p, comm, self.engine)
        self.metrics = Metrics(p.metrics, self.run_dir, self.attempt, comm.rank == 0)
        self.faults.install_module_faults(
            self.engine.core, lambda: self.global_step, lambda: self.investigation.incident_step
        )
        self.health = HealthChecker.for_policy(p, comm, self.faults, self.run_dir)
        self.investigation = Investigation(p, comm, self.engine, self._decide)
        self.recovery = Recovery(
            p,
            comm,
            self.engine,
            ring=self.ring,
            cursor=self.cursor,
            adjuster=self.adjuster,
            ledger=ledger,
            durable=self.durable,
            metrics=self.metrics,
            heartbeat=self.heartbeat,
            health=self.health,
            journal=self.journal,
        )
        self.lifecycle = Lifecycle(
            p,
            comm,
            self.run_dir,
            journal=self.journal,
            keeper=self.keeper,
            durable=self.durable,
            heartbeat=self.heartbeat,
            metrics=self.metrics,
            health=self.health,
            recovery=self.recovery,
            cursor=self.cursor,
        )
        self.lifecycle.start(quarantined=len(in_ledger))

    # ------------------------------------------------------------------ public API ----
    @property
    def incidents(self) -> list[Incident]:
        return self.recovery.incidents

    @property
    def rollbacks(self) -> int:
        return self.recovery.rollbacks

    @property
    def quarantined(self) -> frozenset[int]:
        """Sample ids (dataset indices) quarantined so far, the ledger's included."""
        return self.cursor.quarantined

    def dataloader(self, dataset: Dataset[Any], batch_size: int, **options: Any) -> DataLoader[Any]:
        """A DataLoader whose batches are deterministic in (seed, epoch), sharded over the
        group's ranks (``batch_size`` per rank), resumable, and free of quarantined samples.

        Options: ``shuffle=True``, ``seed=0``, ``collate_fn``, ``num_workers=0``, and any
        other ``DataLoader`` argument but the sampler's. Sample ids are dataset indices;
        they stay inside the Guard. The last incomplete global batch of an epoch is dropped
        so every rank runs the same number of steps.
        """
        return self.cursor.dataloader(dataset, batch_size, **options)

    def batches(self, loader: DataLoader[Any], max_steps: int) -> Iterator[Any]:
        """Yield batches until ``max_steps`` steps are committed, rewinding after rollbacks.

        During an incident it may also yield sub-batches of the bad step (re-runs for
        isolation); ``guard.step`` then returns ``"probe"`` and nothing is applied.
        """
        self.cursor.check_loader(loader)
        if not self._resumed:
            self._resumed = True
            g = self.keeper.resume() if self.policy.persist.resume else None
            if g is not None:
                self.global_step = int(g["step"])
                self.cursor.rewind(self.global_step, (int(g["epoch"]), int(g["offset"])))
                self.adjuster.load_state_dict(g["adjust"])
        if not self.ring.snapshots():
            self.keeper.capture(self._guard_state(), initial=True)
        every = self.policy.snapshot.every_steps
        while True:
            if self.investigation.active:
                with self.investigation.rerun() as ids:
                    batch = loader.collate_fn([loader.dataset[i] for i in ids])
                    self._begin_batch(ids)
                    yield batch
                self._end_batch()
                continue
            if self.global_step >= max_steps:
                return
            self.cursor.open(loader, self.recovery.ledger.url)
            step = self.global_step
            if self._micro == 0 and step % every == 0 and not self.ring.has(step):
                self.keeper.capture(self._guard_state())
            fetched = self.cursor.fetch()
            if fetched is None:
                continue  # end of an epoch
            self._begin_batch(fetched[0])
            yield fetched[1]
            self._end_batch()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass of this step's loss. Must be called once per step, before step()."""
        if self._phase != "batch":
            raise UsageError(
                f"[rank {self.comm.global_rank} step {self.global_step}] guard.backward was called "
                + (
                    "twice for one batch: call guard.backward and guard.step once per batch "
                    "(gradient accumulation works with DeepSpeed's gradient_accumulation_steps, "
                    "one batch per micro-step; not yet with plain PyTorch or FSDP)"
                    if self._phase == "backward"
                    else "outside a guard.batches iteration"
                )
            )
        self._given = loss
        real = not self.investigation.active
        self.heartbeat.enter("backward")
        loss = self.faults.on_loss(loss, self.global_step, self._cur_ids, one_shot=real)
        detached = loss.detach()
        if real and self._micro > 0 and self._loss is not None:
            self._loss = self._loss + detached  # gradient accumulation: checked as the mean
        else:
            self._loss = detached
        self._phase = "backward"
        if not real and not self.investigation.needs_backward:
            return  # a re-run judged by its loss alone needs no gradients
        self.engine.backward(loss, poison=real and self.faults.grad_fault(self.global_step))

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
            raise UsageError(
                f"[rank {self.comm.global_rank} step {self.global_step}] guard.step needs "
                "guard.backward(loss) first, once per step"
            )
        if loss is not None and loss is not self._given:
            raise UsageError(
                f"[rank {self.comm.global_rank} step {self.global_step}] guard.step(loss) got "
                "another tensor than guard.backward: pass the same loss, or call guard.step()"
            )
        self._phase, self._given = "stepped", None
        assert self._loss is not None
        with self.lifecycle.closing_on_stop(lambda: self.global_step):
            if self.investigation.active:
                verdict = self.investigation.judge(self._loss)
                if verdict is not None:
                    self._rolled_back(self.recovery.act(verdict))
                return PROBE
            return self._check()

    def close(self, persist: bool = True) -> None:
        """Finish the run: persist its final state (``persist`` and between steps only),
        stop the writer, journal the end. Safe to call twice."""
        between_steps = self._phase == "idle" and self.recovery.open is None
        final = self._guard_state if between_steps and self._resumed else None
        self.lifecycle.close(self.global_step, persist, final)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # An error mid-step leaves no state worth persisting (and other ranks may be
        # blocked in a collective): only a clean exit persists.
        self.close(persist=exc is None or isinstance(exc, RunStop))

    # ------------------------------------------------------------------ the step -------
    def _begin_batch(self, ids: list[int]) -> None:
        self._cur_ids = ids
        self._phase = "batch"

    def _end_batch(self) -> None:
        if self._phase != "stepped":
            raise UsageError(
                f"[rank {self.comm.global_rank} step {self.global_step}] the loop body must call "
                "guard.backward(loss) and guard.step() once for every batch"
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
        self.faults.process_faults(self.global_step)
        grads = self.engine.judge(self.adjuster.multiplier())
        loss = self._loss if gas == 1 else self._loss / gas
        c = self.check.run(self.global_step, loss, grads, self.lifecycle.signals.requested)
        if c.reason is None:
            outcome = self._commit(OVERFLOW_SKIP if c.overflow else COMMIT, c.loss, c.grad_norm)
        else:
            inc = self.recovery.open_incident(
                self.global_step, c.reason, c.loss, c.grad_norm, self._loss
            )
            if self.investigation.reruns and c.reason.startswith("nonfinite"):
                self.investigation.start(
                    inc,
                    self.cursor.step_ids,
                    self.recovery.step_samples,
                    self.recovery.previous_step,
                )
            else:
                self._rolled_back(self.recovery.act_uninvestigated())
            outcome = INCIDENT
        if c.stop and not self.investigation.active and self.recovery.open is None:
            # Some rank was asked to stop: all stop here, together.
            self.lifecycle.preempt(self.global_step, self._guard_state)
        return outcome

    def _commit(self, outcome: str, loss: float, grad_norm: float) -> str:
        max_norm, coef = self.policy.clip.max_norm, None
        if max_norm is not None and outcome == COMMIT and grad_norm > max_norm:
            # torch's clip_grad_norm_ formula, by the norm the check all-reduced: every rank
            # scales its own (local or sharded) gradients by the same global factor.
            coef = max_norm / (grad_norm + 1e-6)
        self.engine.commit(self.adjuster.multiplier(), coef)
        low = self.metrics.after_step(
            self.global_step, outcome, loss, grad_norm, self._lr, self.engine.loss_scale
        )
        if low is not None:
            self._event("update_ratio_low", **low)
        self.cursor.commit(self.global_step)
        self._micro = 0
        self.keeper.seal_through(self.global_step, self.rollbacks)
        self.global_step += 1
        self.heartbeat.beat(self.global_step)
        phase = self.adjuster.on_commit()
        if phase is not None:
            self._event("adjust", phase=phase, lr_multiplier=self.adjuster.multiplier())
        return outcome

    def _lr(self) -> float | None:
        """The LR the step ran with: the scheduler's times the Guard's multiplier."""
        lr = self.engine.lr()
        return None if lr is None else lr * self.adjuster.multiplier()

    def _rolled_back(self, step: int) -> None:
        self.global_step, self._micro = step, 0

    # ------------------------------------------------------------------ state ----------
    def _guard_state(self) -> dict[str, Any]:
        """Counters and data position saved with every snapshot. The position counts samples
        of the unfiltered order, so it holds at any world size and batch size."""
        epoch, offset = self.cursor.pos
        return {
            "step": self.global_step,
            "epoch": epoch,
            "offset": offset,
            "adjust": self.adjuster.state_dict(),
        }

    # ------------------------------------------------------------------ helpers --------
    def _event(self, kind: str, **details: Any) -> None:
        """Journal a collective decision once (rank 0 of the group), at the current step."""
        self._decide(kind, self.global_step, **details)
