"""FSDP2 (``fully_shard``): each rank snapshots and restores only its own shards.

Parameters, gradients and optimizer state are DTensors sharded across the ranks. A snapshot
holds their local shards (``to_local()``), so per-rank bytes are about the full state
divided by the world size, with no all-gather. Restore copies the shards back in place,
into the very storage the parameters and optimizer state live in.

The gradient norm of the finite check is the sum of the local shards' norm^2, which the
step's all-reduce turns into the global norm (``_grads_replicated = False``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from orchestrator.engines.inplace import Copier, copy_optimizer
from orchestrator.engines.torch_native import TorchEngine
from orchestrator.errors import UsageError
from orchestrator.policy import Policy
from orchestrator.rng import rng_state
from orchestrator.snapshot import Snapshot
from orchestrator.stateful import USER_KEY


def _shard_meta(name: str, t: DTensor) -> dict[str, Any]:
    """Where this rank's shard sits in the global tensor (dim-0 sharding on a 1-D mesh)."""
    if len(t.placements) != 1 or not isinstance(t.placements[0], Shard) or t.placements[0].dim:
        raise UsageError(
            f"parameter {name} is sharded as {t.placements}: the Guard snapshots FSDP2 models "
            "sharded on dim 0 over a 1-D mesh (fully_shard's default); HSDP / 2-D meshes are "
            "not supported yet"
        )
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return {"shape": list(t.shape), "offset": int(offset[0])}


def is_fsdp2(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _local(t: Any) -> Any:
    return t.to_local() if isinstance(t, DTensor) else t


def _locals(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _locals(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_locals(v) for v in tree]
    return _local(tree)


class FSDP2Engine(TorchEngine):
    _grads_replicated = False
    # Re-runs keep gradient sync on: with it off, FSDP2 accumulates unsharded gradients
    # inside its own buffers, which would leak into the first step after the rollback.
    # Synced gradients mix the ranks, so re-runs are judged by the local loss alone.
    _rerun_grads_local = False
    can_reshard = True
    #: The old names of the meshes' groups of their own (rebind_unsupported's, for rebind).
    _own_groups: list[str]
    #: Every part of the state is this rank's own: each rank persists all of it.
    rank_local_keys = frozenset(
        {"model", "optim", "sched", "scaler", "rng", "guard", "layout", "data", USER_KEY}
    )

    def rebind_unsupported(self) -> str | None:
        try:
            from orchestrator.engines.rebind_fsdp import fsdp2_unsupported, own_groups
        except ImportError as err:  # another torch release's FSDP2 internals
            return f"FSDP2 is not rebound in place under torch {torch.__version__}: {err}"
        why = fsdp2_unsupported(self.model, self.optimizer)
        # Asked right before the old group is destroyed: which meshes had a group of their
        # own is known only now (rebind_fsdp's docstring).
        self._own_groups = own_groups(self.model, self.optimizer) if why is None else []
        return why

    def rebind(self) -> None:
        from orchestrator.engines.rebind_fsdp import rebind_fsdp2

        rebind_fsdp2(self.model, self.optimizer, self._own_groups)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._own_groups = []
        # The shard layout is fixed by the model's sharding: computed (and checked) once at
        # start, saved with every snapshot as plain values so a durable snapshot can be
        # resharded to another world size. Optimizer state shards like its parameter.
        names = {id(p): n for n, p in self.core.named_parameters()}
        self._layout: dict[str, Any] = {
            "params": {
                n: _shard_meta(n, t)
                for n, t in self.core.state_dict().items()
                if isinstance(t, DTensor)
            },
            "optim_params": [names.get(id(p)) for p in self._params()],
        }

    def grads(self) -> list[torch.Tensor]:
        self._unscale()
        return [_local(p.grad) for p in self._params() if p.grad is not None]

    def can_rerun_fp32(self, autocast: bool = False) -> bool:
        return False  # the sharded state's dtype is FSDP's business

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # Gradients accumulate unsharded in FSDP2's buffers; the last micro-batch's
        # backward reduce-scatters the sum.
        self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def state(self) -> dict[str, Any]:
        return {
            "model": _locals(self.core.state_dict()),
            "optim": _locals(self.optimizer.state_dict()),
            "sched": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "rng": rng_state(),
            "layout": self._layout,
        }

    def reshard(self, parts: list[dict[str, Any]], own: int) -> dict[str, Any]:
        """This rank's state from the parts of a snapshot taken at another world size:
        each sharded tensor is reassembled from every part's shard and cut to this rank's
        shard of the live model. Only dim-0 sharding on a 1-D mesh (FSDP2's default)."""
        tree = parts[own]
        layouts = [p["layout"]["params"] for p in parts]

        def rebuild(name: str, shards: list[torch.Tensor], live: DTensor) -> torch.Tensor:
            metas = [lay[name] for lay in layouts]
            full = torch.empty(metas[0]["shape"], dtype=shards[0].dtype)
            for shard, meta in zip(shards, metas, strict=True):
                full[meta["offset"] : meta["offset"] + shard.shape[0]] = shard
            shape, offset = compute_local_shape_and_global_offset(
                full.shape, live.device_mesh, live.placements
            )
            return full[offset[0] : offset[0] + shape[0]].clone()

        for name, live in self.core.state_dict().items():
            if isinstance(live, DTensor):
                tree["model"][name] = rebuild(name, [p["model"][name] for p in parts], live)
        params = self._params()
        owners = self._layout["optim_params"]
        for index, entries in tree["optim"]["state"].items():
            p, name = params[int(index)], owners[int(index)]
            for key, value in entries.items():
                if isinstance(p, DTensor) and name is not None and value.dim() > 0:
                    shards = [part["optim"]["state"][index][key] for part in parts]
                    entries[key] = rebuild(name, shards, p)
        return tree

    def _restore_model(self, snap: Snapshot, copier: Copier) -> None:
        saved = snap.host("model")
        for name, live in self.core.state_dict().items():
            copier.copy(live, saved[name], f"model state {name!r}")  # into the local shard

    def _restore_optim(self, snap: Snapshot, copier: Copier) -> None:
        """Copy the saved local shards into the optimizer's DTensor state (its local
        shards, wherever they live: with ``CPUOffloadPolicy`` on the host), never gathering;
        where that state does not exist yet (a resume), create it shard by shard."""
        params, opt = self._params(), self.optimizer
        live = {i: opt.state[p] for i, p in enumerate(params) if p in opt.state}
        fresh = copy_optimizer(live, snap.host("optim"), opt.param_groups, copier)
        if fresh is None:
            copier.finish()
            self._create_optimizer_state(snap.host("optim", clone=True))
            return
        for i in fresh:
            del opt.state[params[i]]

    def _create_optimizer_state(self, saved: dict[str, Any]) -> None:
        """Put the saved local shards in as the optimizer's state, shard by shard. Each
        shard becomes a DTensor laid out like the state it replaces, or like its parameter:
        its global shape and stride given by that one (inferred from the local shard they
        would be the local one times the world size, which is wrong wherever dim 0 does not
        divide evenly: a vocabulary of 1001 rows, a head of one row, whose shard on the last
        rank is empty), its local shard where that one's is (host memory under
        ``CPUOffloadPolicy``)."""
        params = self._params()
        for group, saved_group in zip(
            self.optimizer.param_groups, saved["param_groups"], strict=True
        ):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        live_state = {p: dict(s) for p, s in self.optimizer.state.items()}
        self.optimizer.state.clear()
        for index, entries in saved["state"].items():
            p = params[int(index)]
            live = live_state.get(p, {})
            state: dict[str, Any] = {}
            for key, value in entries.items():
                if isinstance(p, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
                    name = self._layout["optim_params"][int(index)] or f"#{index}"
                    value = _as_dtensor(value, live.get(key), p, f"{key!r} of {name}")
                state[key] = value
            self.optimizer.state[p] = state

    def estimate_state_bytes(self) -> int:
        local = [_local(t) for t in self.core.state_dict().values()]
        model = sum(t.numel() * t.element_size() for t in local if isinstance(t, torch.Tensor))
        if not self.optimizer.state:
            return model + 2 * sum(
                _local(p).numel() * _local(p).element_size() for p in self._params()
            )
        optim = sum(
            _local(v).numel() * _local(v).element_size()
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        return model + optim


def _as_dtensor(local: torch.Tensor, live: Any, param: DTensor, what: str) -> DTensor:
    """``local`` as this rank's shard of a DTensor laid out like ``live`` (the state entry it
    replaces) or, where there is none yet (a resume), like ``param``."""
    spec = live if isinstance(live, DTensor) else param
    if local.shape != spec.to_local().shape:
        raise UsageError(
            f"rank {dist.get_rank()}: optimizer state {what} (global shape "
            f"{tuple(param.shape)}): the saved shard has "
            f"shape {tuple(local.shape)}, this rank's shard is {tuple(spec.to_local().shape)}. "
            "The Guard restores optimizer state that shards like its parameter (Adam, SGD & "
            "co.); an optimizer with differently shaped state needs its own adapter"
        )
    # Not DTensor.from_local: it moves the shard to the mesh's device type (an offloaded
    # state would land on the GPU). A DTensor like ``spec`` keeps its local shard's device.
    with torch.no_grad():
        out = torch.empty_like(spec, dtype=local.dtype)
        assert isinstance(out, DTensor)
        out.to_local().copy_(local)
    return out


class FSDP1Engine(TorchEngine):
    """FSDP1 (``FullyShardedDataParallel``): the local shards are the FlatParameters the
    module and the optimizer hold, so the snapshot takes ``named_parameters()`` (never
    ``state_dict()``, which all-gathers) and the plain optimizer state (local too)."""

    _grads_replicated = False
    _rerun_grads_local = False  # as for FSDP2: no_sync would leak unsharded grads
    rank_local_keys = FSDP2Engine.rank_local_keys

    def rebind_unsupported(self) -> str | None:
        # Each FSDP unit keeps its own process group, handle and execution-order state; not
        # rebound: a full restart (fully_shard, FSDP2, recovers in place).
        return "FSDP1 (FullyShardedDataParallel) is not rebound in place; FSDP2 (fully_shard) is"

    def can_rerun_fp32(self, autocast: bool = False) -> bool:
        return False

    def check_policy(self, policy: Policy) -> None:
        # A plain GradScaler's found_inf is this rank's shard's alone (ShardedGradScaler
        # all-reduces it; FSDP2's DTensor gradients reduce it too): the step is gated by
        # the check's global flag instead (TorchEngine._scaler_step), which needs the
        # gradients in the check.
        if (
            self.scaler is not None
            and not isinstance(self.scaler, ShardedGradScaler)
            and not policy.detect.check_grads
        ):
            raise UsageError(
                "FSDP1 with a plain torch.amp.GradScaler and detect.check_grads: false: each "
                "rank would skip overflowed steps by its own shard's gradients, and the ranks "
                "diverge. Set detect.check_grads: true (the Guard then skips by the global "
                "verdict), or use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"
            )

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self.model.no_sync()  # type: ignore[operator]

    def _model_state(self) -> dict[str, Any]:
        # The local FlatParameters: FSDP1's state_dict() would all-gather every snapshot.
        named: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        named.update(self.model.named_buffers())
        return {k: v.detach() for k, v in named.items()}

    def _restore_model(self, snap: Snapshot, copier: Copier) -> None:
        saved = snap.host("model")
        for name, live in self._model_state().items():
            copier.copy(live, saved[name], f"local shard {name!r}")
        self._drop_gathered()

    def _drop_gathered(self) -> None:
        """Undo what forwards without a backward left behind (the isolation re-runs, judged
        by their loss alone), as FSDP1's end-of-backward callback would have:

        - every gathered (unsharded) parameter is freed, so the next forward gathers the
          restored shards: FSDP1 keeps the root's gathered parameters after a forward, for
          the backward it expects, and the next forward would reuse them, the weights of
          before the rollback;
        - the post-backward hook each such forward registered is removed: left there, the
          next forward does not register its own, its gradient lands unsharded and in the
          low precision (no reduce-scatter), and the optimizer step fails on it;
        - the per-iteration flags are reset."""
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp._common_utils import TrainingState
        from torch.distributed.fsdp._flat_param import HandleTrainingState
        from torch.distributed.fsdp._runtime_utils import _reshard  # no public equivalent

        for module in FullyShardedDataParallel.fsdp_modules(self.model):
            handle = module._handle
            # Before FSDP's lazy init (a resume) nothing was ever gathered.
            if handle is None or not hasattr(handle.flat_param, "_local_shard"):
                continue
            if not handle.needs_unshard():  # its gathered copy is still allocated
                _reshard(module, handle, free_unsharded_flat_param=True)
            flat_param = handle.flat_param
            if hasattr(flat_param, "_post_backward_hook_state"):
                flat_param._post_backward_hook_state[-1].remove()
                delattr(flat_param, "_post_backward_hook_state")
            handle._ran_pre_backward_hook = False  # type: ignore[attr-defined]
            handle._needs_pre_backward_unshard = False
            handle._post_forward_index = None
            handle._training_state = HandleTrainingState.IDLE
            handle._prefetched = False
            module.training_state = TrainingState.IDLE
            if module._is_root:
                module._post_backward_callback_queued = False  # type: ignore[assignment]
                module._exec_order_data.next_iter()

    def estimate_state_bytes(self) -> int:
        model = sum(t.numel() * t.element_size() for t in self._model_state().values())
        optim = sum(
            v.numel() * v.element_size()
            for s in self.optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        return model + (optim if self.optimizer.state else 2 * model)
