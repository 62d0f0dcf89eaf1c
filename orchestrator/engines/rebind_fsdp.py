"""FSDP2 (``fully_shard``) after an in-place recovery (issue 33; :mod:`orchestrator.rejoin`).

What FSDP2 holds of the world group, in torch 2.13 (``torch/distributed/fsdp/_fully_shard``,
``device_mesh.py``):

- the :class:`DeviceMesh` names its groups (``_dim_group_names``, resolved through c10d's
  registry on each use) and keeps the objects in ``_pg_registry`` (read under
  ``torch.compile``); every DTensor spec (parameters, gradients, optimizer state) holds that
  same mesh object, so the mesh is re-pointed in place and no DTensor needs rebuilding;
- each ``FSDPMeshInfo`` (of a parameter group, and of each of its parameters) caches
  ``shard_process_group``, which every all-gather and reduce-scatter is issued on.

The replacement's ``fully_shard`` runs one collective in its constructor at most: its
default mesh (``init_device_mesh(device, (world,))``) takes the default group itself where
that group's backend serves the device (CPU under gloo, CUDA under NCCL), and otherwise
(CUDA under gloo) forms a group of its own over the world with ``new_group``, once per
``fully_shard`` call given no mesh; FSDP2 broadcasts nothing (every rank is assumed to
start from the same weights). So the survivor forms, in the order the old ones were formed
(their names count up), one group over the world for each mesh that had one of its own,
with the default backend, as the replacement's constructors do before its Guard starts.
Anything else (2-D meshes, a mesh over part of the world or with another backend, a
separate reduce-scatter group, a custom all-gather or reduce-scatter, a failure in the
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
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch before 2.13: one parameter group per state, or none
                one = state._fsdp_param_group
                groups = [one] if one is not None else []
            yield from groups


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
    try:
        return _unsupported(model, optimizer)
    except AttributeError as err:  # another torch release keeps these elsewhere
        return f"FSDP2's internals in torch {torch.__version__} are not the ones rebound: {err}"


def _unsupported(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
    assert dist.group.WORLD is not None
    name = dist.group.WORLD.group_name
    for mesh in _meshes(model, optimizer):
        if mesh.ndim != 1:
            return f"FSDP2 on a {mesh.ndim}-D mesh (HSDP, TP): only a 1-D mesh is rebound"
        if not hasattr(mesh, "_dim_group_names") or not hasattr(
            mesh._get_root_mesh(), "_pg_registry"
        ):  # what rebind_fsdp2 rewrites
            return f"torch {torch.__version__}'s DeviceMesh keeps its groups elsewhere"
        pg = mesh.get_group()
        if mesh.size() != dist.get_world_size() or pg.size() != dist.get_world_size():
            return "FSDP2 on a mesh over part of the world: only the world is rebuilt"
        if pg.group_name != name and (
            not pg.group_name.isdigit() or dist.get_backend(pg) != dist.get_backend()
        ):
            return (
                "FSDP2 on a mesh whose group of its own has another backend than the world "
                "or a hashed name (its place among the groups formed is unknown): not rebound"
            )
    for info in _mesh_infos(model):
        if info is None:
            continue
        spmd = getattr(info, "is_spmd_mesh", False)  # torch 2.13's dp_mesh_dims
        if type(info) is not FSDPMeshInfo or spmd:  # HSDP, DDP-like, SPMD
            return f"FSDP2 with {type(info).__name__} (not plain sharding): not rebound"
        if getattr(info, "reduce_scatter_process_group", None) is not None:
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


def own_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the groups over the world, other than the world group, that ``model``'s
    meshes hold, in the order they were formed. Called before the old group is destroyed,
    where :func:`fsdp2_unsupported` said the model can be rebound."""
    assert dist.group.WORLD is not None
    world = dist.group.WORLD.group_name
    names = {m.get_group().group_name for m in _meshes(model, optimizer)} - {world}
    return sorted(names, key=int)


def rebind_fsdp2(model: torch.nn.Module, optimizer: torch.optim.Optimizer, own: list[str]) -> None:
    """Point every mesh and mesh info of ``model`` at the re-formed ``dist.group.WORLD``, or
    for a mesh over a group of its own (``own``: the old names, from :func:`own_groups`) at
    a new group over the world, formed as the replacement's mesh forms it (same ranks:
    coordinates, shard ranks and sizes are unchanged)."""
    world = dist.group.WORLD
    assert world is not None
    renamed: dict[str, dist.ProcessGroup] = {}
    for old in own:  # in the order they were formed: the replacement's order too
        group = dist.new_group(ranks=list(range(dist.get_world_size())), group_desc="mesh_default")
        assert group is not None
        renamed[old] = group
    meshes = _meshes(model, optimizer)
    for mesh in meshes:  # the old groups are destroyed: none of them is looked up again
        mesh._get_root_mesh()._pg_registry.clear()
    for mesh in meshes:
        group = renamed.get(mesh._dim_group_names[0], world)
        mesh._dim_group_names = [group.group_name]
        mesh._get_root_mesh()._pg_registry[group.group_name] = group
    for info in _mesh_infos(model):
        if info is not None:
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
    for param_group in _groups(model):
        # Nothing of the broken step is in flight (checked above); drop what the last
        # iteration kept for overlap, as a fresh FSDPParamGroup starts without it.
        param_group.comm_ctx.all_gather_state = None
        param_group._all_gather_result = None
