"""The few collectives the Guard needs, on an explicit process group.

Every call names its group, so tests can run ranks as threads with one gloo group each and
the Guard never touches a group it was not given. Without an initialized process group the
Guard runs single-process and these become local no-ops.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class Comm:
    """Consensus primitives over one process group (``None``: the default group, if any)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.enabled = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None or not self.enabled else dist.group.WORLD
        self.rank = dist.get_rank(self.group) if self.enabled else 0
        self.world_size = dist.get_world_size(self.group) if self.enabled else 1
        self.global_rank = dist.get_rank() if self.enabled else 0
        #: The GPU this rank's state lives on (the Guard sets it from the model's tensors):
        #: NCCL collectives run there, whatever torch.cuda.current_device() says (cuda:0 on
        #: a rank that never called torch.cuda.set_device).
        self.device: torch.device | None = None
        #: A replacement rank's start (issue 33, orchestrator/rejoin.py): the survivors run
        #: no start-up collectives, so until it joins their agreement every collective here
        #: answers with this rank's own value (as if every rank had said the same).
        self.solo = False

    def all_reduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place SUM over the group: the one collective of a healthy step."""
        if self.world_size > 1 and not self.solo:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_reduce_max(self, value: int) -> int:
        if self.world_size == 1 or self.solo:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Gather a small picklable object from every rank (cold path only)."""
        if self.world_size == 1 or self.solo:
            return [obj] * self.world_size
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src_rank: int = 0) -> Any:
        """Rank ``src_rank`` of the group decides; every rank gets its value."""
        if self.world_size == 1 or self.solo:
            return obj
        box = [obj]
        src = dist.get_global_rank(self.group, src_rank) if self.group is not None else src_rank
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def _device(self) -> torch.device:
        # NCCL only moves CUDA tensors; gloo only CPU ones.
        if self.enabled and dist.get_backend(self.group) == "nccl":
            if self.device is not None and self.device.type == "cuda":
                return self.device
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


# How long a gloo worker thread may wait for the peers' exit barrier (fence_gloo_at_exit).
# Nothing waits for the barrier itself; this bounds only a join of that thread (a process
# group destroyed while a peer is still running), never the peers' progress.
EXIT_BARRIER_TIMEOUT_S = 10.0

_KEPT_BACKENDS: dict[int, Any] = {}  # gloo backends a Guard ran on, by id (fenced at exit)
_FENCES: list[Any] = []  # the exit barriers: alive until interpreter finalization, on purpose


def _gloo_backend(group: dist.ProcessGroup | None) -> Any | None:
    """``group``'s gloo backend (a ``ProcessGroupGloo``), or None (NCCL only, a debug
    wrapper, an older torch)."""
    if group is None or not dist.is_gloo_available():
        return None
    try:
        backend = group._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError):
        return None
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


def keep_for_exit(group: dist.ProcessGroup | None) -> None:
    """Keep ``group``'s gloo backend for :func:`fence_gloo_at_exit`, which must reach it
    even after the script destroyed the group: a DDP or FSDP module keeps the backend, and
    its worker threads, alive anyway."""
    backend = _gloo_backend(group)
    if backend is not None:
        _KEPT_BACKENDS[id(backend)] = backend


def forget_for_exit(group: dist.ProcessGroup | None) -> None:
    """Stop keeping ``group``'s gloo backend: a broken group left behind by an in-place
    re-form (orchestrator/rejoin.py), whose dead peer no barrier can meet."""
    backend = _gloo_backend(group)
    if backend is not None:
        _KEPT_BACKENDS.pop(id(backend), None)


def fence_gloo_at_exit(timeout_s: float = EXIT_BARRIER_TIMEOUT_S) -> int:
    """Fence every gloo group still registered and every one :func:`keep_for_exit` kept, so
    that no gloo worker thread frees the tensors of an earlier collective before interpreter
    finalization (where they are leaked). Call it at exit, after the script's last
    collective, on every rank (the Guard's ``atexit`` handler does). It never waits for a
    peer.

    Why: a gloo worker thread can still hold the last collectives' works when the script is
    done. Destroying a work frees its tensors, and freeing a tensor whose Python object
    Python has already let go of takes the GIL: torch checks ``Py_IsInitialized()``, then
    waits for the GIL. A thread that passed the check and still waits when the main thread
    enters interpreter finalization is ended by ``pthread_exit``, whose unwinding through a
    ``noexcept`` destructor calls ``std::terminate``: "terminate called without an active
    exception", SIGABRT (exit -6) after every step was done (a core showed
    ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` -> ``~AsyncAllreduceWork`` ->
    ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``). Destroying the process group
    does not prevent it: that joins the worker threads only when it drops the last
    reference to the backend, and a DDP or FSDP module holds one.

    How: ``ProcessGroupGloo::barrier`` takes, under the work lock (so no worker thread is
    half-way through freeing a work), a weak reference to every work the worker threads
    hold or have queued; a work with a weak reference left is destroyed only when that
    reference goes, with the barrier. Each barrier is kept here until interpreter
    finalization, where torch's check sees the interpreter finalizing and leaks a
    tensor's Python object instead of waiting for the GIL. Whether the peers join the
    barrier does not matter (one that already left fails it at once); ``timeout_s`` bounds
    only how long a worker thread stays in it.

    Returns:
        How many gloo groups were fenced.
    """
    backends = dict(_KEPT_BACKENDS)
    if dist.is_available() and dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            backend = _gloo_backend(group)
            if backend is not None:
                backends.setdefault(id(backend), backend)
    opts = dist.BarrierOptions()
    opts.timeout = timedelta(seconds=timeout_s)
    fenced = 0
    for backend in backends.values():
        try:
            _FENCES.append(backend.barrier(opts))
            fenced += 1
        except RuntimeError as err:  # a group already broken; fence the others
            logger.warning("rank %d: no exit barrier on a gloo group: %r", backend.rank(), err)
    return fenced


_ENDING_ON_ERROR = [False]  # note_error was called: the groups are aborted at the end


def note_error() -> None:
    """This process ends on an error (a health check failed, an exception left the training
    loop): :func:`end_process_groups` aborts its process groups instead of destroying them."""
    _ENDING_ON_ERROR[0] = True


def ending_on_error() -> bool:
    """Whether this process ends on an error: :func:`note_error` was called, or an exception
    nobody caught is ending the interpreter (``sys.last_value``, set before ``atexit``)."""
    return _ENDING_ON_ERROR[0] or getattr(sys, "last_value", None) is not None


def end_process_groups(after_error: bool | None = None) -> str:
    """End every process group of this process: destroyed after a clean run, aborted after
    an error (``after_error``; None: :func:`ending_on_error`).

    Why: destroying a group shuts its backend down, and NCCL's shutdown can wait for the
    peers: when this rank leaves on an error while the others block in a collective (or
    one of them is gone), the exit hangs. Aborting (``ncclCommAbort``) waits for nobody.
    Gloo takes the same path (its abort, like its shutdown, is quick); should the abort
    itself fail, the groups are destroyed as before.

    Returns:
        ``"aborted"``, ``"destroyed"``, or ``"none"`` (no process group initialized).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return "none"
    if after_error if after_error is not None else ending_on_error():
        try:
            dist.distributed_c10d._abort_process_group()
            return "aborted"
        except Exception as err:  # at the end: destroy, as without an error
            logger.warning("aborting the process groups failed (%r); destroying them", err)
    if dist.is_initialized():
        dist.destroy_process_group()
    return "destroyed"


def exit_process(code: int = 0) -> NoReturn:
    """End a distributed training script: destroy the process groups, flush, and leave
    without Python's interpreter teardown. Call it last, on every rank, once no rank has a
    collective left to run (after a ``dist.barrier()`` if in doubt).

    A plain return ends a script that ran a Guard as safely (the Guard fences the gloo
    groups at exit: :func:`fence_gloo_at_exit`); this is for a script that wants its exit
    code without ``sys.exit``, or that never ran a Guard. ``os._exit`` skips interpreter
    finalization, and with it ``atexit`` handlers: close what you opened (the Guard,
    loggers, trackers) before; a Guard left open is closed here as at exit (``run_end``
    status ``not_closed``). A non-zero ``code`` is an error: the process groups are aborted,
    not destroyed (:func:`end_process_groups`)."""
    lifecycle = sys.modules.get("orchestrator.lifecycle")  # loaded if a Guard ever ran
    if lifecycle is not None:
        lifecycle.close_forgotten()
    end_process_groups(after_error=code != 0 or ending_on_error())
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or redirected to a dead pipe: nothing to keep
            pass
    os._exit(code)
