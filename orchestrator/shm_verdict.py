"""The verdicts of the shared-memory ring (orchestrator/shm.py): a sealed slot's verdict
(layout, plain values, CRC32 of its bytes, written on a thread), and reading back at a
restart: which slots are candidates, whether their bytes match, the state they hold.

:class:`SlotVerdicts` is a part of :class:`orchestrator.shm.ShmSlots` (its state, declared
here).
"""

from __future__ import annotations

import io
import json
import os
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from orchestrator.codec import decode, dtype_of, encode
from orchestrator.engines.native import load_native
from orchestrator.errors import PersistError
from orchestrator.rundir import write_atomic, write_bytes
from orchestrator.shm_files import _mapped
from orchestrator.shm_index import node_refusal, verdicts
from orchestrator.snapshot import Leaf, Snapshot, unflatten

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


class SlotVerdicts:
    """The verdicts of :class:`orchestrator.shm.ShmSlots`."""

    root: str
    rank: int
    world_size: int
    keep: int
    attempt: int
    node_ranks: list[int] | None
    _maps: list[torch.Tensor | None]
    _files: list[str | None]
    _node_maps: list[torch.Tensor | None]
    _node_files: list[str | None]
    _in_node: list[list[bool]]
    _share: list[list[list[int]]]
    _sealing: dict[int, tuple[threading.Thread, threading.Event]]

    def _verdict(self, slot: int) -> str:
        raise NotImplementedError  # ShmSlots': the path of the slot's verdict

    def join(self, slot: int | None = None, cancel: bool = False) -> None:
        raise NotImplementedError  # ShmSlots': wait for the slot's verdict writer

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
        verdict = self._sealed(snap, plan, checked_through, rollbacks)
        mapped, node_map = self._maps[slot], self._node_maps[slot]
        assert mapped is not None  # (_sealed asserts it)

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

    def _sealed(
        self, snap: Snapshot, plan: dict[str, Any], checked_through: int | None, rollbacks: int
    ) -> dict[str, Any]:
        """The verdict of the sealed ``snap``, but for its values and checksums."""
        slot = snap.slot
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
        return verdict

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
