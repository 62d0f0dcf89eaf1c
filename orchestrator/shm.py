"""The snapshot ring in node shared memory: slots that outlive the process.

Each ring slot of each rank is one file, ``<root>/slot<k>/rank<r>-<gen>.bin``, mapped into
the process (``torch.from_file(shared=True)``): the ring copies into it directly, no extra
copy. A crash, an OOM kill or a hang kill loses the process, not the slot; the next attempt
on the node reads it back instead of the durable tier.

A slot's verdict, ``rank<r>.json``, is written only once the snapshot is sealed (the steps
after it checked finite): step, attempt, its file, the layout of every tensor in it, the
plain values, and a CRC32 of the bytes, computed on a thread (zlib releases the GIL). It is
removed before the slot is written again and when a rollback abandons the snapshot, so
bytes without a verdict, or that do not match theirs, are never used. A restart takes the
newest step whose verdict every rank has and whose bytes match on every rank (the durable
tier's ``find_resume`` agrees on it), else the durable tier.

A slot whose snapshot is still being persisted (or changes shape) gets a new file (the next
``<gen>``); the old one is unlinked, and its mapping stays valid until dropped, so a reader
never sees its bytes change or vanish.

State that every rank of the group holds alike (DDP's model, optimizer, scheduler: the keys
the engine's durable part gives rank 0 only) is kept once per node, in the slot's node file
``node-<token>-<gen>.bin``: each of the node's L ranks copies 1/L of its bytes (a byte range
cut at element boundaries), so the per-rank stall falls with L, and every rank maps the
whole file, so a rollback or a restart reads it locally with no collective. Each rank's
verdict covers its own share; a step is usable only when every rank that wrote a share has
its verdict, naming the same node file and timeline, and the same ranks run on the node.

``root`` is ``$ORCHESTRATOR_SHM_DIR`` under the supervisor, which names it per run and node,
keeps it across attempts and removes it when the job ends for good; without it, a folder
under ``snapshot.shm_dir`` that the Guard removes at ``close()``.
"""

from __future__ import annotations

import os
import shutil
import threading

import torch

from orchestrator.pinned import unregister
from orchestrator.shm_files import SlotFiles, _unlink
from orchestrator.shm_index import agreeable, node_refusal, verdicts
from orchestrator.shm_verdict import CHUNK, SlotVerdicts, _Cancelled, _crcs
from orchestrator.snapshot_copy import slot_bytes

# CHUNK, _Cancelled and _crcs: imported from here by tests/test_units.py.
__all__ = ["CHUNK", "ShmSlots", "_Cancelled", "_crcs", "agreeable", "node_refusal", "verdicts"]

# What the ring copies of a tensor into its buffer: None, all of it; (a, b), the elements
# a..b of its flattened view (this rank's share of a node part).
Share = tuple[int, int] | None


class ShmSlots(SlotFiles, SlotVerdicts):
    """One rank's ring slots in ``root``: the ring's buffers, verdicts, reading back.

    ``node_ranks``: the group's ranks on this node (sorted, this one included), which share
    the node part of each slot; ``token`` names this group's node files (alike on those
    ranks). One rank (or None, for a reader such as the flush helper): no node part."""

    def __init__(
        self,
        root: str,
        rank: int,
        world_size: int,
        keep: int,
        attempt: int,
        node_ranks: list[int] | None = None,
        token: str = "",
    ) -> None:
        self.root, self.rank, self.keep, self.attempt = root, rank, keep, attempt
        self.world_size = world_size
        self.node_ranks, self.token = node_ranks, token
        self._maps: list[torch.Tensor | None] = [None] * keep  # each slot's mapped bytes
        self._files: list[str | None] = [None] * keep
        self._node_maps: list[torch.Tensor | None] = [None] * keep  # the node part's
        self._node_files: list[str | None] = [None] * keep
        # Per slot, from its last allocation: which leaves live in the node part, what this
        # rank copies of each, and the [offset, nbytes] of its share of the node file.
        self._in_node: list[list[bool]] = [[] for _ in range(keep)]
        self._copies: list[list[Share] | None] = [None] * keep
        self._share: list[list[list[int]]] = [[] for _ in range(keep)]
        self._offsets: list[tuple[list[int], list[int]]] = [([], []) for _ in range(keep)]
        self._gen = self._node_gen = 0
        # The engine's estimate of this rank's state (lazily created optimizer state
        # included): every slot's file is made that large at the first capture, before
        # training, as the private ring makes its arenas (the Guard sets it).
        self.reserve_bytes = 0
        self.reserve_alike = False  # that state is held alike by every rank (DDP): node part
        # The user's objects' state (orchestrator/stateful.py): each rank's own, in its file.
        self.reserve_own = 0
        self._unused: set[tuple[int, bool]] = set()  # (slot, node part): made, never written
        self._unused_next: set[tuple[int, bool]] = set()  # being made so
        # slot -> the thread writing its verdict, and the event that cancels it
        self._sealing: dict[int, tuple[threading.Thread, threading.Event]] = {}
        self._made_root = False

    def _verdict(self, slot: int) -> str:
        return os.path.join(self.root, f"slot{slot}", f"rank{self.rank}.json")

    # --- the ring's buffers ----------------------------------------------------------------
    def alloc(
        self,
        slot: int,
        leaves: list[torch.Tensor],
        reuse: list[torch.Tensor],
        alike: list[bool] | None = None,
    ) -> tuple[list[torch.Tensor], list[Share] | None]:
        """Buffers shaped like ``leaves`` in ``slot``'s files, and what this rank copies
        into each (None: all of each). ``reuse``: the slot's last buffers ([] when they may
        not be written: decided alike on every rank), kept when they fit. ``alike`` marks
        the leaves every rank of the node holds alike: they go to the node part, of which
        this rank copies its share. The slot's verdict goes first: from here until it is
        sealed again, its bytes are not a snapshot."""
        # Its checksum may still be reading it (others' may run on). That verdict is
        # withdrawn next anyway: stop it rather than wait (a state of GBs checksums for
        # seconds; steps of milliseconds reuse a slot sooner, measured on an H200).
        self.join(slot, cancel=True)
        self.drop(slot)
        shared = len(self.node_ranks or []) > 1 and alike is not None and any(alike)
        in_node = list(alike) if shared and alike is not None else [False] * len(leaves)
        same = len(reuse) == len(leaves) and in_node == self._in_node[slot]

        def fits(part: bool) -> bool:
            return same and all(
                b.shape == t.shape and b.dtype == t.dtype
                for b, t, n in zip(reuse, leaves, in_node, strict=True)
                if n == part
            )

        # Each file is kept or replaced on its own: the node part's decision depends only on
        # what every rank of the node holds alike, so they all take the same file.
        own_fits, node_fits = fits(False), fits(True)
        if own_fits and node_fits:  # the steady state: nothing to allocate or map
            return reuse, self._copies[slot]
        own_at, node_at = self._offsets[slot]
        pin = any(t.is_cuda for t in leaves)  # copies from a GPU: page-lock the mapping
        first = all(m is None for m in (*self._maps, *self._node_maps))
        own_leaves = [t for t, n in zip(leaves, in_node, strict=True) if not n]
        alike_leaves = [t for t, n in zip(leaves, in_node, strict=True) if n]
        own_room, node_room = self._rooms(shared)
        # The ring lets this slot's bytes be written again: a file with room is laid out anew.
        writable = bool(reuse)
        if not own_fits:
            own_at = self._new_file(slot, own_leaves, pin=pin, room=own_room, in_place=writable)
        if shared and not node_fits:
            node_at = self._new_file(
                slot, alike_leaves, node=True, pin=pin, room=node_room, in_place=writable
            )
            self._share[slot], cut = self._cut(alike_leaves, node_at)
            it = iter(cut)
            self._copies[slot] = [next(it) if n else None for n in in_node]
        elif not shared:
            self._no_node_part(slot)
        self._in_node[slot], self._offsets[slot] = in_node, (own_at, node_at)
        if first:  # every other slot's files now, not at its first use mid-training
            self._make_others(slot, own_leaves, alike_leaves, pin, shared, (own_room, node_room))
        return self._views(slot, leaves, in_node), self._copies[slot]

    def _no_node_part(self, slot: int) -> None:
        """``slot`` holds no node part (from now on)."""
        if self._node_files[slot] is not None:  # it had a node part: no longer
            _unlink(str(self._node_files[slot]))
        unregister(self._node_maps[slot])
        self._node_maps[slot] = self._node_files[slot] = None
        self._share[slot], self._copies[slot] = [], None

    def _make_others(
        self,
        slot: int,
        own_leaves: list[torch.Tensor],
        alike_leaves: list[torch.Tensor],
        pin: bool,
        shared: bool,
        rooms: tuple[int, int],
    ) -> None:
        """At the first capture: the files of every slot but ``slot``, made ahead of use."""
        own_room, node_room = rooms
        for other in range(self.keep):
            # An earlier process's files stay until the slot's first use: its snapshot
            # may still be flushed or healed from, and /dev/shm is sized for one ring.
            if other == slot or self._earlier(other):
                continue
            self._unused_next.add((other, False))
            self._new_file(other, own_leaves, pin=pin, room=own_room)
            self._unused_next.discard((other, False))
            self._unused.add((other, False))
            if shared:
                self._new_file(other, alike_leaves, node=True, pin=pin, room=node_room)
                self._unused.add((other, True))

    def _views(
        self, slot: int, leaves: list[torch.Tensor], in_node: list[bool]
    ) -> list[torch.Tensor]:
        """Views of ``slot``'s files shaped like ``leaves``, at the offsets laid out."""
        own_at, node_at = self._offsets[slot]
        own, at = iter(own_at), iter(node_at)
        out = []
        for t, n in zip(leaves, in_node, strict=True):
            mapped, off = (self._node_maps[slot], next(at)) if n else (self._maps[slot], next(own))
            assert mapped is not None
            size = t.numel() * t.element_size()
            out.append(mapped[off : off + size].view(t.dtype).view(t.shape))
        return out

    def _rooms(self, shared: bool) -> tuple[int, int]:
        """The least size of this rank's file and of the node file of a slot. The room goes
        where the bulk of the state lives: the node part when every rank holds it alike
        (the same size on all of them), else this rank's own file. The estimate leaves out
        alignment, Adam's ``step`` tensors, the RNG and the Guard's values: room sized as a
        private slot's arena (on an H200 the bare estimate was short, and the first use of
        each slot still made a file). The user's objects' state is each rank's own: room in
        its own file."""
        room = slot_bytes(self.reserve_bytes) if self.reserve_bytes else 0
        own = (0 if shared and self.reserve_alike else self.reserve_bytes) + self.reserve_own
        return (slot_bytes(own) if own else 0), (room if self.reserve_alike else 0)

    def _cut(
        self, tensors: list[torch.Tensor], offsets: list[int]
    ) -> tuple[list[list[int]], list[Share]]:
        """This rank's share of the node part: the k-th of L equal byte ranges of the
        tensors' bytes in a row, cut at element boundaries (every element belongs to exactly
        one rank). Returns its [offset, nbytes] segments in the file and what it copies of
        each tensor (None: all of it)."""
        assert self.node_ranks is not None
        count, k = len(self.node_ranks), self.node_ranks.index(self.rank)
        sizes = [t.numel() * t.element_size() for t in tensors]
        total = sum(sizes)
        lo, hi = total * k // count, total * (k + 1) // count
        segments: list[list[int]] = []
        copies: list[Share] = []
        at = 0
        for t, n, off in zip(tensors, sizes, offsets, strict=True):
            e = t.element_size()
            a, b = min(max(lo - at, 0), n) // e, min(max(hi - at, 0), n) // e
            # Wholly this rank's: a plain copy (no views); only a boundary tensor is sliced.
            copies.append(None if (a, b) == (0, t.numel()) else (a, b))
            if b > a:
                segments.append([off + a * e, (b - a) * e])
            at += n
        return segments, copies

    def drop(self, slot: int) -> None:
        """Withdraw ``slot``'s verdict (about to be overwritten, or abandoned by a rollback)."""
        _unlink(self._verdict(slot))

    def join(self, slot: int | None = None, cancel: bool = False) -> None:
        """Wait for the verdict of ``slot`` (None: of every slot) to be written; with
        ``cancel``, for its writer to stop (within one 4 MiB piece), writing none."""
        for s in [slot] if slot is not None else list(self._sealing):
            sealing = self._sealing.pop(s, None)
            if sealing is not None:
                if cancel:
                    sealing[1].set()
                sealing[0].join()

    def close(self, remove: bool) -> None:
        self.join()
        for mapped in (*self._maps, *self._node_maps):
            unregister(mapped)
        self._maps = [None] * self.keep
        self._node_maps = [None] * self.keep
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
