"""In-memory snapshot ring: each rank copies its own state into reused host buffers.

A snapshot is a nested state (dicts, lists, tensors, plain values). Tensors are copied into
host buffers, one per tensor: views of one arena per slot, every slot's made at the first
capture and sized for the state's estimate (a lazily initialized optimizer creates its state
at the first step: it fits), reused while the state keeps its shape. Plain values are
deep-copied; they are small (param groups, scheduler counters, RNG).

On CUDA the buffers are pinned and the copies run on a side stream of the state's own
device; ``fence()`` makes the compute stream wait for them before the next optimizer step
mutates the parameters, so the copy overlaps the next forward/backward instead of stalling
it. Tensors the forward itself writes (module buffers) are copied first, and the compute
stream waits for those few before the forward runs. Every source is kept alive until the
fence.

A restore copies back out of the host buffers into the live tensors
(:meth:`Snapshot.host`, orchestrator/engines/inplace.py), never building a device copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from orchestrator.pinned import unregister
from orchestrator.snapshot_copy import (
    Leaf,
    _aligned,
    _arena,
    _copy,
    _maybe_stream,
    flatten,
    slot_bytes,
    unflatten,
)

__all__ = ["Alloc", "Leaf", "Snapshot", "SnapshotRing", "flatten", "slot_bytes", "unflatten"]


@dataclass
class Snapshot:
    step: int
    sealed: bool = False
    skeleton: Any = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    copied: int = 0  # bytes this rank copied: less than nbytes where ranks share a node part
    ready: Any = None  # CUDA event recorded after the copies, or None on CPU
    held: bool = False  # being written to durable storage: its buffers must not be reused
    persisted: bool = False  # was handed to durable storage (decided alike on every rank)
    slot: int = -1  # the ring slot it lives in
    # orchestrator/replicas.py: the digest of the state it was taken from (a 0-d tensor on
    # the state's device; None: not computed), and whether the replicas agreed on it at its
    # step's check (None: not compared, e.g. sharded state).
    digest: torch.Tensor | None = None
    agreed: bool | None = None
    device: torch.device | None = None  # the GPU its copies run from (None: host state)
    sources: list[torch.Tensor] | None = None  # what its copies read, until they are fenced

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        self.sources = None

    def host(self, key: str, clone: bool = False) -> Any:
        """The part ``key`` of the state with its tensors as the host buffers themselves
        (``clone``: host copies of them), wherever the state lived. Restores copy out of
        them into the live tensors (orchestrator/engines/inplace.py): no device copy of the
        state is ever built. Without ``clone`` the tensors must not be kept or written."""
        self.wait()

        def get(leaf: Leaf) -> torch.Tensor:
            buf = self.buffers[leaf.index]
            return buf.clone() if clone else buf

        return unflatten(self.skeleton[key], get)

    def materialize(self, key: str, clone: bool) -> Any:
        """Rebuild the part ``key`` of the state with tensors on their original devices
        (for small parts only: on a GPU this is a second copy of them; restores of the
        model and optimizer use :meth:`host`).

        ``clone=False`` may alias the host buffers: only for consumers that copy out of them
        (``Module.load_state_dict``). Anything that keeps the tensors, such as
        ``Optimizer.load_state_dict`` on CPU, needs ``clone=True`` or it would write into
        the snapshot on its next step.
        """
        self.wait()

        def get(leaf: Leaf) -> torch.Tensor:
            buf = self.buffers[leaf.index]
            if leaf.device.type != "cpu":
                return buf.to(leaf.device)
            return buf.clone() if clone else buf

        return unflatten(self.skeleton[key], get)


# Where a slot's buffers come from (orchestrator/shm.py): (slot, tensors to copy, the slot's
# last buffers ([] when they may not be written), which tensors every rank holds alike) ->
# (buffers shaped like the tensors, what this rank copies of each: None for all of every
# one, else per tensor None (all) or the elements (a, b) of its flattened view).
Alloc = Callable[
    [int, list[torch.Tensor], list[torch.Tensor], list[bool]],
    tuple[list[torch.Tensor], list[tuple[int, int] | None] | None],
]


class SnapshotRing:
    """``keep`` slots of host buffers; the newest sealed snapshot is never overwritten.

    ``alloc`` and ``on_drop`` put the slots elsewhere than private host memory (node shared
    memory, orchestrator/shm.py): ``alloc`` gives a slot's buffers, ``on_drop(slot)`` says
    that a slot no longer holds a usable snapshot (a rollback abandoned it). Buffers from
    ``alloc`` may be shared with the node's other ranks, each copying its share: a slot
    whose snapshot was handed to durable storage then never has its buffers written again
    (a writer on another rank may still read them), whatever this rank's writer says."""

    def __init__(
        self,
        keep: int,
        alloc: Alloc | None = None,
        on_drop: Callable[[int], None] | None = None,
        reserve_bytes: int = 0,
    ) -> None:
        if keep < 2:
            raise ValueError("the ring needs at least 2 slots: the newest may not be sealed yet")
        self.keep = keep
        self.slots: list[Snapshot | None] = [None] * keep
        # Host buffers outlive the snapshots in them: a dropped snapshot frees its slot, and
        # the next capture into that slot reuses the allocation.
        self._buffers: list[list[torch.Tensor]] = [[] for _ in range(keep)]
        # Without ``alloc``: one arena per slot (page-locked at its exact size where the
        # state is on a GPU, orchestrator/pinned.py), the buffers views of it. Every slot's
        # is made at the first capture (before training), at least ``reserve_bytes`` (the
        # engine's estimate, lazily created optimizer state included), so no later capture
        # allocates on the training thread unless the state outgrows it.
        self._arenas: list[torch.Tensor | None] = [None] * keep
        self._reserve = slot_bytes(reserve_bytes) if reserve_bytes else 0
        self._streams: dict[torch.device, Any] = {}  # side stream per device
        self._alloc, self._on_drop = alloc, on_drop

    def reserve(self, nbytes: int) -> None:
        """Make every slot at least ``nbytes`` (an estimate, as ``reserve_bytes``) at the
        first capture: the user's registered objects counted (orchestrator/startup.py)."""
        self._reserve = slot_bytes(nbytes) if nbytes else 0

    # --- capture --------------------------------------------------------------------------
    def capture(
        self,
        step: int,
        state: dict[str, Any],
        alike: frozenset[str] = frozenset(),
        volatile: frozenset[int] = frozenset(),
    ) -> Snapshot | None:
        """Copy ``state`` into a free slot: the oldest one that is neither the newest sealed
        nor being persisted. ``alike``: the top-level keys every rank holds alike (``alloc``
        may keep them once per node). ``volatile``: the storage addresses (``data_ptr``) of
        tensors the next forward writes in place (BatchNorm's running statistics, the
        buffers DDP broadcasts): on a GPU they are copied first, and the compute stream
        waits for those copies before anything queued after this call (the forward) runs;
        the rest is not written before the next optimizer step, which :meth:`fence` orders.
        Returns None (nothing copied) when no slot is free."""
        victim = self._victim()
        if victim is None:
            return None
        leaves: list[torch.Tensor] = []
        skeleton: dict[str, Any] = {}
        mask: list[bool] = []
        for key, value in state.items():
            before = len(leaves)
            skeleton[key] = flatten(value, leaves)
            mask += [key in alike] * (len(leaves) - before)
        buffers, copies = self._slot_buffers(victim, leaves, mask)
        # The device is the state's own (never the current device: a rank that did not call
        # torch.cuda.set_device would put the stream on device 0).
        device = next((t.device for t in leaves if t.is_cuda), None)
        copied, ready = self._copy_in(leaves, buffers, copies, volatile, device)
        snap = Snapshot(
            step=step,
            skeleton=skeleton,
            buffers=buffers,
            nbytes=sum(b.numel() * b.element_size() for b in buffers),
            copied=copied,
            ready=ready,
            slot=victim,
            device=device,
            # The sources stay alive until the compute stream waits for their copies (the
            # fence): freed earlier, their memory could be reused while still being read.
            sources=leaves if ready is not None else None,
        )
        self._buffers[victim] = buffers
        self.slots[victim] = snap
        return snap

    def _slot_buffers(
        self, victim: int, leaves: list[torch.Tensor], mask: list[bool]
    ) -> tuple[list[torch.Tensor], list[tuple[int, int] | None] | None]:
        """The buffers of slot ``victim`` for ``leaves`` (``alloc``'s, else its own arena's),
        and what this rank copies of each (None: all of every one)."""
        reuse = self._buffers[victim]
        copies: list[tuple[int, int] | None] | None = None
        if self._alloc is not None:
            prev = self.slots[victim]
            if prev is not None:
                prev.wait()  # alloc may replace (and unlock) the memory it was copied into
                if prev.persisted:
                    reuse = []
            reuse, copies = self._alloc(victim, leaves, reuse, mask)
            buffers = list(reuse)
        else:
            buffers = self._own(victim, leaves)
        return buffers, copies

    def _copy_in(
        self,
        leaves: list[torch.Tensor],
        buffers: list[torch.Tensor],
        copies: list[tuple[int, int] | None] | None,
        volatile: frozenset[int],
        device: torch.device | None,
    ) -> tuple[int, Any]:
        """Copy ``leaves`` into ``buffers`` (on ``device``'s side stream, the ``volatile``
        ones first); the bytes copied and the CUDA event recorded after the copies."""
        compute = torch.cuda.current_stream(device) if device is not None else None
        stream = self._side_stream(device) if device is not None else None
        first = [i for i, t in enumerate(leaves) if t.data_ptr() in volatile and t.numel()]
        rest = [i for i, t in enumerate(leaves) if t.data_ptr() not in volatile or not t.numel()]
        copied = 0
        with torch.no_grad(), _maybe_stream(stream):
            for i in first:
                copied += _copy(buffers[i], leaves[i], copies[i] if copies is not None else None)
            if compute is not None and first:
                # The forward writes these in place: it runs after their copies. (The
                # compute stream was taken before the side stream became the current one.)
                written = torch.cuda.Event()
                written.record(stream)
                compute.wait_event(written)
            for i in rest:
                copied += _copy(buffers[i], leaves[i], copies[i] if copies is not None else None)
        ready = None
        if stream is not None:
            ready = torch.cuda.Event()
            ready.record(stream)
        return copied, ready

    def _own(self, slot: int, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host buffers for ``leaves`` in ``slot``: its last ones while the shapes hold,
        else views of its arena (a new one only when the state outgrew it)."""
        old = self._buffers[slot]
        if len(old) == len(leaves) and all(
            b.shape == t.shape and b.dtype == t.dtype for b, t in zip(old, leaves, strict=True)
        ):
            return old
        sizes = [_aligned(t.numel() * t.element_size()) for t in leaves]
        need = sum(sizes)
        pin = any(t.is_cuda for t in leaves)
        if all(a is None for a in self._arenas):  # the first capture: every slot's at once
            for i in range(self.keep):
                self._arenas[i] = _arena(max(need, self._reserve), pin)
        arena = self._arenas[slot]
        if arena is None or arena.numel() < need:
            prev = self.slots[slot]
            if prev is not None:
                prev.wait()  # no copy into the old arena in flight when it is unlocked
            self._drop_arena(slot)
            arena = self._arenas[slot] = _arena(max(need, self._reserve), pin)
        out, at = [], 0
        for t, n in zip(leaves, sizes, strict=True):
            nbytes = t.numel() * t.element_size()
            out.append(arena[at : at + nbytes].view(t.dtype).view(t.shape))
            at += n
        return out

    def _drop_arena(self, slot: int) -> None:
        """Let ``slot``'s arena go (a reader may still hold views of it: host reads stay
        valid; the copies into it have landed: its snapshot was waited for)."""
        unregister(self._arenas[slot])
        self._arenas[slot] = None

    def close(self) -> None:
        """Unlock the ring's page-locked memory (the run is over)."""
        for s in self.slots:
            if s is not None:
                s.wait()
        for i in range(self.keep):
            self._drop_arena(i)

    def _side_stream(self, device: torch.device) -> Any:
        """The side stream of ``device``, after the work queued on its compute stream."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def fence(self) -> None:
        """Make the compute stream wait for in-flight copies. Call before mutating state."""
        for s in self.slots:
            if s is not None and s.ready is not None:
                torch.cuda.current_stream(s.device).wait_event(s.ready)
                s.sources = None

    def _victim(self) -> int | None:
        free = [i for i, s in enumerate(self.slots) if s is None]
        if free:
            return free[0]
        newest_sealed = self.newest(lambda s: s.sealed)
        usable = [
            (s.step, i)
            for i, s in enumerate(self.slots)
            if s is not None and s is not newest_sealed and not s.held
        ]
        return min(usable)[1] if usable else None

    # --- queries and bookkeeping ----------------------------------------------------------
    def snapshots(self) -> list[Snapshot]:
        return sorted((s for s in self.slots if s is not None), key=lambda s: s.step)

    def newest(self, pred: Callable[[Snapshot], bool]) -> Snapshot | None:
        matches = [s for s in self.snapshots() if pred(s)]
        return matches[-1] if matches else None

    def has(self, step: int) -> bool:
        return any(s.step == step for s in self.snapshots())

    def at(self, step: int) -> Snapshot | None:
        return next((s for s in self.slots if s is not None and s.step == step), None)

    def discard(self, snap: Snapshot) -> None:
        """Forget one snapshot found bad (its restore did not match its digest)."""
        for i, s in enumerate(self.slots):
            if s is snap:
                self._forget(i, s)

    def _forget(self, i: int, s: Snapshot) -> None:
        s.wait()
        self.slots[i] = None
        if self._on_drop is not None:
            self._on_drop(i)
        if s.held or (s.persisted and self._alloc is not None):
            self._buffers[i] = []  # a persist thread may read them: new ones
            self._drop_arena(i)

    def seal_through(self, committed_step: int, seal_after_steps: int) -> list[Snapshot]:
        """Seal snapshots whose ``seal_after_steps`` steps are all committed now."""
        sealed = []
        for s in self.snapshots():
            if not s.sealed and committed_step >= s.step + seal_after_steps - 1:
                s.wait()
                s.sealed = True
                sealed.append(s)
        return sealed

    def drop_after(self, step: int) -> None:
        """Forget snapshots of a timeline that was rolled back (newer than ``step``) and the
        unsealed ones; their buffers stay allocated for reuse."""
        for i, s in enumerate(self.slots):
            if s is not None and (s.step > step or not s.sealed):
                self._forget(i, s)

    def pick(
        self, bad_step: int, min_age_steps: int, agreed_only: bool = False
    ) -> tuple[Snapshot | None, bool]:
        """Newest sealed snapshot at least ``min_age_steps`` older than ``bad_step`` (with
        ``agreed_only``: among those the replicas agreed on).

        Returns ``(snapshot, age_met)``; falls back to the oldest sealed one when none is old
        enough, and to ``None`` when nothing is sealed.
        """
        sealed = [s for s in self.snapshots() if s.sealed and (s.agreed or not agreed_only)]
        old_enough = [s for s in sealed if s.step <= bad_step - min_age_steps]
        if old_enough:
            return old_enough[-1], True
        return (sealed[0], False) if sealed else (None, False)
