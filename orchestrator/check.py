"""The step's check: the engine's check tensors and the control slots packed into one tensor
(:func:`pack_local`), all-reduced once (the one host sync of a healthy step), and read the
same way on every rank: the global loss and grad norm, and why the step is bad, if it is.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from orchestrator import replicas
from orchestrator.context import Context
from orchestrator.detect import (
    GRAD_NONFINITE,
    GRAD_NORM_SQ,
    LOSS,
    LOSS_NONFINITE,
    STOP,
    SpikeBar,
    SpikeDetector,
    pack_local,
)
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine
from orchestrator.heartbeat import Heartbeat
from orchestrator.policy import DetectPolicy


@dataclass
class Checked:
    """The step as every rank sees it after the all-reduce."""

    loss: float  # global mean
    grad_norm: float  # global
    reason: str | None  # nonfinite_loss | nonfinite_grads | spike_<metric>; None: healthy
    overflow: bool  # non-finite gradients that the loss scaler skips (not an incident)
    stop: bool  # some rank was asked to stop (SIGTERM/SIGINT)
    writing: bool = False  # some rank's durable writer was busy (the goodput ledger's)
    seconds: float = 0.0  # this rank's time in the check: pack, all-reduce, host sync
    # The replicas' comparison of this step's snapshot digest (None: none this step), and
    # the largest digest (every rank's, when they agreed).
    agreed: bool | None = None
    digest: int | None = None
    overflow_since: int | None = None  # persistent_overflow: the first skipped step
    spike: SpikeBar | None = None  # a spike: where its metric stood (isolation judges by it)
    extra: list[float] | None = None  # this rank's ``extra`` values, read with the check's
    # The loss scale where the check read it (an overflow under ``min_loss_scale``): the
    # step's metrics row reuses it rather than sync a second time.
    loss_scale: float | None = None


class StepCheck:
    def __init__(
        self,
        ctx: Context,
        detect: DetectPolicy,
        engine: Engine,
        durable: DurableTier,
        heartbeat: Heartbeat,
    ) -> None:
        self.comm, self.engine, self.durable, self.heartbeat = ctx.comm, engine, durable, heartbeat
        self.decide = ctx.decide
        self.check_grads = detect.check_grads
        self.spikes = SpikeDetector(detect.spike)
        self.overflow = detect.overflow
        self._skips = 0  # overflow skips in a row
        self._zero_seen = False

    def run(
        self,
        step: int,
        loss: torch.Tensor,
        grads: list[torch.Tensor],
        stop_requested: bool,
        digest: torch.Tensor | None = None,
        extra: torch.Tensor | None = None,
    ) -> Checked:
        """Collective: every rank of the group calls it once per optimizer step, with the
        ``digest`` of this step's snapshot where the replicas compare one (every rank, or
        none). ``extra``: this rank's own device values to read with the step's host sync
        (not reduced; any rank, e.g. rank 0's update-ratio norms), in ``Checked.extra``."""
        t0 = time.perf_counter()
        control = (float(stop_requested), *self.durable.control())
        packed = pack_local(loss, grads, self.check_grads, control)
        self.heartbeat.enter("check")  # a rank that never gets here is the one others wait for
        # The digests' MAX all-reduce is queued first: the step's host sync below covers it.
        compared = replicas.compare_async(self.comm, digest) if digest is not None else None
        reduced = self.comm.all_reduce_sum_(packed)
        if extra is not None:
            reduced = torch.cat([reduced, extra.to(reduced.device, reduced.dtype).reshape(-1)])
        vals = reduced.tolist()  # the one host sync of the step
        mine = vals[len(packed) :] if extra is not None else None
        agreed, top = replicas.agreed(*compared) if compared is not None else (None, None)
        # On a GPU the host sync also waits for the step's queued kernels: an upper bound.
        seconds = time.perf_counter() - t0
        self.durable.observe(vals, step)
        world = self.comm.world_size
        gloss = vals[LOSS] / world
        gnorm = self.engine.global_grad_norm(vals[GRAD_NORM_SQ], world)
        reason, overflow, since, spike, scale = None, False, None, None, None
        if agreed is False:
            reason = "divergence"  # first: its rollback must reach an agreed snapshot
        elif vals[LOSS_NONFINITE] > 0:
            reason = "nonfinite_loss"
        elif vals[GRAD_NONFINITE] > 0:
            overflow = self.engine.has_loss_scaler
            reason = None if overflow else "nonfinite_grads"
            if overflow:
                persistent, scale = self._persistent()
                if persistent:
                    reason, overflow, since = "persistent_overflow", False, step - self._skips + 1
        else:
            spike = self.spikes.check({"loss": gloss, "grad_norm": gnorm}, step)
            if spike is not None:
                reason = f"spike_{spike.metric}"
        self._skips = self._skips + 1 if overflow else 0
        if self.check_grads and gnorm == 0.0 and reason is None and not self._zero_seen:
            self._zero_seen = True  # said once per run: zero gradients are a loop bug
            self._zero_gradients(step)
        return Checked(
            gloss, gnorm, reason, overflow, vals[STOP] > 0, self.durable.busy, seconds,
            agreed=agreed, digest=top, overflow_since=since, spike=spike, extra=mine,
            loss_scale=scale,
        )  # fmt: skip

    def rewind(self, step: int) -> None:
        """Rolled back to ``step``: the spike history and the overflow streak with it."""
        self.spikes.rewind(step)
        self._skips = 0

    def _persistent(self) -> tuple[bool, float | None]:
        """This overflow is one skip too many: ``detect.overflow.max_skips`` in a row, or
        the loss scale under its floor. A scaler that skips every step hides a broken model
        (non-finite gradients whatever the scale): the run must not end 0 having trained
        on nothing. Read on overflow steps only (the scale's read is a host sync); returns
        the scale where it was read."""
        o = self.overflow
        if o.max_skips is not None and self._skips + 1 >= o.max_skips:
            return True, None
        scale = self.engine.loss_scale() if o.min_loss_scale is not None else None
        low = scale is not None and o.min_loss_scale is not None and scale < o.min_loss_scale
        return low, scale

    def _zero_gradients(self, step: int) -> None:
        hint = (
            f"the global gradient norm is exactly 0.0 at step {step}: the finite check sees "
            "nothing. Were the gradients zeroed (optimizer.zero_grad()) or the loss detached "
            "before guard.step? The Guard zeroes them after each step; the loop must not"
        )
        self.decide("zero_gradients", step, hint=hint)
        warnings.warn(hint, UserWarning, stacklevel=4)
