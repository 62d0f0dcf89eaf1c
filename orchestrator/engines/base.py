"""The contract between the Guard and a training engine.

The Guard owns the protocol (check, snapshot, incident pipeline); an engine knows how to run
backward and the optimizer step, which gradients are local, and what its state is.

An optimizer step is run in one of two orders (:class:`StepOrder`), named by the engine:

* ``JUDGE_THEN_APPLY`` (PyTorch, DDP, FSDP): the gradients are judged by the step's finite
  check, then the optimizer applies them (``judge`` returns them, ``commit`` applies).
* ``APPLY_THEN_JUDGE`` (DeepSpeed): the engine's own step computes the global norm and its
  overflow flag, so the step is applied first (in ``judge``) and judged right after;
  ``commit`` has nothing left to do. A step judged bad is undone exactly, because every
  incident restores a snapshot taken before it.

The public methods below run that shared sequence (the template pattern); engines implement
the ``_``-prefixed hooks and state their facts in the ``_``-prefixed class attributes. The
Guard never branches on an engine's type.
"""

from __future__ import annotations

import contextlib
import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from orchestrator.errors import UsageError
from orchestrator.snapshot import Snapshot
from orchestrator.stateful import USER_KEY

if TYPE_CHECKING:
    from orchestrator.engines.registry import EngineArgs
    from orchestrator.policy import Policy


class StepOrder(enum.Enum):
    JUDGE_THEN_APPLY = "judge_then_apply"
    APPLY_THEN_JUDGE = "apply_then_judge"


class Engine(ABC):
    #: The model as the user built it (unwrapped): forensics hooks attach here.
    core: torch.nn.Module
    #: When the optimizer step is applied relative to the finite check (module docstring).
    order: ClassVar[StepOrder] = StepOrder.JUDGE_THEN_APPLY
    #: Top-level snapshot keys that differ between ranks even when the rest is replicated
    #: (the user's own objects, ``USER_KEY``, may differ too: each rank persists its own).
    rank_local_keys: ClassVar[frozenset[str]] = frozenset({"rng", "data", USER_KEY})
    #: Optimizer steps take this many micro-batches (gradient accumulation); the Guard
    #: checks, commits and snapshots only at the boundaries.
    micro_steps_per_step: int = 1
    #: A durable snapshot of this engine's sharded state can be loaded at another world size.
    can_reshard: ClassVar[bool] = False

    # Facts the template methods below read; engines set them, callers never do.
    #: Every rank holds the full, already-reduced gradient (or the global norm): the packed
    #: grad-norm^2 SUM is divided by the world size instead of summing shards.
    _grads_replicated: ClassVar[bool] = True
    #: Gradients left by a re-run under ``local_grads()`` are this rank's own.
    _rerun_grads_local: ClassVar[bool] = True
    #: Gradients are reduced inside backward: what must reach a local gradient does so
    #: through a parameter hook, before backward (after it there is none left).
    _reduces_in_backward: ClassVar[bool] = False

    @classmethod
    def from_args(cls, args: EngineArgs) -> Engine:
        """Build this engine from what the user gave the Guard (the registry calls it,
        :mod:`orchestrator.engines.registry`)."""
        raise UsageError(
            f"{cls.__name__} does not say how to build it from the Guard's arguments: define "
            "its from_args classmethod, or register a factory taking EngineArgs"
        )

    @property
    def loss_divisor(self) -> int:
        """What the sum of a step's micro-batch losses (as given to backward) is divided by
        to make the step's mean loss: the micro-batches per step, unless the loop divided
        each loss already (a framework's, :class:`FrameworkEngine` ``loss_divided``)."""
        return self.micro_steps_per_step

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def state_replicated(self) -> bool:
        """Every rank holds the same model and optimizer state, so one rank's copy of it is
        the whole durable snapshot."""
        return self._grads_replicated

    def check_policy(self, policy: Policy) -> None:
        """Refuse, with a :class:`UsageError`, a policy this engine cannot carry out."""
        del policy

    # --- the step (template methods) -------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass of ``loss`` (scaled where the engine scales, and by 1 /
        ``micro_steps_per_step``)."""
        self._backward(loss)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Around the forward and backward of a micro-batch that is not the last of its
        step: gradients accumulate locally, with no communication."""
        return contextlib.nullcontext()

    def accumulate(self) -> None:  # noqa: B027 (a hook with a default: do nothing)
        """A micro-batch that is not the last of its step has had its backward (its
        gradients add up where the engine keeps them)."""

    def judge(self, lr_multiplier: float) -> list[torch.Tensor]:
        """Once per optimizer step: the tensors for the step's finite check (this rank's
        unscaled gradients, or the norm the engine reported). An apply-then-judge engine
        applies the step first (LR times ``lr_multiplier`` for this step only)."""
        if self.order is StepOrder.APPLY_THEN_JUDGE:
            self._apply(lr_multiplier)
        return self.grads()

    def commit(
        self, lr_multiplier: float, clip_coef: float | None = None, overflow: bool | None = None
    ) -> None:
        """Keep the judged step: scale the gradients by ``clip_coef`` (clipping by a global
        norm the caller has), then optimizer step (LR times ``lr_multiplier`` for this step
        only), scheduler step, zero grads. Nothing left to do for apply-then-judge.

        ``overflow``: the step's all-reduced verdict on its gradients (True: some rank's are
        non-finite, a loss scaler skips the step), or None where the check did not judge
        them (``detect.check_grads: false``): a loss scaler then decides by its own check."""
        if self.order is StepOrder.APPLY_THEN_JUDGE:
            return
        if clip_coef is not None:
            torch._foreach_mul_(self.grads(), clip_coef)
        self._apply(lr_multiplier, overflow)

    def global_grad_norm(self, reduced_sq: float, world_size: int) -> float:
        """The global gradient norm from the all-reduced SUM of every rank's local norm^2."""
        return math.sqrt(reduced_sq / (world_size if self._grads_replicated else 1))

    @property
    def rerun_judges_grads(self) -> bool:
        """Isolation re-runs judge a sub-batch by its gradients too, where they are this
        rank's own and unscaled; elsewhere by its loss alone, and skip backward."""
        return self._rerun_grads_local and not self.has_loss_scaler

    def can_rerun_fp32(self, autocast: bool = False) -> bool:
        """An fp32 re-run of a step means something here (forensics): the model holds
        low-precision parameters, or the step ran under ``autocast`` (the loop body's own)."""
        del autocast
        return False

    def part_keys(self, keys: list[str], holds_shared: bool) -> list[str]:
        """The top-level snapshot keys this rank writes to durable storage, when
        ``holds_shared`` says whether it writes the state every rank shares."""
        if holds_shared or not self.state_replicated:
            return list(keys)
        return sorted(self.rank_local_keys & set(keys))

    # --- hooks ----------------------------------------------------------------------------
    @abstractmethod
    def _backward(self, loss: torch.Tensor) -> None: ...

    @abstractmethod
    def _apply(self, lr_multiplier: float, overflow: bool | None = None) -> None:
        """Optimizer step with the LR times ``lr_multiplier``, scheduler step, zero grads;
        ``overflow`` as :meth:`commit` has it (None in an apply-then-judge ``judge``)."""

    @abstractmethod
    def grads(self) -> list[torch.Tensor]:
        """This rank's gradients, ready for the finite check (unscaled)."""

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

    def digest_tensors(self) -> tuple[list[torch.Tensor], bool]:
        """The state that training changes only in the optimizer step (parameters, frozen
        ones too, and optimizer state), in an order every rank and every restore agree on;
        and whether every rank of the group holds it alike, so that replicas can compare
        digests of it (:mod:`orchestrator.replicas`). Buffers are left out: a forward may
        change them (BatchNorm's running statistics)."""
        return [], False

    def state_device(self) -> torch.device | None:
        """The GPU this rank's model lives on, from its tensors (None: on the host, or
        offloaded there): never torch.cuda.current_device(), which a script that does not
        call torch.cuda.set_device leaves at cuda:0 on every rank."""
        for t in (*self.core.parameters(), *self.core.buffers()):
            if t.is_cuda:
                return t.device
        return None

    def forward_writes(self) -> list[torch.Tensor]:
        """Snapshot tensors a forward writes in place (BatchNorm's running statistics, the
        buffers DDP broadcasts): a snapshot taken before the forward copies them first."""
        return list(self.core.buffers())

    def rebind_unsupported(self) -> str | None:
        """Why this engine cannot follow an in-place recovery's re-formed world group
        (:mod:`orchestrator.rejoin`); None: :meth:`rebind` can. The default: it cannot, and
        the agent falls back to a full restart."""
        return f"the {self.name} engine cannot rebind its process groups"

    def rebind(self) -> None:  # noqa: B027 (a hook with a default: nothing holds the group)
        """The world group was destroyed and formed again (same ranks, same backend): point
        whatever holds the old group at ``dist.group.WORLD`` and re-run the collectives the
        replacement's constructors run, in the same order. Called on survivors only."""

    def release(self) -> None:  # noqa: B027 (a hook with a default: nothing to release)
        """The run is closed: remove what the engine attached to the user's objects."""

    def native_files(self, step: int) -> dict[str, str]:
        """Top-level snapshot keys this rank writes in the engine's own checkpoint layout
        (key -> path inside the snapshot directory, see :mod:`orchestrator.engines.native`)
        instead of DCP, so the engine's own loader reads durable snapshots too."""
        return {}

    def native_texts(self, step: int) -> dict[str, str]:
        """Small text files rank 0 adds to a durable snapshot for the native layout."""
        return {}

    def reshard(self, parts: list[dict[str, Any]], own: int) -> dict[str, Any]:
        """This rank's state from every saved rank's part (``parts[own]``: the part whose
        per-rank values, such as RNG, this rank takes)."""
        raise NotImplementedError(f"{self.name} cannot reshard a snapshot")

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
