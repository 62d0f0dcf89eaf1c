"""The base of the journal's event records: :class:`Record`, the registry of kinds, and
how a record is built from a line's ``details`` (every field checked against its type).
Torch-free. The package's ``__init__`` says what the protocol promises."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union


@dataclass(frozen=True)
class Record:
    """The typed ``details`` of one event kind (a subclass per kind)."""

    KIND: ClassVar[str] = ""
    WHO: ClassVar[str] = "ranks"  # who writes it: "ranks" or "supervisor"


R = TypeVar("R", bound=Record)
RECORDS: dict[str, type[Record]] = {}


def kind(name: str, who: str = "ranks") -> Callable[[type[R]], type[R]]:
    """Register a record class as the record of the event kind ``name``, written by
    ``who`` (ranks, supervisor)."""

    def register(cls: type[R]) -> type[R]:
        assert name not in RECORDS, f"two records for the event kind {name!r}"
        cls.KIND, cls.WHO = name, who
        RECORDS[name] = cls
        return cls

    return register


def required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def build(cls: type[R], details: dict[str, Any]) -> R | None:
    """``details`` as a ``cls``, or None when a field is missing or of another type."""
    values: dict[str, Any] = {}
    for f, tp in fields_of(cls):
        if f.name not in details:
            if required(f):
                return None  # a required field
            continue
        value = details[f.name]
        if not fits(value, tp):
            return None
        values[f.name] = float(value) if is_a(value, int) and _floaty(tp) else value
    return cls(**values)


_FIELDS: dict[type[Record], list[tuple[dataclasses.Field[Any], Any]]] = {}


def fields_of(cls: type[Record]) -> list[tuple[dataclasses.Field[Any], Any]]:
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = [(f, hints[f.name]) for f in dataclasses.fields(cls)]
    return _FIELDS[cls]


def is_a(value: Any, tp: type) -> bool:
    if isinstance(value, bool):
        return tp is bool
    if tp is float:
        return isinstance(value, (int, float))
    return isinstance(value, tp)


def _floaty(tp: Any) -> bool:
    """Whether ``tp`` is ``float`` or ``float | None`` (a JSON int is stored as a float)."""
    return tp is float or (float in typing.get_args(tp) and int not in typing.get_args(tp))


def fits(value: Any, tp: Any) -> bool:
    """Whether a JSON value fits the annotation ``tp`` (the few forms records use)."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(fits(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(fits(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return is_a(value, tp)
