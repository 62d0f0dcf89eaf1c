"""The base of every policy section's model, and the ``every_steps: auto`` reading
the snapshot and persist sections share.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    # No inf or nan: a duration of .inf or .nan would silently disable what it bounds.
    # Frozen: a loaded policy never changes (what the tuner changes is in tuning.Intervals).
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, allow_inf_nan=False, frozen=True
    )


def _auto(data: Any, placeholder: int) -> Any:
    """``every_steps: auto`` in YAML becomes ``auto_every_steps: true`` and a placeholder
    interval, replaced at start by tune.initial_*."""
    if isinstance(data, dict) and data.get("every_steps") == "auto":
        data = {**data, "every_steps": placeholder, "auto_every_steps": True}
    return data


def _int_or_auto(cls: Any, value: Any) -> Any:
    """``every_steps`` (after :func:`_auto`): an integer, said so with ``auto`` named."""
    if isinstance(value, str) and not value.strip().isdigit():  # "10" still reads as 10
        raise ValueError(f"{value!r} is neither an integer nor auto")
    return value
