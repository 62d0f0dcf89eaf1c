"""``Value``: one value kept in every snapshot (nanoGPT's ``best_val_loss``, a token count).

Torch-free, so ``orchestrator`` exports it without loading torch.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["Value"]

T = TypeVar("T")


class Value(Generic[T]):
    """A holder of one value with ``state_dict``/``load_state_dict``, for
    ``guard.register_state``: a rollback or a resume sets ``.value`` back to what it was at
    the snapshot.

    The value must be what a snapshot stores: a number, string, bool, None, tensor, or a
    dict or list of them (checked at registration). Change it on committed steps only.

    Usage::

        best_val_loss = Value(1e9)
        guard.register_state("best_val_loss", best_val_loss)
        ...
        if guard.step() == "commit" and guard.global_step % eval_interval == 0:
            best_val_loss.value = min(best_val_loss.value, estimate_loss())
    """

    def __init__(self, value: T) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]

    def __repr__(self) -> str:
        return f"Value({self.value!r})"
