"""The Guard: the per-step protocol inside every rank.

Healthy step (hot path): ``guard.backward(loss)``; ``guard.step(loss)`` packs the local
finite flags, the loss and the grad-norm^2 into one tensor, all-reduces it once, and every
rank takes the same branch: commit (optimizer + scheduler step, maybe seal a snapshot) or
incident. Every ``snapshot.every_steps`` steps, at the step boundary, the state is copied
into the host ring.

Incident (cold path, may cost seconds; :mod:`orchestrator.recovery`): name the origin
ranks, run the health checks, check the incident budget, re-run the bad step through the
user's own loop (isolation, forensics), quarantine, roll back to the newest sealed snapshot
old enough, adjust, and let ``guard.batches`` rewind the data.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch.utils.data import DataLoader, Dataset

from orchestrator.adjust import LRAdjuster
from orchestrator.comm import Comm
from orchestrator.data import GuardBatchSampler
from orchestrator.detect import (
    GRAD_NONFINITE,
    GRAD_NORM_SQ,
    LOSS,
    LOSS_NONFINITE,
    STOP,
    SpikeDetector,
    pack_local,
)
from orchestrator.diagnose import (
    ModuleLocator,
    full_precision,
    install_nan_module,
)
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine, TorchEngine
from orchestrator.engines.fsdp import FSDP1Engine, FSDP2Engine, is_fsdp2
from orchestrator.errors import (
    OrchestratorError,
    PersistError,
    PolicyError,
    Preempted,
    RunStop,
    UsageError,
)
from orchestrator.faults import FaultInjector
from orchestrator.health import HealthChecker
from orchestrator.heartbeat import Heartbeat
from orchestrator.incident import Incident
from orchestrator.isolate import Bisection
from orchestrator.journal import Journal
from orchestrator.logs import RankLogger
from orchestrator.metrics import Metrics
from orchestrator.policy import NanModuleFault, Policy, load_policy
from orchestrator.protocol import ENV_ATTEMPT, ENV_RUN_DIR, LEDGER_NAME, POLICY_NAME
from orchestrator.quarantine import Ledger
from orchestrator.recovery import INCIDENT, PROBE, IncidentPipeline
from orchestrator.recovery import logger as recovery_logger
from orchestrator.snapshot import Snapshot, SnapshotRing

# Outcomes of Guard.step.
COMMIT, OVERFLOW_SKIP, ACCUMULATE = "commit", "overflow_skip", "accumulate"
__all__ = ["ACCUMULATE", "COMMIT", "INCIDENT", "OVERFLOW_SKIP", "PROBE", "Guard"]


class Guard(IncidentPipeline):
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
        self.policy = policy if policy is not None else load_policy()
        self.comm = Comm(process_group)
        self.engine: Engine = _engine_for(model, optimizer, scheduler, scaler, engine)
        if self.policy.clip.max_norm is not None and not self.engine.guard_clips:
            raise UsageError(
                f"clip.max_norm={self.policy.clip.max_norm}: DeepSpeed clips gradients inside "
                "its own step; set gradient_clipping in the DeepSpeed config instead and "
                "remove clip.max_norm from the policy"
            )
        self.run_dir = self._resolve_run_dir(run_dir)
        self.attempt = int(os.environ.get(ENV_ATTEMPT, "0"))
        self.journal = Journal(self.run_dir, self.comm.global_rank, self.attempt)
        self.log = RankLogger(recovery_logger, self.comm.global_rank, lambda: self.global_step)
        self.ring = SnapshotRing(self.policy.snapshot.keep)
        self.adjuster = LRAdjuster(self.policy.adjust)
        self.spikes = SpikeDetector(self.policy.detect.spike)
        self.faults = FaultInjector(
            self.policy.faults, self.comm.global_rank, self.run_dir, self.journal
        )
        q = self.policy.quarantine
        self.ledger = Ledger(q.ledger_url or os.path.join(self.run_dir, LEDGER_NAME))
        # Rank 0 reads, every rank gets the same set: shards must never overlap.
        self._quarantined: set[int] = self.comm.broadcast_object(
            self.ledger.load() if self.comm.rank == 0 else None
        )

        self.global_step = 0  # committed steps so far = index of the next step (0-based)
        self.incidents: list[Incident] = []
        self.rollbacks = 0
        self._sampler: GuardBatchSampler | None = None
        self._pos = (0, 0)  # (epoch, offset in the unfiltered order) of the next batch
        self._next_offset = 0  # where the batch being run ends
        # (step, positions of its batches) of the last committed steps, for window quarantine
        self._recent: deque[tuple[int, list[tuple[int, int]]]] = deque(
            maxlen=max(q.window_steps, 0) + 1
        )
        self._cur_ids: list[int] = []  # sample ids of the batch being run
        # The step being run: its micro-batches so far (gradient accumulation), their
        # positions and sample ids.
        self._micro = 0
        self._step_positions: list[tuple[int, int]] = []
        self._step_ids: list[int] = []
        self._phase = "idle"  # idle -> batch -> backward -> stepped
        self._loss: torch.Tensor | None = None
        self._probe: Bisection | None = None
        self._probe_steps = 0
        self._open: Incident | None = None
        self._locator: ModuleLocator | None = None  # forensics hooks for the next re-run
        self._located: dict[str, str] | None = None
        self._fp32_ids: list[int] | None = None  # the fp32 re-run to do next (forensics)
        self._fp32_running = False
        self._precision: str | None = None  # this rank's fp32 re-run verdict
        self._reset_iter = True
        self._closed = False
        self._evidence: dict[str, Any] = {}  # the open incident's, journaled with its cause

        self.durable = DurableTier(
            self.policy,
            self.comm,
            self.engine,
            self.run_dir,
            self.journal,
            self.faults,
            self._event,
        )
        self._resumed = False
        self.heartbeat = Heartbeat(
            self.run_dir,
            self.comm.global_rank,
            self.attempt,
            self.policy.supervisor.heartbeat_interval_s,
        )
        self._stop_requested = False
        self._old_handlers: dict[int, Any] = {}

        self._check_memory()
        self.metrics = Metrics(self.policy.metrics, self.run_dir, self.attempt, self.comm.rank == 0)
        self._fault_hooks = [
            install_nan_module(self.engine.core, f.module, functools.partial(self._nan_armed, f))
            for f in self.policy.faults
            if isinstance(f, NanModuleFault) and f.rank in (None, self.comm.global_rank)
        ]
        h, d = self.policy.health, self.policy.diagnose
        wanted = (
            h.preflight
            or h.on_incident
            or (d.rerun and any("health" in a for a in d.actions.values()))
        )
        self.health = HealthChecker(h, self.comm, self.faults, self.run_dir) if wanted else None
        if self.comm.rank == 0:
            with open(os.path.join(self.run_dir, POLICY_NAME), "w", encoding="utf-8") as f:
                yaml.safe_dump(self.policy.model_dump(mode="json"), f, sort_keys=False)
        self._event(
            "run_start",
            world_size=self.comm.world_size,
            run_dir=self.run_dir,
            policy_digest=self.policy.digest(),
            quarantined=len(self._quarantined),
            faults=len(self.policy.faults),
        )
        if self.health is not None and h.preflight:
            self._check_health("preflight")
        self._install_stop_handlers()  # last: a failed start must not keep them

    # ------------------------------------------------------------------ public API ----
    def dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Any = None,
        num_workers: int = 0,
        **loader_kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader whose batches are deterministic in (seed, epoch), sharded over the
        group's ranks (``batch_size`` per rank), resumable, and free of quarantined samples.

        Sample ids are dataset indices; they stay inside the Guard. The last incomplete
        global batch of an epoch is dropped so every rank runs the same number of steps.
        """
        self._sampler = GuardBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            batch_size,
            rank=self.comm.rank,
            world_size=self.comm.world_size,
            seed=seed,
            shuffle=shuffle,
        )
        self._sampler.quarantine(self._quarantined)
        # DataLoader draws its workers' base seed from this generator each time an iterator
        # is made. Without its own generator that draw comes from the global torch RNG, and
        # the extra iterator made after a rollback would shift every later dropout mask.
        loader_kwargs.setdefault("generator", torch.Generator())
        return DataLoader(
            dataset,
            batch_sampler=self._sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            **loader_kwargs,
        )

    def batches(self, loader: DataLoader[Any], max_steps: int) -> Iterator[Any]:
        """Yield batches until ``max_steps`` steps are committed, rewinding after rollbacks.

        During an incident it may also yield sub-batches of the bad step (re-runs for
        isolation); ``guard.step`` then returns ``"probe"`` and nothing is applied.
        """
        sampler = self._sampler
        if sampler is None or loader.batch_sampler is not sampler:
            raise UsageError("guard.batches needs the DataLoader returned by guard.dataloader")
        assert sampler is not None  # narrowed for mypy, which loses it across the loop
        if not self._resumed:
            self._resumed = True
            if self.policy.persist.resume:
                found = self.durable.find_resume()
                if found is not None:
                    self._restore_resumed(*found)
        if not self.ring.snapshots():
            self._snapshot(initial=True)
        it: Iterator[Any] | None = None
        while True:
            if self._probe is not None:
                fp32, self._fp32_ids = self._fp32_ids, None
                ids = fp32 if fp32 is not None else self._probe.next_group()
                batch = loader.collate_fn([loader.dataset[i] for i in ids])
                self._begin_batch(ids)
                # Forensics hooks exist only during the first re-run (the whole step).
                hooks: contextlib.AbstractContextManager[Any] | None = (
                    self._locator if self._probe_steps == 0 else None
                )
                if fp32 is not None:
                    self._fp32_running = True
                    hooks = full_precision(self.engine.core)
                with self.engine.local_grads(), hooks or contextlib.nullcontext():
                    yield batch
                self._end_batch()
                continue
            if self.global_step >= max_steps:
                return
            if it is None or self._reset_iter:
                if sampler.remaining_batches(*self._pos) == 0:
                    if self._pos[1] == 0:
                        raise OrchestratorError(
                            f"epoch {self._pos[0]} has no full batch: "
                            f"{len(sampler.quarantined)} samples are quarantined in "
                            f"{self.ledger.url}; review the ledger or lower the batch size"
                        )
                    self._pos = (self._pos[0] + 1, 0)
                    continue
                sampler.set_position(*self._pos)
                if loader.generator is not None:
                    # Worker base seeds become a function of the data position. Replays are
                    # bit for bit with num_workers=0, or with per-sample seeded randomness.
                    loader.generator.manual_seed(hash((sampler.seed, *self._pos)))
                it, self._reset_iter = iter(loader), False
            if (
                self._micro == 0
                and self.global_step % self.policy.snapshot.every_steps == 0
                and not self.ring.has(self.global_step)
            ):
                self._snapshot()
            try:
                batch = next(it)
            except StopIteration:
                self._pos, it = (self._pos[0] + 1, 0), None
                continue
            ids, self._next_offset = sampler.batch_at(*self._pos)
            self._begin_batch(ids)
            self._step_positions.append(self._pos)
            self._step_ids.extend(ids)
            yield batch
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
        real = self._probe is None
        self.heartbeat.enter("backward")
        fault = self.faults.loss_fault(self.global_step, self._cur_ids, one_shot=real)
        if fault == "poison":
            loss = loss * float("nan")
        elif fault == "inf":
            loss = loss + float("inf")
        detached = loss.detach()
        if real and self._micro > 0 and self._loss is not None:
            self._loss = self._loss + detached  # gradient accumulation: checked as the mean
        else:
            self._loss = detached
        self._phase = "backward"
        if not real and (self._fp32_running or not self._probe_judges_grads):
            return  # an isolation re-run judged by its loss alone needs no gradients
        if real and self.engine.poison_before_backward and self.faults.grad_fault(self.global_step):
            self.engine.poison_grad()
        self.engine.backward(loss)

    def step(self, loss: torch.Tensor | None = None) -> str:
        """Finite check, then commit or the incident pipeline. Must follow backward().

        Returns:
            ``"commit"``, ``"overflow_skip"`` (a loss scaler skipped an overflowed step),
            ``"incident"`` (rolled back or isolating), ``"probe"`` (an isolation re-run) or
            ``"accumulate"`` (a micro-batch that is not the last of its step).

        Raises:
            GaveUp: the incident or data budget is spent (exit code 71 when uncaught).
            Preempted: SIGTERM/SIGINT reached a rank; a durable snapshot of the state after
                this step was written (exit code 73 when uncaught).
        """
        del loss  # the loss seen by backward (with any injected fault) is the one checked
        if self._phase != "backward":
            raise UsageError(
                f"[rank {self.comm.global_rank} step {self.global_step}] guard.step needs "
                "guard.backward(loss) first, once per step"
            )
        self._phase = "stepped"
        assert self._loss is not None
        if self._probe is not None:
            return self._probe_step()
        gas = self.engine.micro_steps_per_step
        if self._micro + 1 < gas:
            self.engine.accumulate()
            self._micro += 1
            self._pos = (self._pos[0], self._next_offset)
            return ACCUMULATE
        self.ring.fence()  # snapshot copies in flight must land before anything mutates
        if self.comm.rank == 0 and self.metrics.ratio_due(self.global_step):
            self.metrics.before_update(list(self.engine.core.parameters()))
        self.faults.process_faults(self.global_step)
        if not self.engine.poison_before_backward and self.faults.grad_fault(self.global_step):
            self.engine.poison_grad()
        self.engine.prepare_check(self.adjuster.multiplier())
        grads = self.engine.grads()
        check_grads = self.policy.detect.check_grads
        control = (float(self._stop_requested), *self.durable.control())
        loss = self._loss if gas == 1 else self._loss / gas
        packed = pack_local(loss, grads, check_grads, control)
        self.heartbeat.enter("check")  # a rank that never gets here is the one others wait for
        vals = self.comm.all_reduce_sum_(packed).tolist()  # the one host sync of the step
        self.durable.observe(vals, self.global_step)
        outcome = self._decide(vals)
        if vals[STOP] > 0 and self._probe is None and self._open is None:
            self._preempt()  # some rank was asked to stop: all stop here, together
        return outcome

    def _decide(self, vals: list[float]) -> str:
        world = self.comm.world_size
        gloss = vals[LOSS] / world
        gnorm = math.sqrt(vals[GRAD_NORM_SQ] / (world if self.engine.grads_replicated else 1))
        reason = None
        if vals[LOSS_NONFINITE] > 0:
            reason = "nonfinite_loss"
        elif vals[GRAD_NONFINITE] > 0:
            if self.engine.has_loss_scaler:
                return self._commit(OVERFLOW_SKIP, gloss, gnorm)
            reason = "nonfinite_grads"
        else:
            spike = self.spikes.check({"loss": gloss, "grad_norm": gnorm})
            if spike is not None:
                reason = f"spike_{spike[0]}"
        if reason is not None:
            return self._incident(reason, gloss, gnorm)
        return self._commit(COMMIT, gloss, gnorm)

    def close(self, persist: bool = True) -> None:
        """Finish the run: persist its final state (``persist`` and between steps only),
        stop the writer, journal the end. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        between_steps = self._phase == "idle" and self._probe is None and self._open is None
        if persist and between_steps and self._resumed:
            self.heartbeat.beat(self.global_step, phase="closing", force=True)
            self._persist_final()
        self.durable.close()
        self.metrics.flush()
        if self.health is not None:
            self.health.close()
        self.heartbeat.beat(self.global_step, phase="done", force=True)
        self.heartbeat.close()
        if threading.current_thread() is threading.main_thread():
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
        self._event(
            "run_end",
            status="finished" if persist and between_steps else "stopped",
            steps=self.global_step,
            incidents=len(self.incidents),
            rollbacks=self.rollbacks,
            quarantined=sorted(self._sampler.quarantined) if self._sampler else [],
            **self._quarantine_summary(),
        )
        self.journal.close()

    def _quarantine_summary(self) -> dict[str, Any]:
        if self._sampler is None:
            return {}
        seen = self._samples_seen()
        return {"samples_seen": seen, "quarantined_fraction": len(self._sampler.quarantined) / seen}

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # An error mid-step leaves no state worth persisting (and other ranks may be
        # blocked in a collective): only a clean exit persists.
        self.close(persist=exc is None or isinstance(exc, RunStop))

    # ------------------------------------------------------------------ hot path -------
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

    def _commit(self, outcome: str, loss: float, grad_norm: float) -> str:
        mult = self.adjuster.multiplier()
        max_norm = self.policy.clip.max_norm
        if max_norm is not None and outcome == COMMIT and grad_norm > max_norm:
            # torch's clip_grad_norm_ formula, by the norm the check all-reduced: every rank
            # scales its own (local or sharded) gradients by the same global factor.
            self.engine.clip_grads(max_norm / (grad_norm + 1e-6))
        self.engine.commit(mult)
        if self.metrics.due(self.global_step) or self.metrics.ratio_due(self.global_step):
            self._record_metrics(outcome, loss, grad_norm, mult)
        self._recent.append((self.global_step, self._step_positions))
        self._pos = (self._pos[0], self._next_offset)
        self._new_step()
        for snap in self.ring.seal_through(self.global_step, self.policy.snapshot.seal_after_steps):
            self.durable.on_sealed(snap, self.rollbacks)
        self.global_step += 1
        self.heartbeat.beat(self.global_step)
        phase = self.adjuster.on_commit()
        if phase is not None:
            self._event("adjust", phase=phase, lr_multiplier=self.adjuster.multiplier())
        return outcome

    def _record_metrics(self, outcome: str, loss: float, grad_norm: float, mult: float) -> None:
        """Rank 0: one metrics row (values already on the host) and, when due, the
        update-to-weight ratio of the step just applied."""
        ratio = self.metrics.update_ratio() if self.comm.rank == 0 else None
        if ratio is not None and self.metrics.low_streak(ratio):
            m = self.policy.metrics
            self._event(
                "update_ratio_low",
                ratio=ratio,
                threshold=m.update_ratio_warn,
                measurements=m.update_ratio_patience,
                hint="updates are tiny next to the weights (a bf16 stall?): check the LR "
                "and that the optimizer keeps fp32 master weights",
            )
        if self.comm.rank == 0 and self.metrics.due(self.global_step):
            lr = self.engine.lr()
            self.metrics.record(
                self.global_step,
                loss=loss,
                grad_norm=grad_norm,
                lr=None if lr is None else lr * mult,
                # A GradScaler's scale lives on the device: read it now and then, and at
                # overflows (where it changes), not at every step.
                loss_scale=self.engine.loss_scale()
                if outcome == OVERFLOW_SKIP or self.global_step % 50 == 0
                else None,
                update_ratio=ratio,
                outcome=outcome,
            )

    def _samples_seen(self) -> int:
        """Distinct samples reached so far, the running step's included (the quarantine
        budget's denominator): the position in the unfiltered order, all after an epoch."""
        assert self._sampler is not None
        n = self._sampler.num_samples
        reached = max(self._pos[1], self._next_offset)  # _next_offset: 0 until a batch runs
        return n if self._pos[0] >= 1 else max(1, min(n, reached))

    def _new_step(self) -> None:
        self._micro, self._step_positions, self._step_ids = 0, [], []

    @property
    def _probe_judges_grads(self) -> bool:
        """Isolation re-runs judge a sub-batch by its gradients too, where they are this
        rank's own and unscaled; elsewhere by its loss alone, and skip backward."""
        return self.engine.rerun_grads_are_local and not self.engine.has_loss_scaler

    def _snapshot(self, initial: bool = False) -> Snapshot | None:
        t0 = time.perf_counter()
        state = self.engine.state()
        state["guard"] = self._guard_state()
        snap = self.ring.capture(self.global_step, state)
        if snap is None:
            # Every slot is either the newest sealed one or still being persisted.
            self._event(
                "snapshot_skipped",
                reason="every ring slot holds the newest sealed snapshot or one still being "
                "written to durable storage; raise snapshot.keep (3 when persisting often)",
            )
            return None
        if initial:
            # The starting state is trusted as is: rolling back to it is a restart.
            snap.wait()
            snap.sealed = True
        self._event(
            "snapshot",
            tier="memory",
            bytes=snap.nbytes,
            stall_ms=round((time.perf_counter() - t0) * 1e3, 3),
            initial=initial,
        )
        return snap

    # ------------------------------------------------------------------ durable tier ---
    def _guard_state(self) -> dict[str, Any]:
        """Counters and data position saved with every snapshot. The position counts samples
        of the unfiltered order, so it holds at any world size and batch size."""
        return {
            "step": self.global_step,
            "epoch": self._pos[0],
            "offset": self._pos[1],
            "adjust": self.adjuster.state_dict(),
        }

    def _install_stop_handlers(self) -> None:
        """SIGTERM/SIGINT become a collective stop at the next step boundary (they ride the
        step's all-reduce). SIGTERM stays caught (torchrun and a supervisor may both send
        it); a second SIGINT gets Python's default: KeyboardInterrupt."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread

        def on_signal(signum: int, frame: object) -> None:
            self._stop_requested = True
            if signum == signal.SIGINT:
                signal.signal(signal.SIGINT, signal.default_int_handler)

        self._old_handlers = {
            sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
        }

    def _preempt(self) -> None:
        """Write a durable snapshot of the current state, journal, and stop. The intent is
        journaled first: a worker killed while writing was still preempted."""
        self._event("preempting")
        written = self.durable.persist_now(
            self._snapshot,
            self.rollbacks,
            timeout_s=min(self.policy.supervisor.grace_s, self.policy.persist.commit_timeout_s),
            beat=lambda: self.heartbeat.beat(self.global_step, phase="preempting", force=True),
        )
        self._event("preempted", persisted=written, url=self.durable.store.url)
        self.close(persist=False)
        raise Preempted(
            f"stopped on request at step {self.global_step}"
            + (" after a durable snapshot" if written else " (no durable snapshot written)")
        )

    def _persist_final(self) -> None:
        """Persist the state the loop ended with, so a finished run can be picked up (or
        resumed at another world size) from its last step."""
        if self.global_step > self.durable.mark and self.global_step > 0:
            self.durable.persist_now(
                self._snapshot,
                self.rollbacks,
                timeout_s=self.policy.persist.commit_timeout_s,
                beat=lambda: self.heartbeat.beat(self.global_step, phase="closing", force=True),
            )

    def _restore_resumed(self, tree: dict[str, Any], manifest: dict[str, Any], url: str) -> None:
        """Make a snapshot loaded from durable storage the ring's first, sealed, snapshot
        and the live state."""
        g = tree["guard"]
        snap = self.ring.capture(int(g["step"]), tree)
        assert snap is not None  # the ring is empty at start
        snap.wait()
        snap.sealed = True
        try:
            self.engine.restore(snap, 1.0)
        except (RuntimeError, KeyError, ValueError) as err:
            raise PersistError(
                f"snapshot {g['step']} under {url} does not fit this model or "
                f"optimizer ({err}). Resume with the model it was written by, or set "
                "persist.resume: false (or another persist.url) to start from scratch"
            ) from err
        self.global_step, self._pos = int(g["step"]), (int(g["epoch"]), int(g["offset"]))
        self.adjuster.load_state_dict(g["adjust"])
        self.durable.invalidate_after(self.global_step)
        self._event(
            "resume",
            snapshot_step=self.global_step,
            url=url,
            tier=self.durable.tier_of(url),
            saved_world_size=manifest["world_size"],
            world_size=self.comm.world_size,
            epoch=self._pos[0],
            offset=self._pos[1],
        )

    # ------------------------------------------------------------------ setup ----------
    def _event(self, kind: str, **details: Any) -> None:
        """Journal a collective decision once (rank 0 of the group)."""
        if self.comm.rank == 0:
            self.journal.write(kind, self.global_step, details)

    def _resolve_run_dir(self, run_dir: str | None) -> str:
        chosen = run_dir or os.environ.get(ENV_RUN_DIR)
        if not chosen:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            chosen = os.path.join("runs", f"{stamp}-{os.getpid()}")
        # Ranks may see different environments or clocks: rank 0 decides for the group.
        chosen = os.path.abspath(self.comm.broadcast_object(chosen))
        os.makedirs(chosen, exist_ok=True)
        return chosen

    def _check_memory(self) -> None:
        """Fail at start, on every rank alike, if the ring cannot fit on this host."""
        snap = self.policy.snapshot
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        per_rank = self.engine.estimate_state_bytes()
        need = per_rank * snap.keep * local_ranks
        gib = 2**30
        problem = None
        detail = (
            f"snapshot.keep={snap.keep} needs {need / gib:.2f} GiB of host memory on this node "
            f"({local_ranks} local rank(s) x {snap.keep} slots x {per_rank / gib:.3f} GiB)"
        )
        if snap.max_host_memory_gb is not None and need > snap.max_host_memory_gb * gib:
            problem = f"{detail}, over snapshot.max_host_memory_gb={snap.max_host_memory_gb}"
        else:
            avail = _available_host_bytes()
            if avail is not None and need > 0.8 * avail:
                problem = f"{detail}, but only {avail / gib:.2f} GiB is free (80% usable)"
        problems = [p for p in self.comm.all_gather_object(problem) if p]
        if problems:
            raise PolicyError(
                f"{problems[0]}: lower snapshot.keep, or free host memory, or raise "
                "snapshot.max_host_memory_gb"
            )


def _engine_for(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    scaler: Any,
    engine: Any,
) -> Engine:
    """Pick the adapter: DeepSpeed, FSDP1, FSDP2 (DTensor parameters), else plain/DDP."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from orchestrator.engines.deepspeed import DeepSpeedEngine, is_deepspeed_engine

    if engine is None and is_deepspeed_engine(model):
        engine, model = model, None
    if engine is not None:
        if not is_deepspeed_engine(engine):
            raise UsageError(
                f"Guard(engine=...) takes the engine deepspeed.initialize returned, not a "
                f"{type(engine).__name__}; pass torch objects as model=/optimizer="
            )
        if any(x is not None for x in (model, optimizer, scheduler, scaler)):
            raise UsageError(
                "with a DeepSpeed engine pass only engine=...: DeepSpeed owns the model, "
                "optimizer, scheduler and loss scaler (give them to deepspeed.initialize)"
            )
        return DeepSpeedEngine(engine)
    if model is None or optimizer is None:
        raise UsageError("Guard needs model= and optimizer= (or engine= for DeepSpeed)")

    if isinstance(model, FullyShardedDataParallel):
        return FSDP1Engine(model, optimizer, scheduler, scaler)
    if is_fsdp2(model):
        return FSDP2Engine(model, optimizer, scheduler, scaler)
    return TorchEngine(model, optimizer, scheduler, scaler)


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
