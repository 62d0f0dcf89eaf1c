"""DDP after an in-place recovery (issue 33; :mod:`orchestrator.rejoin`): the survivors' DDP
wrapper is pointed at the re-formed world group and runs what the replacement's ``DDP(model)``
runs in its constructor, so both sides issue the same collectives in the same order
(``benchmarks/proto_inplace_ddp.py`` found that order)."""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def ddp_unsupported(model: object) -> str | None:
    """Why a survivor's DDP wrapper cannot be rebuilt on the new group (None: it can)."""
    if isinstance(model, DistributedDataParallel) and (
        model.static_graph or model.mixed_precision is not None or model._comm_hooks
    ):
        return "DDP with static_graph, mixed_precision or a comm hook is not rebuilt"
    return None


def mirror_ddp(model: object) -> None:
    """What the replacement's ``DDP(model)`` runs in its constructor, on the new world group,
    and a reducer with the initial bucket layout (the replacement's has that one)."""
    from torch.distributed.utils import (
        _sync_module_states,
        _verify_param_shape_across_processes,
    )

    if not isinstance(model, DistributedDataParallel):
        return
    group = dist.group.WORLD
    assert group is not None
    model.process_group = group
    params, sparse = model._build_params_for_reducer()
    _verify_param_shape_across_processes(group, params)
    ignore, buffers = model.parameters_to_ignore, model.forward_sync_buffers
    _sync_module_states(model.module, group, model.broadcast_bucket_size, 0, ignore, buffers)
    names = model._build_debug_param_to_name_mapping(params)
    model._ddp_init_helper(params, sparse, names, False)
    model._has_rebuilt_buckets = False
