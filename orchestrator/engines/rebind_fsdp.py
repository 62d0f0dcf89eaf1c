"""FSDP2 (``fully_shard``) after an in-place recovery (issue 33; :mod:`orchestrator.rejoin`).

What FSDP2 holds of the world group, in torch 2.13 (``torch/distributed/fsdp/_fully_shard``,
``device_mesh.py``):

- the :class:`DeviceMesh` names its groups (``_dim_group_names``, resolved through c10d's
  registry on each use) and keeps the objects in ``_pg_registry`` (read under
  ``torch.compile``); every DTensor spec (parameters, gradients, optimizer state) holds that
  same mesh object, so the mesh is re-pointed in place and no DTensor needs rebuilding;
- each ``FSDPMeshInfo`` (of a parameter group, and of each of its parameters) caches
  ``shard_process_group``, which every all-gather and reduce-scatter is issued on.

The replacement's ``fully_shard`` runs no collective in its constructor for what is rebound
here: its default mesh (``init_device_mesh(device, (world,))``) takes the default group
itself when the mesh spans the world and the group's backend serves the device, and FSDP2
broadcasts nothing (every rank is assumed to start from the same weights). So the
survivors have no collective to mirror; the Guard's agreement is the first one both sides
run. Anything else (2-D meshes, a mesh over part of the world or over a group of its own,
a separate reduce-scatter group, a custom all-gather or reduce-scatter, a failure in the
middle of a forward or backward) is refused, and the agent falls back to a full restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule
from torch.distributed.tensor import DTensor


def _groups(model: torch.nn.Module) -> Iterator[FSDPParamGroup]:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield from module._get_fsdp_state()._fsdp_param_groups


def _mesh_infos(model: torch.nn.Module) -> Iterator[Any]:
    """Every mesh info FSDP2 issues collectives on (a group's, each parameter's)."""
    for group in _groups(model):
        yield group.mesh_info
        yield group.post_forward_mesh_info
        for fsdp_param in group.fsdp_params:
            yield fsdp_param.mesh_info
            yield fsdp_param.post_forward_mesh_info


def _meshes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[DeviceMesh]:
    """Every distinct mesh a DTensor or a mesh info of this model holds."""
    found: dict[int, DeviceMesh] = {}
    tensors: list[Any] = [*model.parameters()]
    tensors += [v for s in optimizer.state.values() for v in s.values()]
    for t in tensors:
        if isinstance(t, DTensor):
            found.setdefault(id(t.device_mesh), t.device_mesh)
    for info in _mesh_infos(model):
        if info is not None:
            found.setdefault(id(info.mesh), info.mesh)
    return list(found.values())


def fsdp2_unsupported(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    """Why a survivor's FSDP2 model cannot be rebound to the re-formed world group (None: it
    can). Called before the old group is destroyed."""
    assert dist.group.WORLD is not None
    name = dist.group.WORLD.group_name
    for mesh in _meshes(model, optimizer):
        if mesh.ndim != 1:
            return f"FSDP2 on a {mesh.ndim}-D mesh (HSDP, TP): only a 1-D mesh is rebound"
        if mesh.size() != dist.get_world_size() or mesh.get_group().group_name != name:
            return (
                "FSDP2 on a mesh whose group is not the world group itself (a subgroup, or "
                "a group of its own as with gloo on a CUDA host): only the world is rebuilt"
            )
    for info in _mesh_infos(model):
        if info is None:
            continue
        if type(info) is not FSDPMeshInfo or info.is_spmd_mesh:  # HSDP, DDP-like, SPMD
            return f"FSDP2 with {type(info).__name__} (not plain sharding): not rebound"
        if info.reduce_scatter_process_group is not None:
            return "FSDP2 with a separate reduce-scatter group: not rebound"
    for group in _groups(model):
        if type(group._all_gather_comm) is not DefaultAllGather or (
            type(group._reduce_scatter_comm) is not DefaultReduceScatter
        ):
            return "FSDP2 with a custom all-gather or reduce-scatter (holds the group): not rebound"
        if group._training_state is not TrainingState.IDLE or not group.is_sharded:
            # The collective broke inside a forward or backward (or the parameters stay
            # gathered after it): FSDP2's per-iteration state (unsharded parameters, queued
            # callbacks, buffers in flight) is not undone here.
            return (
                "FSDP2 was mid forward/backward or holds gathered parameters when the "
                "collective broke: not rebuilt in place"
            )
    return None


def rebind_fsdp2(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Point every mesh and mesh info of ``model`` at the re-formed ``dist.group.WORLD``
    (same ranks: coordinates, shard ranks and sizes are unchanged)."""
    world = dist.group.WORLD
    assert world is not None
    for mesh in _meshes(model, optimizer):
        mesh._dim_group_names = [world.group_name]
        registry = mesh._get_root_mesh()._pg_registry
        registry.clear()
        registry[world.group_name] = world
    for info in _mesh_infos(model):
        if info is not None:
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
    for group in _groups(model):
        # Nothing of the broken step is in flight (checked above); drop what the last
        # iteration kept for overlap, as a fresh FSDPParamGroup starts without it.
        group.comm_ctx.all_gather_state = None
        group._all_gather_result = None
