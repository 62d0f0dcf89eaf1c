"""Run a training script whose FSDP2 default meshes each form a group of their own over the
world, as ``fully_shard`` does on a CUDA host under gloo (torch's ``init_device_mesh`` then
calls ``new_group`` per mesh), here on the CPU: the in-place rebind must form the survivor's
groups as the replacement's constructors do. Wraps ``fully_shard``'s default mesh only.

    orchestrator launch --nproc-per-node 2 tests/mesh_own_group.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import runpy
import sys

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard import _fully_shard


def _own_group_mesh(mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
    # A backend named for the dimension: torch forms the group with new_group, as for CUDA
    # under gloo, instead of taking the default group.
    return init_device_mesh(
        "cpu", (dist.get_world_size(),), mesh_dim_names=mesh_dim_names,
        backend_override={0: "gloo"},
    )  # fmt: skip


if __name__ == "__main__":
    _fully_shard._init_default_mesh = _own_group_mesh  # type: ignore[attr-defined]
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
