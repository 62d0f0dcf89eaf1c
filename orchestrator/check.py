"""The step's check: the engine's check tensors and the control slots packed into one tensor
(:func:`pack_local`), all-reduced once (the one host sync of a healthy step), and read the
same way on every rank: the global loss and grad norm, and why the step is bad, if it is.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from orchestrator.comm import Comm
from orchestrator.detect import (
    GRAD_NONFINITE,
    GRAD_NORM_SQ,
    LOSS,
    LOSS_NONFINITE,
    STOP,
    SpikeDetector,
    pack_local,
)
from orchestrator.durable import DurableTier
from orchestrator.engines import Engine
from orchestrator.heartbeat import Heartbeat
from orchestrator.journal import Decisions
from orchestrator.policy import Policy


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


class StepCheck:
    def __init__(
        self,
        policy: Policy,
        comm: Comm,
        engine: Engine,
        durable: DurableTier,
        heartbeat: Heartbeat,
        decide: Decisions,
    ) -> None:
        self.comm, self.engine, self.durable, self.heartbeat = comm, engine, durable, heartbeat
        self.decide = decide
        self.check_grads = policy.detect.check_grads
        self.spikes = SpikeDetector(policy.detect.spike)
        self._zero_seen = False

    def run(
        self, step: int, loss: torch.Tensor, grads: list[torch.Tensor], stop_requested: bool
    ) -> Checked:
        """Collective: every rank of the group calls it once per optimizer step."""
        t0 = time.perf_counter()
        control = (float(stop_requested), *self.durable.control())
        packed = pack_local(loss, grads, self.check_grads, control)
        self.heartbeat.enter("check")  # a rank that never gets here is the one others wait for
        vals = self.comm.all_reduce_sum_(packed).tolist()  # the one host sync of the step
        # On a GPU the host sync also waits for the step's queued kernels: an upper bound.
        seconds = time.perf_counter() - t0
        self.durable.observe(vals, step)
        world = self.comm.world_size
        gloss = vals[LOSS] / world
        gnorm = self.engine.global_grad_norm(vals[GRAD_NORM_SQ], world)
        reason, overflow = None, False
        if vals[LOSS_NONFINITE] > 0:
            reason = "nonfinite_loss"
        elif vals[GRAD_NONFINITE] > 0:
            overflow = self.engine.has_loss_scaler
            reason = None if overflow else "nonfinite_grads"
        else:
            spike = self.spikes.check({"loss": gloss, "grad_norm": gnorm})
            if spike is not None:
                reason = f"spike_{spike[0]}"
        if self.check_grads and gnorm == 0.0 and reason is None and not self._zero_seen:
            self._zero_seen = True  # said once per run: zero gradients are a loop bug
            self._zero_gradients(step)
        return Checked(gloss, gnorm, reason, overflow, vals[STOP] > 0, self.durable.busy, seconds)

    def _zero_gradients(self, step: int) -> None:
        hint = (
            f"the global gradient norm is exactly 0.0 at step {step}: the finite check sees "
            "nothing. Were the gradients zeroed (optimizer.zero_grad()) or the loss detached "
            "before guard.step? The Guard zeroes them after each step; the loop must not"
        )
        self.decide("zero_gradients", step, hint=hint)
        warnings.warn(hint, UserWarning, stacklevel=4)
