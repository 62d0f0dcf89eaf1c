"""The user's own stateful objects in every snapshot: an EMA of the weights, a counter, a
``best_val_loss`` holder; anything with ``state_dict()`` and ``load_state_dict(state)``, as
torch.distributed.checkpoint's ``Stateful``.

Their states ride under the snapshot key ``user`` (``{name: obj.state_dict()}``) through the
path the engine's state takes: copied into the host ring (tensors into host buffers, plain
values deep-copied, so a later in-place update of the live object cannot change a
snapshot), kept in shared-memory slots, persisted to the durable tier as a rank-local key
(each rank writes its own objects' state: they may differ between ranks), and loaded back
with ``load_state_dict`` on a rollback together with the model and on resume. A snapshot
without the key (one written before any object was registered, or by an older version)
leaves the objects as they are.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor

from orchestrator.errors import UsageError
from orchestrator.snapshot import Snapshot

logger = logging.getLogger(__name__)

#: The top-level snapshot key of the user's objects' states (absent when none is registered).
USER_KEY = "user"


@runtime_checkable
class Stateful(Protocol):
    """What the Guard needs of an object to keep it in snapshots."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


class UserState:
    """The registry of the user's objects, by name. Registration closes at the first use
    (the first snapshot or the resume, both at the first ``guard.batches``): every
    snapshot must hold every object, or a rollback would restore some and not others."""

    def __init__(self) -> None:
        self._objects: dict[str, Stateful] = {}
        self._open = True

    def __len__(self) -> int:
        return len(self._objects)

    def register(self, name: str, obj: Any) -> None:
        """Add ``obj`` under ``name``.

        Raises:
            UsageError: registration is closed, the name is taken or not a non-empty
                string, the object lacks ``state_dict``/``load_state_dict``, or its state
                holds a value a durable snapshot cannot store.
        """
        where = f"register_state({name!r}, <{type(obj).__name__}>)"
        if not self._open:
            raise UsageError(
                f"{where}: the first snapshot was already taken (at the first guard.batches), "
                "so earlier snapshots would not hold it; register every object before that, "
                "with Guard(state={...}) or guard.register_state"
            )
        if not isinstance(name, str) or not name:
            raise UsageError(f"{where}: the name must be a non-empty string")
        needs = ("state_dict", "load_state_dict")
        missing = [m for m in needs if not callable(getattr(obj, m, None))]
        if missing:
            raise UsageError(
                f"{where}: a {type(obj).__name__} has no {' and no '.join(missing)} method. "
                "The Guard saves obj.state_dict() in every snapshot and restores it with "
                "obj.load_state_dict(state) (torch.distributed.checkpoint's Stateful); give "
                "the object both, or wrap it in a small class that has them"
            )
        if name in self._objects:
            raise UsageError(
                f"{where}: the name {name!r} is taken by a {type(self._objects[name]).__name__}; "
                "give each object its own name"
            )
        _check_plain(obj.state_dict(), f"{name}.state_dict()", where)
        self._objects[name] = obj

    def nbytes(self) -> int:
        """The bytes of the tensors in every object's state (what each snapshot copies of
        them; the plain values are small): the host-memory budget of the ring counts them
        with the engine's state. Does not close the registration."""
        states = [obj.state_dict() for obj in self._objects.values()]
        return sum(t.numel() * t.element_size() for t in tensors_in(states))

    def state(self) -> dict[str, Any] | None:
        """References (not copies) to every object's state, for a snapshot; None when no
        object is registered (the snapshot then has no ``user`` key, as before)."""
        self._open = False
        if not self._objects:
            return None
        return {name: obj.state_dict() for name, obj in self._objects.items()}

    def restore(self, snap: Snapshot) -> None:
        """Load every object's state from ``snap`` (host copies on the devices they came
        from: an object may keep what it is given). Objects the snapshot has no state for
        keep theirs, said in a warning."""
        self._open = False
        if not self._objects:
            return
        saved = snap.materialize(USER_KEY, clone=True) if USER_KEY in snap.skeleton else {}
        for name, obj in self._objects.items():
            if name in saved:
                obj.load_state_dict(saved[name])
        missing = sorted(set(self._objects) - set(saved))
        if missing:
            logger.warning(
                "the snapshot of step %d holds no state for %s (taken before they were "
                "registered): they keep their current state",
                snap.step,
                ", ".join(missing),
            )


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of a state tree (dicts, lists and tuples of them)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors_in(v)]
    return []


def _check_plain(value: Any, path: str, where: str) -> None:
    """Refuse at registration what a durable snapshot could not store (orchestrator/codec.py:
    tensors and JSON values in dicts, lists and tuples), naming the entry."""
    if isinstance(value, DTensor):
        raise UsageError(
            f"{where}: {path} is a DTensor; a snapshot holds this rank's own tensors: keep "
            "the local shard in the object's state (t.to_local()) and rebuild the DTensor in "
            "load_state_dict if it needs one"
        )
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            _check_plain(v, f"{path}[{k!r}]", where)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{path}[{i}]", where)
        return
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return
    raise UsageError(
        f"{where}: {path} is a {type(value).__name__}, which a durable snapshot cannot store; "
        "return tensors, numbers, strings, None and dicts/lists of them from state_dict()"
    )
