"""DeepSpeed engines (``deepspeed.initialize``): ZeRO stages 1, 2 and 3, bf16 or fp16.

DeepSpeed computes the global gradient norm and its overflow flag inside ``engine.step()``,
so nothing public tells before the step whether its gradients are finite. The engine is
therefore ``APPLY_THEN_JUDGE`` (see :mod:`orchestrator.engines.base`): ``judge`` runs
``engine.step()`` and hands the norm DeepSpeed reported (already global and identical on
every rank) to the step's all-reduce; ``commit`` has nothing left to do.
A step judged bad is undone exactly, because every incident restores a snapshot taken
before it: fp32 master partitions, optimizer state, loss scaler, scheduler, counters, RNG.
With fp16, an overflow is DeepSpeed's business as usual (it skips the step and lowers the
scale); the Guard calls that ``overflow_skip``.

A snapshot holds what DeepSpeed's own checkpoint holds, taken with the functions its
``save_checkpoint`` uses: the ZeRO optimizer's ``state_dict()`` (this rank's partition),
and, on the rank that writes it, the model-states dict (bit16 module, parameter shapes,
scheduler, counters). Durable snapshots are written in DeepSpeed's layout, so
``engine.load_checkpoint`` and ``zero_to_fp32`` read them. bit16 weights are derived from
the fp32 partitions on restore, as DeepSpeed's own step does, so they are not held twice.

Everything below that DeepSpeed does not document as public is listed in ``_INTERNAL_*``, checked
once at start: a DeepSpeed upgrade that renames one fails there, loudly, not mid-run.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.engines.base import Engine, StepOrder
from orchestrator.engines.inplace import Copier, copy_optimizer
from orchestrator.engines.registry import EngineArgs
from orchestrator.errors import UsageError
from orchestrator.policy import Policy
from orchestrator.rng import rng_state, set_rng_state
from orchestrator.snapshot import Snapshot
from orchestrator.stateful import USER_KEY

#: DeepSpeed methods and attributes this adapter relies on that are not documented API, by
#: owner. ``check_internals`` verifies them at every start, and tests/test_deepspeed.py
#: checks the methods on DeepSpeed's classes, so an upgrade that renames one fails CI with
#: its name instead of failing a run mid-incident.
_INTERNAL_METHODS: dict[str, tuple[str, ...]] = {
    "engine": (
        "_common_checkpoint_state",  # the model-states dict save_checkpoint writes
        "module_state_dict",
        "_get_ckpt_name",  # file names of the native layout
        "_get_zero_ckpt_name",
    ),
    "zero12": ("update_lp_params",),  # fp32 partitions -> bit16 params (+ all-gather)
    "zero3": ("checkpoint_event_prologue", "checkpoint_event_epilogue"),
}
_INTERNAL_ATTRS: dict[str, tuple[str, ...]] = {
    "engine": ("save_non_zero_checkpoint", "global_samples", "skipped_steps", "micro_steps"),
    "zero12": ("optimizer", "loss_scaler", "dp_process_group"),  # .optimizer: the torch one
    # fp16_groups / fp32_partitioned_groups_flat: where the partitions' padding is (start)
    "zero3": (
        "optimizer",
        "loss_scaler",
        "dp_process_group",
        "fp16_groups",
        "fp32_partitioned_groups_flat",
    ),
}


def is_deepspeed_engine(obj: object) -> bool:
    """True for the engine ``deepspeed.initialize`` returns (without importing DeepSpeed)."""
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed import DeepSpeedEngine as _DS

    return isinstance(obj, _DS)


def _zero_classes() -> tuple[type, type]:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3


def check_internals(ds: Any) -> None:
    """Fail at start, naming the attribute and the DeepSpeed version, if this DeepSpeed
    lacks something the adapter needs."""
    import deepspeed

    zero12, zero3 = _zero_classes()
    opt = ds.optimizer
    if not isinstance(opt, (zero12, zero3)):
        raise UsageError(
            f"DeepSpeed engine with optimizer wrapper {type(opt).__name__}: the Guard supports "
            "ZeRO stages 1, 2 and 3 (zero_optimization.stage >= 1). For stage 0 wrap the model "
            "in DDP and pass Guard(model=..., optimizer=...); bf16 with fp32 gradient "
            "accumulation at stage 1 (BF16_Optimizer) is not supported yet: use stage 2"
        )
    owners = {"engine": ds, "zero12" if isinstance(opt, zero12) else "zero3": opt}
    for table in (_INTERNAL_METHODS, _INTERNAL_ATTRS):
        for owner, obj in owners.items():
            for name in table[owner]:
                if not hasattr(obj, name):
                    raise UsageError(
                        f"DeepSpeed {deepspeed.__version__}: {type(obj).__name__} has no "
                        f"{name!r}, which orchestrator/engines/deepspeed.py needs. This "
                        "DeepSpeed changed an internal the adapter relies on: install the "
                        "range pyproject.toml names (the deepspeed extra), or update the "
                        "adapter and its tables"
                    )


class DeepSpeedEngine(Engine):
    order = StepOrder.APPLY_THEN_JUDGE
    _grads_replicated = True  # the norm DeepSpeed reports is already the global one
    _rerun_grads_local = False  # gradients are reduced inside backward
    _reduces_in_backward = True
    rank_local_keys = frozenset(
        {"ds_engine", "ds_optim", "ds_model", "rng", "guard", "data", USER_KEY}
    )

    @classmethod
    def from_args(cls, args: EngineArgs) -> Engine:
        from orchestrator.engines import build_deepspeed  # checks what else the Guard got

        return build_deepspeed(args, cls)

    def __init__(self, ds: Any) -> None:
        check_internals(ds)
        if getattr(ds.optimizer, "compute_grad_norm", True) is False:
            raise UsageError(
                "zero_optimization.compute_grad_norm is false: DeepSpeed then reports no "
                "gradient norm and the Guard cannot see non-finite gradients; remove it"
            )
        import deepspeed

        self.ds = ds
        self.core = ds.module
        self.version = deepspeed.__version__
        _, zero3 = _zero_classes()
        self.stage3 = isinstance(ds.optimizer, zero3)
        self.micro_steps_per_step = int(ds.gradient_accumulation_steps())
        self.inner: torch.optim.Optimizer = ds.optimizer.optimizer
        group = ds.optimizer.dp_process_group
        self.dp_rank, self.dp_size = dist.get_rank(group), dist.get_world_size(group)
        self._mult = 1.0
        self._saved_lr: list[tuple[dict[str, Any], float]] = []
        # The LR multiplier reaches the torch optimizer inside DeepSpeed's step, after its
        # param_groups are final and before DeepSpeed steps the scheduler (which may set
        # the LR from its own count or multiply the current one).
        self.inner.register_step_pre_hook(self._scale_lr)
        self.inner.register_step_post_hook(self._unscale_lr)
        self._norm = torch.zeros((), device=ds.device)  # the last step's global norm
        self._applied = True
        if self.stage3 and self.dp_rank == self.dp_size - 1:
            self._zero_stage3_padding()

    def _zero_stage3_padding(self) -> None:
        """ZeRO-3 allocates each parameter's partition with ``torch.empty``; on the last rank
        the tail past the parameter's end (its padding, where the size does not divide by
        the world size) is uninitialized memory, copied into the fp32 master partition. No
        one reads it, but it is in every checkpoint of the partition: two identical runs'
        checkpoints differ there, and stray NaN bits would fail the durable tier's
        finite-values check on resume. Zeroed once here; the optimizer never moves it (its
        gradient is zero)."""
        opt = self.ds.optimizer
        with torch.no_grad():
            for params, flat in zip(opt.fp16_groups, opt.fp32_partitioned_groups_flat, strict=True):
                offset = 0
                for p in params:
                    n, pad = int(p.partition_numel()), int(p.padding_size())
                    if pad:
                        flat[offset + n - pad : offset + n].zero_()
                        p.ds_tensor[n - pad :].zero_()
                    offset += n

    def check_policy(self, policy: Policy) -> None:
        if policy.clip.max_norm is not None:
            raise UsageError(
                f"clip.max_norm={policy.clip.max_norm}: DeepSpeed clips gradients inside "
                "its own step; set gradient_clipping in the DeepSpeed config instead and "
                "remove clip.max_norm from the policy"
            )

    @property
    def state_replicated(self) -> bool:
        return False  # ZeRO partitions optimizer state (and at stage 3 the weights)

    @property
    def has_loss_scaler(self) -> bool:
        return bool(self.ds.fp16_enabled())

    def digest_tensors(self) -> tuple[list[torch.Tensor], bool]:
        # ZeRO-1/2: every rank holds the bit16 weights alike (each step all-gathers them from
        # the fp32 partitions). ZeRO-3: this rank's partitions only.
        params = list(self.ds.module.parameters())
        if self.stage3:
            return [p.ds_tensor for p in params], False
        return params, True

    def rebind_unsupported(self) -> str | None:
        from orchestrator.engines.rebind_deepspeed import deepspeed_unsupported

        return deepspeed_unsupported(self.ds, self.stage3)

    def rebind(self) -> None:
        # ZeRO-1/2 (issue 33): orchestrator/engines/rebind_deepspeed.py says what and why.
        from orchestrator.engines.rebind_deepspeed import mirror_deepspeed

        mirror_deepspeed(self.ds)

    def lr(self) -> float | None:
        return float(self.ds.get_lr()[0])

    def loss_scale(self) -> float | None:
        return float(self.ds.optimizer.loss_scaler.cur_scale) if self.has_loss_scaler else None

    # --- the step ---------------------------------------------------------------------------
    def _scale_lr(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        if self._mult != 1.0:
            self._saved_lr = [(g, g["lr"]) for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * self._mult

    def _unscale_lr(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        for g, lr in self._saved_lr:
            g["lr"] = lr
        self._saved_lr = []

    def _backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed scales by 1/gas and defers its reduction to the boundary itself.
        self.ds.backward(loss)

    def accumulate(self) -> None:
        self.ds.step()  # not a boundary: DeepSpeed only counts the micro-step

    def _apply(self, lr_multiplier: float, overflow: bool | None = None) -> None:
        if not self.ds.is_gradient_accumulation_boundary():
            raise UsageError(
                "the DeepSpeed engine is not at a gradient-accumulation boundary where the "
                "Guard expects one: do not call engine.step() yourself, guard.step() does"
            )
        self._mult = lr_multiplier
        try:
            self.ds.step()
        finally:
            self._mult = 1.0
        norm = self.ds.get_global_grad_norm()
        self._applied = bool(self.ds.was_step_applied())
        # Kept where DeepSpeed left it: a tensor on the device (the step's all-reduce reads
        # it with the check's one host sync), or a number it already had on the host (inf
        # on overflow), made a device tensor by a fill (no sync, no pageable H2D copy).
        if isinstance(norm, torch.Tensor):
            self._norm = norm.detach().float().reshape(())
        else:
            self._norm = torch.full((), 0.0 if norm is None else float(norm), device=self.ds.device)

    def grads(self) -> list[torch.Tensor]:
        # Skipped for overflow, non-finite, or DeepSpeed's negative "invalid norm" marker.
        if not self._applied:
            return [torch.full((), math.inf, device=self._norm.device)]
        n = self._norm
        return [torch.where(torch.isfinite(n) & (n >= 0), n, torch.full_like(n, math.inf))]

    def abandon(self) -> None:
        # DeepSpeed's step consumed the gradients, and isolation re-runs skip backward.
        pass

    # --- state ------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        ds = self.ds
        state: dict[str, Any] = {
            "ds_engine": {
                "global_steps": ds.global_steps,
                "global_samples": ds.global_samples,
                "skipped_steps": ds.skipped_steps,
                "micro_steps": ds.micro_steps,
                "lr_scheduler": ds.lr_scheduler.state_dict() if ds.lr_scheduler else None,
            },
            # What DeepSpeed's _save_zero_checkpoint writes for this rank, as it writes it.
            "ds_optim": {
                "optimizer_state_dict": ds.optimizer.state_dict(),
                "ds_config": ds.config,
                "ds_version": self.version,
            },
            "rng": rng_state(),
            # Every rank's module buffers (BatchNorm statistics a forward writes): DeepSpeed
            # keeps them in the model file only, which a rollback does not load.
            "ds_buffers": dict(ds.module.named_buffers()),
        }
        if ds.save_non_zero_checkpoint:
            state["ds_model"] = ds._common_checkpoint_state(
                self._module_state(), True, bool(ds.zero_optimization_partition_gradients())
            )
        return state

    def _module_state(self) -> dict[str, Any]:
        """The module as DeepSpeed's save_checkpoint writes it. At ZeRO-3 that runs after
        partitioning every parameter, so parameters are empty placeholders (the weights are
        in the optimizer files); small "persistent" ones may be gathered right now, so they
        are replaced here instead of partitioning and regathering at every snapshot."""
        module = self.ds.module_state_dict()
        if self.stage3:
            for name, p in self.ds.module.named_parameters():
                if name in module and hasattr(p, "ds_id"):
                    module[name] = torch.empty(0, dtype=p.dtype, device=p.device)
        return dict(module)

    def restore(self, snap: Snapshot, loss_scale_factor: float) -> None:
        ds, opt = self.ds, self.ds.optimizer
        counters = snap.materialize("ds_engine", clone=True)
        # DeepSpeed's optimizer load copies the fp32 partitions out of what it is given, in
        # place, so it gets the ring's host buffers themselves (no device copy of them);
        # the torch optimizer's state is copied in place here (orchestrator/engines/
        # inplace.py: no allocation, and DeepSpeed's links to those tensors stay valid).
        # Only where the live state lacks entries the snapshot has (before the first step)
        # does the torch optimizer take the snapshot's tensors, and then host copies of them.
        saved = snap.host("ds_optim")["optimizer_state_dict"]
        base_key = "optimizer_state_dict" if self.stage3 else "base_optimizer_state"
        live_base = opt.state_dict()[base_key]
        copier = Copier()
        fresh = None
        if _rigid(live_base) and _rigid(saved[base_key]):
            live = {int(i): entry for i, entry in live_base["state"].items()}
            fresh = copy_optimizer(live, saved[base_key], self.inner.param_groups, copier)
        in_place = fresh is not None
        for i in fresh or []:
            live_base["state"][i].clear()  # no state at the snapshot: fresh again
        if not in_place:
            saved = snap.host("ds_optim", clone=True)["optimizer_state_dict"]
        parts: list[Any] = [None] * self.dp_size
        parts[self.dp_rank] = saved
        # The calls engine.load_checkpoint makes, minus the file reads; the bit16 weights
        # are rebuilt from the fp32 partitions (collective, like DeepSpeed's own step).
        if self.stage3:
            opt.checkpoint_event_prologue()
        opt.load_state_dict(parts, load_optimizer_states=not in_place, load_from_fp32_weights=True)
        if "ds_buffers" in snap.skeleton:  # snapshots written before it was kept lack it
            live_buffers = dict(ds.module.named_buffers())
            for name, buf in snap.host("ds_buffers").items():
                copier.copy(live_buffers[name], buf, f"module buffer {name!r}")
        copier.finish()
        if self.stage3:
            opt.checkpoint_event_epilogue()
        else:
            opt.update_lp_params()
        if self.has_loss_scaler and loss_scale_factor != 1.0:
            opt.loss_scaler.cur_scale = opt.loss_scaler.cur_scale * loss_scale_factor
        for name in ("global_steps", "global_samples", "skipped_steps", "micro_steps"):
            setattr(ds, name, counters[name])
        if ds.lr_scheduler is not None and counters["lr_scheduler"] is not None:
            ds.lr_scheduler.load_state_dict(counters["lr_scheduler"])
        set_rng_state(snap.materialize("rng", clone=True))

    def estimate_state_bytes(self) -> int:
        optim = _tree_bytes(self.ds.optimizer.state_dict())
        if not self.inner.state:
            optim *= 3  # so far the fp32 partitions; Adam & co. add two more like them lazily
        model = _tree_bytes(self._module_state()) if self.ds.save_non_zero_checkpoint else 0
        return optim + model

    # --- native layout ----------------------------------------------------------------------
    @staticmethod
    def tag(step: int) -> str:
        return f"global_step{step}"

    def native_files(self, step: int) -> dict[str, str]:
        tag = self.tag(step)
        files = {"ds_optim": self.ds._get_zero_ckpt_name("", tag)}
        if self.ds.save_non_zero_checkpoint:
            files["ds_model"] = self.ds._get_ckpt_name("", tag)
        return files

    def native_texts(self, step: int) -> dict[str, str]:
        return {"latest": self.tag(step)}  # what load_checkpoint and zero_to_fp32 look for


def _rigid(state: Any) -> bool:
    """A torch optimizer state dict (not DeepSpeed's elastic checkpoint layout)."""
    return isinstance(state, dict) and "state" in state and "param_groups" in state


def _tree_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tree_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tree_bytes(v) for v in obj)
    return 0
