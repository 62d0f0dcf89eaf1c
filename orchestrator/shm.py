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

import io
import json
import os
import shutil
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from orchestrator.codec import decode, dtype_of, encode
from orchestrator.engines.native import load_native
from orchestrator.errors import PersistError
from orchestrator.pinned import register, unregister
from orchestrator.rundir import write_atomic, write_bytes
from orchestrator.shm_index import agreeable, node_refusal, verdicts
from orchestrator.snapshot import Leaf, Snapshot, unflatten

__all__ = ["ShmSlots", "agreeable", "node_refusal", "verdicts"]

ALIGN = 64  # every tensor starts on a cache line (and on any dtype's alignment)
SPARE = "spare-"  # a slot file made at the first capture, before the slot's first use


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


CHUNK = 64 << 20  # checksums per 64 MiB: a restart checks the chunks on parallel threads
STEP = 4 << 20  # a sealing checksum looks for a cancel between 4 MiB pieces


class _Cancelled(Exception):
    """The slot is being reused: its checksum would describe bytes about to change."""


def _crc(piece: memoryview, cancel: threading.Event | None) -> int:
    if cancel is None:
        return zlib.crc32(piece)
    crc = 0
    for at in range(0, len(piece), STEP):  # incremental: the same value as in one call
        if cancel.is_set():
            raise _Cancelled
        crc = zlib.crc32(piece[at : at + STEP], crc)
    return crc


def _crcs(
    buf: torch.Tensor,
    segments: list[list[int]] | None = None,
    threads: int = 1,
    cancel: threading.Event | None = None,
) -> list[int]:
    """CRC32 of each CHUNK-sized piece of ``buf`` (uint8), or of its ``[offset, nbytes]``
    segments, in order. zlib releases the GIL: ``threads`` > 1 checks pieces in parallel.
    ``cancel`` set stops it (:class:`_Cancelled`) within one 4 MiB piece."""
    data = buf.numpy().data
    pieces = [
        data[at : at + min(CHUNK, off + n - at)]
        for off, n in (segments if segments is not None else [[0, len(data)]])
        for at in range(off, off + n, CHUNK)
    ]
    if threads <= 1 or len(pieces) <= 1:
        return [_crc(p, cancel) for p in pieces]
    with ThreadPoolExecutor(min(threads, len(pieces))) as pool:
        return list(pool.map(zlib.crc32, pieces))


def _check_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


# What the ring copies of a tensor into its buffer: None, all of it; (a, b), the elements
# a..b of its flattened view (this rank's share of a node part).
Share = tuple[int, int] | None


def _mapped(path: str, size: int, shared: bool) -> torch.Tensor:
    return torch.from_file(path, shared=shared, size=size, dtype=torch.uint8)


class ShmSlots:
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
        self._unused: set[tuple[int, bool]] = set()  # (slot, node part): made, never written
        self._unused_next: set[tuple[int, bool]] = set()  # being made so
        # slot -> the thread writing its verdict, and the event that cancels it
        self._sealing: dict[int, tuple[threading.Thread, threading.Event]] = {}
        self._made_root = False

    def _removed(self, path: str) -> PersistError:
        return PersistError(
            f"snapshot.shared_memory: the ring slot {path} of rank {self.rank} was removed "
            "while it was being made (its supervisor ended, or something cleaned "
            f"{os.path.dirname(self.root)}); this rank cannot keep snapshots there"
        )

    def _mkdir(self, d: str) -> None:
        """Make slot folder ``d``; ``root`` only the first time: a root that vanished later
        was removed by the supervisor's end (orchestrator/lifeline.py), and recreating it
        would leave a ring in shared memory that nobody removes."""
        if not self._made_root:
            os.makedirs(self.root, exist_ok=True)
            self._made_root = True
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        except FileNotFoundError as err:
            raise PersistError(
                f"snapshot.shared_memory: the ring folder {self.root} of rank {self.rank} was "
                "removed while the rank ran (its supervisor ended, or something cleaned "
                f"{os.path.dirname(self.root)}); this rank cannot keep snapshots there"
            ) from err

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
        # The room goes where the bulk of the state lives: the node part when every rank
        # holds it alike (the same size on all of them), else this rank's own file.
        node_room = self.reserve_bytes if self.reserve_alike else 0
        own_room = 0 if shared and self.reserve_alike else self.reserve_bytes
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
            if self._node_files[slot] is not None:  # it had a node part: no longer
                _unlink(str(self._node_files[slot]))
            unregister(self._node_maps[slot])
            self._node_maps[slot] = self._node_files[slot] = None
            self._share[slot], self._copies[slot] = [], None
        self._in_node[slot], self._offsets[slot] = in_node, (own_at, node_at)
        if first:  # every other slot's files now, not at its first use mid-training
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
        own, at = iter(own_at), iter(node_at)
        out = []
        for t, n in zip(leaves, in_node, strict=True):
            mapped, off = (self._node_maps[slot], next(at)) if n else (self._maps[slot], next(own))
            assert mapped is not None
            size = t.numel() * t.element_size()
            out.append(mapped[off : off + size].view(t.dtype).view(t.shape))
        return out, self._copies[slot]

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

    def _new_file(
        self,
        slot: int,
        tensors: list[torch.Tensor],
        node: bool = False,
        pin: bool = False,
        room: int = 0,
        in_place: bool = False,
    ) -> list[int]:
        """A new file for ``slot``'s tensors (this rank's own, or the node part: created by
        the first of the node's ranks to get here, opened by the others), of at least
        ``room`` bytes, mapped shared and, with ``pin``, page-locked (orchestrator/pinned.py:
        a copy from a GPU into pageable memory is synchronous and staged); returns each
        tensor's offset in it. The slot's current file is kept when it has room and may be
        written (``in_place``, or never written yet): creating and page-locking GBs costs
        about a second on the training thread. A file replaced is unlinked: a mapping of
        it (a persisting reader's) lives on until dropped, unlocked (nothing copies into it
        any more)."""
        offsets, total = [], 0
        for t in tensors:
            offsets.append(total)
            total += _aligned(t.numel() * t.element_size())
        total = total or ALIGN
        current = (self._node_maps if node else self._maps)[slot]
        unused = (slot, node) in self._unused
        self._unused.discard((slot, node))
        if current is not None and current.numel() >= total and (in_place or unused):
            if unused and not node:  # from now on a slot's file, which a restart reads
                self._files[slot] = _renamed(str(self._files[slot]), SPARE, "")
            return offsets
        total = max(total, _aligned(room))
        d = os.path.join(self.root, f"slot{slot}")
        self._mkdir(d)
        files = self._node_files if node else self._files
        old = files[slot]
        # This rank's files, or node files of this group, from an earlier process: the
        # node's ranks name their node files alike (the group's token, one count).
        mine = f"node-{self.token}-" if node else f"rank{self.rank}-"
        if old is None:  # (own files made ahead of use are named SPARE + mine until used)
            try:
                names = os.listdir(d)
            except FileNotFoundError as err:
                raise self._removed(d) from err
            for name in names:
                if self._earlier_name(name, node):
                    _unlink(os.path.join(d, name))
        if node:
            self._node_gen += 1
            path = os.path.join(d, f"{mine}{self._node_gen}.bin")
        else:
            self._gen += 1
            # Made ahead of its first use: named apart, or a restart would count a slot that
            # never held a snapshot as one left unsealed.
            spare = SPARE if (slot, node) in self._unused_next else ""
            path = os.path.join(d, f"{spare}{mine}{self._gen}.bin")
        # Never truncated: another rank of the node may be writing its share already.
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | (0 if node else os.O_TRUNC), 0o600)
        except FileNotFoundError as err:
            raise self._removed(path) from err
        try:
            # Reserved now: a full tmpfs would otherwise kill the training thread with
            # SIGBUS at its first write into the mapping.
            os.posix_fallocate(fd, 0, total)
        except OSError as err:
            _unlink(path)
            raise PersistError(
                f"snapshot.shared_memory: no room for a {total / 2**20:.2f} MiB ring slot "
                f"of rank {self.rank} under {self.root} ({err.strerror}). Free or enlarge "
                f"{os.path.dirname(self.root)} (`df -h {os.path.dirname(self.root)}`), "
                "lower snapshot.keep, or set snapshot.shared_memory: false"
            ) from err
        finally:
            os.close(fd)
        try:
            mapped = _mapped(path, total, shared=True)
        except RuntimeError as err:
            if os.path.exists(path):
                raise
            # Removed between creating and mapping it: the ring was taken away under this
            # rank (orchestrator/lifeline.py), as _mkdir reports it.
            raise self._removed(path) from err
        maps = self._node_maps if node else self._maps
        unregister(maps[slot])
        if pin:
            register(mapped)
        maps[slot] = mapped
        files[slot] = path
        if old is not None:
            _unlink(old)
        return offsets

    def _earlier_name(self, name: str, node: bool) -> bool:
        """``name`` is a slot file of this rank (``node``: of this node's group) that an
        earlier process left."""
        if not name.endswith(".bin"):
            return False
        if not node:
            return name.removeprefix(SPARE).startswith(f"rank{self.rank}-")
        return name.startswith("node-") and not name.startswith(f"node-{self.token}-")

    def _earlier(self, slot: int) -> bool:
        """An earlier process left files in ``slot`` (this rank's or the node group's)."""
        try:
            names = os.listdir(os.path.join(self.root, f"slot{slot}"))
        except FileNotFoundError:
            return False
        return any(self._earlier_name(n, False) or self._earlier_name(n, True) for n in names)

    def seal(
        self,
        snap: Snapshot,
        on_error: Callable[[Exception], None],
        plan: dict[str, Any],
        checked_through: int | None = None,
        rollbacks: int = 0,
    ) -> None:
        """Write the verdict of the sealed ``snap``; the checksum runs on a thread, which
        calls ``on_error`` if the verdict cannot be written (a full /dev/shm). ``plan``:
        what this rank's durable part of it holds (orchestrator/flush.py writes it)."""
        slot = snap.slot
        self.join(slot)  # one verdict writer per slot at a time
        mapped, path = self._maps[slot], self._files[slot]
        node_map, in_node = self._node_maps[slot], self._in_node[slot]
        assert mapped is not None and path is not None, "a snapshot not in shared memory"
        bases = (mapped.data_ptr(), node_map.data_ptr() if node_map is not None else 0)
        verdict: dict[str, Any] = {
            "step": snap.step,
            "attempt": self.attempt,
            "rank": self.rank,
            "world_size": self.world_size,
            "file": os.path.basename(path),
            "bytes": mapped.numel(),
            # Every tensor of the snapshot (by its index in the ring's list): where it is,
            # in this rank's file or in the node part.
            "leaves": [
                [b.data_ptr() - bases[n], str(b.dtype), list(b.shape), n]
                for b, n in zip(snap.buffers, in_node, strict=True)
            ],
            "persist": plan,
            "sealed": True,  # the steps after it checked finite (through ``checked_through``)
            "checked_through": checked_through,
            # Which timeline: a rank's slot left on this node by an earlier attempt (ranks
            # may land on other nodes after a rendezvous) or before a rollback of this one
            # is never mixed with the other ranks' slots of the same step.
            "timeline": f"{self.attempt}-{rollbacks}",
        }
        node_file = self._node_files[slot]
        if node_map is not None and node_file is not None:
            verdict["node"] = {
                "file": os.path.basename(node_file),
                "bytes": node_map.numel(),
                "ranks": self.node_ranks,
                "share": self._share[slot],  # this rank's [offset, nbytes]: its crc32
            }

        cancel = threading.Event()

        def run() -> None:  # off the training thread; alloc() cancels it before reusing the slot
            try:
                self._values(snap, verdict, slot)
                # One thread: training runs beside it.
                verdict["crc32"] = _crcs(mapped, cancel=cancel)
                if node_map is not None:
                    share = verdict["node"]["share"]
                    verdict["node"]["crc32"] = _crcs(node_map, share, cancel=cancel)
                if not cancel.is_set():
                    write_atomic(self._verdict(slot), json.dumps(verdict))
            except _Cancelled:
                pass  # the slot is being overwritten: no verdict, as drop() leaves it
            except Exception as err:  # the slot stays without a verdict: never used
                on_error(err)

        t = threading.Thread(target=run, name="orchestrator-shm-seal", daemon=True)
        t.start()
        self._sealing[slot] = (t, cancel)

    def _values(self, snap: Snapshot, verdict: dict[str, Any], slot: int) -> None:
        """The plain values of ``snap`` into its verdict: JSON with the tensors named by
        path (orchestrator/codec.py), or, for what JSON cannot hold (DeepSpeed's loss-scaler
        object), pickled beside the slot, as its own checkpoint files are (engines/native.py),
        and checksummed like the bytes."""
        try:
            tensors: dict[str, torch.Tensor] = {}
            verdict["skeleton"] = encode(snap.skeleton, "", tensors, snap.buffers)
            index = {id(b): i for i, b in enumerate(snap.buffers)}
            verdict["paths"] = {p: index[id(t)] for p, t in tensors.items()}
        except PersistError:
            buf = io.BytesIO()
            torch.save(snap.skeleton, buf)
            pickled = buf.getvalue()
            verdict["pickle"] = {"file": f"rank{self.rank}.pkl", "crc32": zlib.crc32(pickled)}
            write_bytes(os.path.join(self.root, f"slot{slot}", verdict["pickle"]["file"]), pickled)

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

    # --- reading back (a restart) ---------------------------------------------------------
    def candidates(self) -> tuple[dict[int, tuple[int, str]], list[str]]:
        """({step: (slot, timeline)} of this rank's slots with a verdict, why the others
        that hold bytes cannot be used). Checksums are checked by :meth:`check`, for the
        one chosen."""
        found: dict[int, tuple[int, str]] = {}
        refused: list[str] = []
        sealed = set()
        every = verdicts(self.root)
        for step, (slot, v) in every.get(self.rank, {}).items():
            sealed.add(slot)
            why = node_refusal(every, step, v, self.node_ranks or [self.rank])
            if int(v["world_size"]) != self.world_size:
                refused.append(
                    f"slot {slot}: step {step} was taken at world size {v['world_size']}, "
                    f"not {self.world_size}"
                )
            elif why is not None:
                refused.append(f"slot {slot}: {why}")
            else:
                found[step] = (slot, str(v.get("timeline")))
        if self.rank not in every and every:
            refused.append(
                f"this node's ring holds slots of ranks {sorted(every)}, not of rank "
                f"{self.rank}: the ranks moved between nodes (torchrun's c10d rendezvous "
                "orders nodes by address: a host with another address reorders them)"
            )
        for slot in sorted(set(range(self.keep)) - sealed):
            d = os.path.join(self.root, f"slot{slot}")
            if os.path.isdir(d) and any(n.startswith(f"rank{self.rank}-") for n in os.listdir(d)):
                refused.append(f"slot {slot}: not sealed (no readable verdict)")
        return found, refused

    def _read_verdict(self, slot: int) -> dict[str, Any]:
        with open(self._verdict(slot), encoding="utf-8") as f:
            v: dict[str, Any] = json.load(f)
        return v

    def check(self, slot: int) -> str | None:
        """Why ``slot`` cannot be used (this rank's bytes, and its share of the node part,
        do not match its verdict), or None."""
        try:
            v = self._read_verdict(slot)
            parts = [(v["file"], int(v["bytes"]), None, list(v["crc32"]), "")]
            if "node" in v:
                node = v["node"]
                parts.append(
                    (node["file"], int(node["bytes"]), node["share"], list(node["crc32"]), "node ")
                )
            for name, want_size, segments, want, what in parts:
                path = os.path.join(self.root, f"slot{slot}", name)
                size = os.path.getsize(path)
                if size < want_size:
                    return f"step {v['step']}: {what}file of {size} bytes, verdict: {want_size}"
                crcs = _crcs(_mapped(path, want_size, shared=False), segments, _check_threads())
                bad = [i for i, (c, w) in enumerate(zip(crcs, want, strict=False)) if c != w]
                if bad or len(crcs) != len(want):
                    at = bad[0] if bad else min(len(crcs), len(want))
                    return (
                        f"step {v['step']}: {what}checksum of piece {at} (of {CHUNK >> 20} MiB) "
                        "does not match its verdict"
                    )
        except (OSError, ValueError, KeyError) as err:
            return f"slot {slot}: {err}"
        return None

    def load(self, slot: int) -> dict[str, Any]:
        """This rank's state from ``slot``: views of private (copy-on-write) mappings of
        its file and of the node part, so nothing is copied until the state is loaded from
        them, and nothing written to them reaches the slot."""
        v = self._read_verdict(slot)
        d = os.path.join(self.root, f"slot{slot}")
        maps = [_mapped(os.path.join(d, v["file"]), int(v["bytes"]), shared=False)]
        if "node" in v:
            maps.append(_mapped(os.path.join(d, v["node"]["file"]), int(v["node"]["bytes"]), False))
        leaves = []
        for off, dtype, shape, in_node in v["leaves"]:
            dt = dtype_of(dtype)
            n = torch.Size(shape).numel() * dt.itemsize
            # A private mapping: the tensors are the restarted process's own (copy on write).
            leaves.append(maps[int(in_node)][off : off + n].view(dt).view(shape))
        if "pickle" in v:
            with open(os.path.join(d, v["pickle"]["file"]), "rb") as f:
                data = f.read()
            if zlib.crc32(data) != int(v["pickle"]["crc32"]):
                raise PersistError(f"slot {slot}: its pickled values do not match their checksum")
            # weights_only, DeepSpeed's few classes allowed: engines/native.py.
            skeleton = load_native(io.BytesIO(data), f"slot {slot}'s pickled values", (Leaf,))
            tree: dict[str, Any] = unflatten(skeleton, lambda leaf: leaves[leaf.index])
            return tree
        tree = decode(v["skeleton"], {p: leaves[i] for p, i in v["paths"].items()})
        return tree

    def close(self, remove: bool) -> None:
        self.join()
        for mapped in (*self._maps, *self._node_maps):
            unregister(mapped)
        self._maps = [None] * self.keep
        self._node_maps = [None] * self.keep
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


def _renamed(path: str, old: str, new: str) -> str:
    """``path`` with its file name's prefix ``old`` replaced by ``new``, renamed so."""
    d, name = os.path.split(path)
    to = os.path.join(d, new + name.removeprefix(old))
    os.rename(path, to)
    return to


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
