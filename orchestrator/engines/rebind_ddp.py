"""DDP after an in-place recovery (issue 33; :mod:`orchestrator.rejoin`): the survivors' DDP
wrapper is pointed at the re-formed world group and runs what the replacement's ``DDP(model)``
runs in its constructor, so both sides issue the same collectives in the same order
(``benchmarks/proto_inplace_ddp.py`` found that order)."""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def _init_sync_buffers(model: DistributedDataParallel) -> bool | None:
    """Whether the constructor broadcast the buffers (None: it cannot be told). torch 2.13
    keeps ``forward_sync_buffers``, and syncs buffers at init unless the deprecated
    ``broadcast_buffers=False`` was passed, which leaves the same attribute False; older
    releases keep ``broadcast_buffers``, which decided both (torch 2.11 on an H200: the
    attribute 2.13 has is missing there)."""
    forward = getattr(model, "forward_sync_buffers", None)
    if forward is None:
        return bool(model.broadcast_buffers)
    return True if forward else None


def _synced_buffers(model: DistributedDataParallel) -> bool:
    """Whether the module has buffers the constructor's broadcast would carry."""
    ignore = model.parameters_to_ignore
    return any(name not in ignore for name, _ in model.module.named_buffers())


def ddp_unsupported(model: object) -> str | None:
    """Why a survivor's DDP wrapper cannot be rebuilt on the new group (None: it can).
    Not seen here: ``DDP(init_sync=False)`` (not kept by the wrapper): the replacement then
    runs no constructor collectives and the survivors' wait for them ends in the agent's
    ``in_place_timeout_s`` and a full restart."""
    if not isinstance(model, DistributedDataParallel):
        return None
    if model.static_graph or model.mixed_precision is not None or model._comm_hooks:
        return "DDP with static_graph, mixed_precision or a comm hook is not rebuilt"
    if _init_sync_buffers(model) is None and _synced_buffers(model):
        return (
            "DDP with buffers and forward_sync_buffers=False (or broadcast_buffers=False): "
            "whether its constructor broadcast the buffers cannot be told, so the "
            "replacement's constructor cannot be mirrored"
        )
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
    # Unknown only without buffers to send (ddp_unsupported): then either value sends the same.
    buffers = bool(_init_sync_buffers(model))
    ignore = model.parameters_to_ignore
    _sync_module_states(model.module, group, model.broadcast_bucket_size, 0, ignore, buffers)
    names = model._build_debug_param_to_name_mapping(params)
    model._ddp_init_helper(params, sparse, names, False)
    model._has_rebuilt_buckets = False
