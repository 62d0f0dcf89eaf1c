"""Page-locked host memory of exact size: ``cudaHostRegister`` on memory we allocate.

A copy from a GPU into pageable memory is synchronous and staged through a driver buffer,
at a fraction of the bandwidth; into page-locked memory it is a DMA that overlaps compute.
torch's pinned allocator (``pin_memory=True``) rounds every block up to a power of two (up
to twice what the ring budgets), so the ring pins what it allocates itself instead: one
arena per slot (orchestrator/snapshot.py) and the shared-memory slot files
(orchestrator/shm.py), each registered at its exact size and unregistered before it is let
go. Without CUDA every call is a no-op.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every device of the process
_registered: set[int] = set()  # data_ptr of every region registered here
_warned = False


def register(t: torch.Tensor) -> bool:
    """Page-lock the host memory of ``t`` (contiguous, CPU); True if it now is. A failure
    (no CUDA, a kernel limit on locked memory) leaves it pageable: copies into it are then
    synchronous, which is slower, never wrong."""
    global _warned
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or t.is_cuda or not torch.cuda.is_available():
        return False
    ptr = t.data_ptr()
    if ptr in _registered:
        return True
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))
    if err != 0:
        if not _warned:
            _warned = True
            logger.warning(
                "cannot page-lock %.1f MiB of snapshot memory (cudaHostRegister error %d): "
                "snapshot copies into it run synchronously; check `ulimit -l`",
                nbytes / 2**20,
                err,
            )
        return False
    _registered.add(ptr)
    return True


def unregister(t: torch.Tensor | None) -> None:
    """Undo :func:`register` (no-op for memory it did not lock). Call while ``t`` is still
    allocated and no copy into it is in flight."""
    if t is None:
        return
    ptr = t.data_ptr()
    if ptr in _registered:
        _registered.discard(ptr)
        torch.cuda.cudart().cudaHostUnregister(ptr)
