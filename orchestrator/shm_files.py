"""The files of the shared-memory ring (orchestrator/shm.py): each slot's file of this rank
and its node part, made, sized, mapped and page-locked; those an earlier process left.

:class:`SlotFiles` is a part of :class:`orchestrator.shm.ShmSlots` (its state, declared here).
"""

from __future__ import annotations

import os

import torch

from orchestrator.errors import PersistError
from orchestrator.pinned import register, unregister

ALIGN = 64  # every tensor starts on a cache line (and on any dtype's alignment)
SPARE = "spare-"  # a slot file made at the first capture, before the slot's first use


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _mapped(path: str, size: int, shared: bool) -> torch.Tensor:
    return torch.from_file(path, shared=shared, size=size, dtype=torch.uint8)


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


class SlotFiles:
    """The slot files of :class:`orchestrator.shm.ShmSlots`."""

    root: str
    rank: int
    token: str
    _maps: list[torch.Tensor | None]
    _files: list[str | None]
    _node_maps: list[torch.Tensor | None]
    _node_files: list[str | None]
    _gen: int
    _node_gen: int
    _unused: set[tuple[int, bool]]
    _unused_next: set[tuple[int, bool]]
    _made_root: bool

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
        path, old = self._fresh_path(slot, node)
        self._map_new(slot, node, path, old, total, pin)
        return offsets

    def _fresh_path(self, slot: int, node: bool) -> tuple[str, str | None]:
        """The path of ``slot``'s next file (``node``: its node part's) and of the one it
        replaces; at a slot's first file, removes the ones an earlier process left."""
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
        return path, old

    def _map_new(
        self, slot: int, node: bool, path: str, old: str | None, total: int, pin: bool
    ) -> None:
        """Create ``path`` (``total`` bytes, reserved), map it as ``slot``'s file (with
        ``pin``: page-locked) and unlink the file it replaces, ``old``."""
        files = self._node_files if node else self._files
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
