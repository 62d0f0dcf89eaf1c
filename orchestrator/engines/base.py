"""The contract between the Guard and a training engine.

The Guard owns the protocol (check, snapshot, incident pipeline); an engine knows how to run
backward and the optimizer step, which gradients are local, and what its state is. The base
class holds the shared logic; backends implement the ``_``-prefixed hooks.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

from orchestrator.snapshot import Snapshot


class Engine(ABC):
    #: The model as the user built it (unwrapped): forensics hooks and faults attach here.
    core: torch.nn.Module
    #: True when every rank holds the full, already-reduced gradient (single process, DDP):
    #: the packed grad-norm^2 SUM is then divided by the world size instead of summed shards.
    grads_replicated: bool = True
    #: True when gradients left by a re-run under ``local_grads()`` are this rank's own, so
    #: an isolation re-run may judge a sub-batch by them (not only by its loss).
    rerun_grads_are_local: bool = True
    #: Top-level snapshot keys that differ between ranks even when the rest is replicated.
    rank_local_keys: frozenset[str] = frozenset({"rng"})
    #: Optimizer steps take this many micro-batches (gradient accumulation); the Guard
    #: checks, commits and snapshots only at the boundaries.
    micro_steps_per_step: int = 1
    #: ``poison_grad`` must run before ``backward`` (gradients are reduced inside it).
    poison_before_backward: bool = False

    @property
    def state_replicated(self) -> bool:
        """Every rank holds the same model and optimizer state, so one rank's copy of it is
        the whole durable snapshot. Differs from ``grads_replicated`` only where the
        reported norm is global but the state is sharded (DeepSpeed ZeRO)."""
        return self.grads_replicated

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Run the backward pass of ``loss`` (scaled, where the engine scales)."""

    @abstractmethod
    def poison_grad(self) -> None:
        """Fault injection: write a NaN into one local gradient (before any unscaling)."""

    def prepare_check(self, lr_multiplier: float) -> None:
        """Called once per optimizer step, before ``grads``. Engines that can only judge a
        step after applying it apply it here (``lr_multiplier`` as in ``commit``); the Guard
        restores a snapshot on every incident, so a bad step applied here is never kept."""
        del lr_multiplier  # the default judges first and applies in commit

    def accumulate(self) -> None:
        """A micro-batch that is not the last of its step has had its backward."""
        raise NotImplementedError(
            f"{type(self).__name__} does not accumulate gradients over micro-batches"
        )

    @abstractmethod
    def grads(self) -> list[torch.Tensor]:
        """This rank's gradients, ready for the finite check (unscaled)."""

    #: The Guard may clip this engine's gradients (policy ``clip``). DeepSpeed clips inside
    #: its own step, by its ``gradient_clipping``.
    guard_clips: bool = True

    def clip_grads(self, coef: float) -> None:
        """Multiply this rank's gradients by ``coef`` (< 1): clipping by a global norm the
        caller already has. Called between ``grads`` and ``commit``."""
        torch._foreach_mul_(self.grads(), coef)

    @abstractmethod
    def commit(self, lr_multiplier: float) -> None:
        """Optimizer step (LR times ``lr_multiplier`` for this step only), scheduler step,
        zero grads."""

    @abstractmethod
    def abandon(self) -> None:
        """Drop the gradients of a step that will not be applied."""

    @abstractmethod
    def state(self) -> dict[str, Any]:
        """References (not copies) to everything a snapshot must hold for this engine."""

    @abstractmethod
    def restore(self, snap: Snapshot, loss_scale_factor: float) -> None:
        """Load a snapshot taken from ``state()``; multiply any loss scale by the factor."""

    @abstractmethod
    def estimate_state_bytes(self) -> int:
        """Bytes one snapshot will take on this rank, including optimizer state that a lazy
        optimizer has not created yet."""

    #: A durable snapshot of this engine's sharded state can be loaded at another world size.
    can_reshard: bool = False

    def native_files(self, step: int) -> dict[str, str]:
        """Top-level snapshot keys this rank writes with ``torch.save`` in the engine's own
        checkpoint layout (key -> path inside the snapshot directory) instead of DCP, so the
        engine's own loader reads durable snapshots too."""
        return {}

    def native_texts(self, step: int) -> dict[str, str]:
        """Small text files rank 0 adds to a durable snapshot for the native layout."""
        return {}

    def reshard(self, parts: list[dict[str, Any]], own: int) -> dict[str, Any]:
        """This rank's state from every saved rank's part (``parts[own]``: the part whose
        per-rank values, such as RNG, this rank takes)."""
        raise NotImplementedError(f"{type(self).__name__} cannot reshard a snapshot")

    @property
    def has_loss_scaler(self) -> bool:
        """With a dynamic loss scaler, gradient overflow is the scaler's business (it skips
        the step and lowers the scale); only a non-finite loss is an incident."""
        return False

    def lr(self) -> float | None:
        """The LR of the first parameter group as the scheduler set it (metrics)."""
        return None

    def loss_scale(self) -> float | None:
        """The current loss scale, or None without a loss scaler (journaled on rollback)."""
        return None

    @contextlib.contextmanager
    def local_grads(self) -> Iterator[None]:
        """Within this context backward leaves gradients unreduced (forensics reruns)."""
        yield
