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
from typing import Any

import torch

from orchestrator.codec import decode, dtype_of, encode
from orchestrator.errors import PersistError
from orchestrator.rundir import write_atomic, write_bytes
from orchestrator.snapshot import Snapshot, unflatten

ALIGN = 64  # every tensor starts on a cache line (and on any dtype's alignment)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _crc(buf: torch.Tensor) -> int:
    return zlib.crc32(buf.numpy().data)


def _mapped(path: str, size: int, shared: bool) -> torch.Tensor:
    return torch.from_file(path, shared=shared, size=size, dtype=torch.uint8)


def agreeable(
    seen: list[tuple[dict[int, str], list[str]]], newest_durable: int
) -> tuple[list[int], list[str]]:
    """From every rank's ({step: timeline}, refusals): the steps a restart may try, newest
    first (sealed on every rank, all from one timeline, not older than the newest durable
    snapshot), and why the others were refused, by rank."""
    refused = [f"rank {r}: {why}" for r, (_, said) in enumerate(seen) for why in said]
    order = []
    for step in sorted(set.intersection(*(set(s) for s, _ in seen)), reverse=True):
        if step < newest_durable:
            break
        timelines = sorted({s[step] for s, _ in seen})
        if len(timelines) > 1:
            refused.append(
                f"step {step}: the ranks' slots come from different attempts or rollbacks "
                f"({', '.join(timelines)})"
            )
            continue
        order.append(step)
    return order, refused


def verdicts(root: str) -> dict[int, dict[int, tuple[int, dict[str, Any]]]]:
    """Every rank's verdicts in ``root``: rank -> step -> (slot, verdict)."""
    out: dict[int, dict[int, tuple[int, dict[str, Any]]]] = {}
    for d in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        if not d.startswith("slot"):
            continue
        for name in os.listdir(os.path.join(root, d)):
            if not (name.startswith("rank") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(root, d, name), encoding="utf-8") as f:
                    v = json.load(f)
            except (OSError, ValueError):
                continue  # withdrawn or being replaced
            out.setdefault(int(v["rank"]), {})[int(v["step"])] = (int(d.removeprefix("slot")), v)
    return out


class ShmSlots:
    """One rank's ring slots in ``root``: the ring's buffers, verdicts, reading back."""

    def __init__(self, root: str, rank: int, world_size: int, keep: int, attempt: int) -> None:
        self.root, self.rank, self.keep, self.attempt = root, rank, keep, attempt
        self.world_size = world_size
        self._maps: list[torch.Tensor | None] = [None] * keep  # each slot's mapped bytes
        self._files: list[str | None] = [None] * keep
        self._gen = 0
        self._sealing: dict[int, threading.Thread] = {}  # slot -> its verdict being written

    def _verdict(self, slot: int) -> str:
        return os.path.join(self.root, f"slot{slot}", f"rank{self.rank}.json")

    # --- the ring's buffers ----------------------------------------------------------------
    def alloc(
        self, slot: int, leaves: list[torch.Tensor], reuse: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Buffers shaped like ``leaves`` in ``slot``'s file: ``reuse`` (the slot's last
        buffers, [] when they may not be written) when they fit, else views of a new file.
        The slot's verdict goes first: from here until it is sealed again, its bytes are
        not a snapshot."""
        self.join(slot)  # its checksum may still be reading it (others' may run on)
        self.drop(slot)
        if len(reuse) == len(leaves) and all(
            b.shape == t.shape and b.dtype == t.dtype for b, t in zip(reuse, leaves, strict=True)
        ):
            return reuse
        sizes = [t.numel() * t.element_size() for t in leaves]
        total = sum(_aligned(n) for n in sizes) or ALIGN
        old = self._files[slot]
        d = os.path.join(self.root, f"slot{slot}")
        os.makedirs(d, exist_ok=True)
        if old is None:  # what an earlier process of this rank left in the slot
            for name in os.listdir(d):
                if name.startswith(f"rank{self.rank}-") and name.endswith(".bin"):
                    os.unlink(os.path.join(d, name))
        self._gen += 1
        path = os.path.join(d, f"rank{self.rank}-{self._gen}.bin")
        with open(path, "wb") as f:  # sized first: from_file maps exactly that
            try:
                # Reserved now: a full tmpfs would otherwise kill the training thread with
                # SIGBUS at its first write into the mapping.
                os.posix_fallocate(f.fileno(), 0, total)
            except OSError as err:
                f.close()
                os.unlink(path)
                raise PersistError(
                    f"snapshot.shared_memory: no room for a {total / 2**20:.2f} MiB ring slot "
                    f"of rank {self.rank} under {self.root} ({err.strerror}). Free or enlarge "
                    f"{os.path.dirname(self.root)} (`df -h {os.path.dirname(self.root)}`), "
                    "lower snapshot.keep, or set snapshot.shared_memory: false"
                ) from err
        mapped = _mapped(path, total, shared=True)
        self._maps[slot], self._files[slot] = mapped, path
        if old is not None:  # its mapping (a persisting reader's) lives on until dropped
            os.unlink(old)
        out, at = [], 0
        for t, n in zip(leaves, sizes, strict=True):
            out.append(mapped[at : at + n].view(t.dtype).view(t.shape))
            at += _aligned(n)
        return out

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
        assert mapped is not None and path is not None, "a snapshot not in shared memory"
        base = mapped.data_ptr()
        verdict: dict[str, Any] = {
            "step": snap.step,
            "attempt": self.attempt,
            "rank": self.rank,
            "world_size": self.world_size,
            "file": os.path.basename(path),
            "bytes": mapped.numel(),
            # Every tensor of the snapshot (by its index in the ring's list): where it is.
            "leaves": [[b.data_ptr() - base, str(b.dtype), list(b.shape)] for b in snap.buffers],
            "persist": plan,
            "sealed": True,  # the steps after it checked finite (through ``checked_through``)
            "checked_through": checked_through,
            # Which timeline: a rank's slot left on this node by an earlier attempt (ranks
            # may land on other nodes after a rendezvous) or before a rollback of this one
            # is never mixed with the other ranks' slots of the same step.
            "timeline": f"{self.attempt}-{rollbacks}",
        }

        def run() -> None:  # off the training thread; alloc() joins it before reusing the slot
            try:
                self._values(snap, verdict, slot)
                verdict["crc32"] = _crc(mapped)
                write_atomic(self._verdict(slot), json.dumps(verdict))
            except Exception as err:  # the slot stays without a verdict: never used
                on_error(err)

        t = threading.Thread(target=run, name="orchestrator-shm-seal", daemon=True)
        t.start()
        self._sealing[slot] = t

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
        try:
            os.unlink(self._verdict(slot))
        except FileNotFoundError:
            pass

    def join(self, slot: int | None = None) -> None:
        """Wait for the verdict of ``slot`` (None: of every slot) to be written."""
        for s in [slot] if slot is not None else list(self._sealing):
            t = self._sealing.pop(s, None)
            if t is not None:
                t.join()

    def corrupt(self, snap: Snapshot | None) -> None:
        """The ``corrupt_shm`` fault: flip bytes in the middle of ``snap``'s slot after its
        verdict is written (the in-process ring shares them: a test fault, not a drill)."""
        self.join()
        mapped = self._maps[snap.slot] if snap is not None else None
        if mapped is not None:
            mid = mapped.numel() // 2
            mapped[mid : mid + 8] ^= 0xFF

    # --- reading back (a restart) ---------------------------------------------------------
    def candidates(self) -> tuple[dict[int, tuple[int, str]], list[str]]:
        """({step: (slot, timeline)} of this rank's slots with a verdict, why the others
        that hold bytes cannot be used). Checksums are checked by :meth:`check`, for the
        one chosen."""
        found: dict[int, tuple[int, str]] = {}
        refused: list[str] = []
        sealed = set()
        for step, (slot, v) in verdicts(self.root).get(self.rank, {}).items():
            sealed.add(slot)
            if int(v["world_size"]) != self.world_size:
                refused.append(
                    f"slot {slot}: step {step} was taken at world size {v['world_size']}, "
                    f"not {self.world_size}"
                )
            else:
                found[step] = (slot, str(v.get("timeline")))
        for slot in sorted(set(range(self.keep)) - sealed):
            d = os.path.join(self.root, f"slot{slot}")
            if os.path.isdir(d) and any(n.startswith(f"rank{self.rank}-") for n in os.listdir(d)):
                refused.append(f"slot {slot}: not sealed (no readable verdict)")
        return found, refused

    def check(self, slot: int) -> str | None:
        """Why ``slot`` cannot be used (its bytes do not match its verdict), or None."""
        try:
            with open(self._verdict(slot), encoding="utf-8") as f:
                v = json.load(f)
            path = os.path.join(self.root, f"slot{slot}", v["file"])
            size = os.path.getsize(path)
            if size != int(v["bytes"]):
                return f"step {v['step']}: {size} bytes, its verdict says {v['bytes']}"
            crc, want = _crc(_mapped(path, size, shared=False)), int(v["crc32"])
            if crc != want:
                return f"step {v['step']}: checksum {crc:#010x}, its verdict says {want:#010x}"
        except (OSError, ValueError, KeyError) as err:
            return f"slot {slot}: {err}"
        return None

    def load(self, slot: int) -> dict[str, Any]:
        """This rank's state from ``slot``: views of a private (copy-on-write) mapping of
        its file, so nothing is copied until the state is loaded from them, and nothing
        written to them reaches the slot."""
        with open(self._verdict(slot), encoding="utf-8") as f:
            v = json.load(f)
        path = os.path.join(self.root, f"slot{slot}", v["file"])
        mapped = _mapped(path, int(v["bytes"]), shared=False)
        leaves = []
        for off, dtype, shape in v["leaves"]:
            dt = dtype_of(dtype)
            n = torch.Size(shape).numel() * dt.itemsize
            # A private mapping: the tensors are the restarted process's own (copy on write).
            leaves.append(mapped[off : off + n].view(dt).view(shape))
        if "pickle" in v:
            with open(os.path.join(self.root, f"slot{slot}", v["pickle"]["file"]), "rb") as f:
                data = f.read()
            if zlib.crc32(data) != int(v["pickle"]["crc32"]):
                raise PersistError(f"slot {slot}: its pickled values do not match their checksum")
            # Checksummed above, written by this run on this node (see engines/native.py).
            skeleton = torch.load(io.BytesIO(data), weights_only=False)
            tree: dict[str, Any] = unflatten(skeleton, lambda leaf: leaves[leaf.index])
            return tree
        tree = decode(v["skeleton"], {p: leaves[i] for p, i in v["paths"].items()})
        return tree

    def close(self, remove: bool) -> None:
        self.join()
        self._maps = [None] * self.keep
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
