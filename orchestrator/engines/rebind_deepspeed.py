"""DeepSpeed ZeRO-1/2 after an in-place recovery (issue 33; :mod:`orchestrator.rejoin`).

What a DeepSpeed 0.19 engine holds of the world group, found by walking a ZeRO-1/2 engine
on CPU/gloo: one clone of it (``deepspeed.utils.groups._WORLD_GROUP``, made by
``dist.new_group`` in ``groups._clone_world_group``), which the engine keeps as
``data_parallel_group`` and ``seq_data_parallel_group`` and its ZeRO optimizer as
``dp_process_group`` and ``real_dp_process_group[i]``, and every bit16 parameter as
``_dp_group`` (``safe_get_full_fp32_param`` and the like reduce over it). deepspeed.comm's
backend object (``deepspeed.comm.comm.cdb``, a ``TorchBackend``) holds no group: it calls
torch.distributed with ``group=None``, the new default group once re-formed.

The replacement's ``deepspeed.initialize`` runs two kinds of collective, in this order: that
``new_group`` and one ``broadcast`` per parameter from the group's rank 0
(``DeepSpeedEngine._broadcast_model``). :func:`mirror_deepspeed` runs the same on the
survivor, so both sides meet; the survivor receives into scratch copies (its own state is
rolled back to its ring slot right after, by the Guard). ``torch.distributed`` numbers
groups from zero again after the world is destroyed, so the survivor's ``new_group`` and
the replacement's get the same name, and the Guard's own groups built after it
(``guard.health``) follow in the same order on both sides.

The broken step left ZeRO's per-step bookkeeping half done (a gradient bucket part filled,
parameters marked reduced): :func:`reset_zero_step` puts it back as the optimizer's
constructor left it, so the next backward starts as the replacement's first one does.

The CPU accelerator's shared-memory all-reduce (``deepspeed_shm_comm``,
ops/csrc/cpu/comm/shm_interface.cpp ``initialize``) is set up once per process
(``is_initialized``) and only where ``LOCAL_SIZE`` equals the world size; it names its
/dev/shm buffers after ``MASTER_ADDR``/``MASTER_PORT`` (ops/csrc/cpu/comm/shm.cpp
``shm_initialize``) and then waits for every peer's buffer. A replacement gets its
generation's ``MASTER_PORT``, so its buffers' names differ from the survivor's and its
``shm_initialize`` would wait forever for theirs: that case is refused. Otherwise the op is
never initialised with buffers (and training never calls it: only
``inference_all_reduce`` does), so nothing of it needs rebinding.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

#: DeepSpeed internals the rebind uses beyond orchestrator/engines/deepspeed.py's tables: on
#: the ZeRO-1/2 optimizer (checked before a recovery, so an upgrade that renames one falls
#: back with its name) and in deepspeed.utils.groups (tests/test_inplace_zero2.py).
ZERO12_REBIND_ATTRS = (
    "ipg_buckets",
    "extra_large_param_to_reduce",
    "params_already_reduced",
    "averaged_gradients",
    "all_grad_tensors",
    "micro_step_id",
    "real_dp_process_group",
    "bit16_groups",
    "_clear_previous_reduced_grads",
    "_release_ipg_buffers",
    "reset_partition_gradient_structures",
)
GROUPS_REBIND_ATTRS = ("_WORLD_GROUP", "_clone_world_group", "_get_broadcast_src_rank")


def deepspeed_unsupported(ds: Any, stage3: bool) -> str | None:
    """Why a survivor's DeepSpeed engine cannot follow the re-formed world (None: it can)."""
    import deepspeed
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.utils import groups

    opt = ds.optimizer
    missing = [n for n in ZERO12_REBIND_ATTRS if not stage3 and not hasattr(opt, n)]
    missing += [f"groups.{n}" for n in GROUPS_REBIND_ATTRS if not hasattr(groups, n)]
    if missing:
        return (
            f"DeepSpeed {deepspeed.__version__} lacks {missing}, which "
            "orchestrator/engines/rebind_deepspeed.py needs: update it"
        )
    if stage3:
        return (
            "DeepSpeed ZeRO-3: its parameter partitions, prefetch coordinator and hooks hold "
            "gather state that is not rebuilt in place"
        )
    if isinstance(ds, PipelineEngine):
        return "a DeepSpeed pipeline engine: its stage groups are not rebuilt in place"
    if ds.has_moe_layers:
        return "DeepSpeed MoE: its expert groups are not rebuilt in place"
    if groups.mpu is not None or getattr(ds, "sequence_parallel_size", 1) > 1:
        return "DeepSpeed with model or sequence parallel groups: only the world is rebuilt"
    if getattr(opt, "cpu_offload", False):
        return "DeepSpeed ZeRO offload: its host-side gradient buffers are not reset in place"
    world = groups._WORLD_GROUP
    held = [ds.data_parallel_group, ds.seq_data_parallel_group, opt.dp_process_group]
    if world is None or any(g is not world for g in held + list(opt.real_dp_process_group)):
        return "the DeepSpeed engine runs on another group than its clone of the world"
    extra = [name for name in ("_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP",
                               "_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP",
                               "_EXPERT_PARALLEL_GROUP", "_ALL_TO_ALL_GROUP")
             if getattr(groups, name, None)]  # fmt: skip
    if extra:
        return f"DeepSpeed holds other groups ({', '.join(extra)}): only the world is rebuilt"
    if _shm_allreduce_on():
        return (
            "DeepSpeed's shared-memory all-reduce is on (LOCAL_SIZE equals the world size): "
            "its /dev/shm buffers are named after MASTER_PORT, which a replacement gets anew"
        )
    return None


def _shm_allreduce_on() -> bool:
    """deepspeed_shm_comm mapped its buffers (shm_interface.cpp ``initialize``)."""
    import deepspeed.comm.comm as ds_comm

    op = getattr(ds_comm.cdb, "shm_comm_op", None)
    size = os.environ.get("LOCAL_SIZE", "")
    return op is not None and size.isdigit() and int(size) == dist.get_world_size()


def mirror_deepspeed(ds: Any) -> None:
    """Point the engine at a clone of the new world group and run what the replacement's
    ``deepspeed.initialize`` runs collectively, in its order (module doc)."""
    from deepspeed.utils import groups

    groups._WORLD_GROUP = None  # destroyed with the world: cloned again, as at init
    new = groups._clone_world_group()
    opt = ds.optimizer
    ds.data_parallel_group = ds.seq_data_parallel_group = new
    opt.dp_process_group = new
    opt.real_dp_process_group = [new for _ in opt.real_dp_process_group]
    for group in opt.bit16_groups:
        for p in group:
            # link_hp_params (utils/mixed_precision_linkage.py): what safe_get_full_*
            # all-reduces over.
            if hasattr(p, "_dp_group"):
                p._dp_group = new
    src = groups._get_broadcast_src_rank()
    for p in ds.module.parameters():
        # _broadcast_model's broadcasts, into scratch: the survivor's own weights stay.
        scratch = p.data.detach().clone()
        dist.broadcast(scratch.view(torch.uint8), src, group=new)
    reset_zero_step(opt)


def reset_zero_step(opt: Any) -> None:
    """ZeRO-1/2's per-step gradient bookkeeping as its constructor leaves it (module doc)."""
    for bucket in opt.ipg_buckets.values():
        bucket.clear()
        bucket.index = 0
    opt.extra_large_param_to_reduce.clear()
    opt._clear_previous_reduced_grads()
    opt._release_ipg_buffers()  # the contiguous buffers: allocated again by the next backward
    for i in range(len(opt.params_already_reduced)):
        opt.params_already_reduced[i] = False
    opt.averaged_gradients = {}
    opt.all_grad_tensors = {}
    getattr(opt, "_muon_pending_momentum", {}).clear()
    opt.reset_partition_gradient_structures()
    opt.zero_grad(set_to_none=True)
    # Counted up by each backward's setup_buckets and reset by step(): the broken step's
    # backward counted one that no step() reset (accumulation reads it: > 0 adds).
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    opt.micro_step_id = INITIAL_MICRO_STEP_ID
