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


@dataclass(frozen=True)
class FieldCheck:
    """One field of a record as the reader checks it (compiled once per record class)."""

    name: str
    required: bool
    fits: Callable[[Any], bool]
    to_float: bool  # a JSON int where a float is expected: stored as a float


def build(cls: type[R], details: dict[str, Any]) -> R | None:
    """``details`` as a ``cls``, or None when a field is missing or of another type."""
    values: dict[str, Any] = {}
    for f in _checks(cls):
        if f.name not in details:
            if f.required:
                return None
            continue
        value = details[f.name]
        if not f.fits(value):
            return None
        values[f.name] = float(value) if f.to_float and type(value) is int else value
    return cls(**values)


def misfit(cls: type[Record], details: dict[str, Any]) -> str | None:
    """Why ``details`` do not fit ``cls`` (the first field that does not: its name, what
    was there and what the record expects), or None when :func:`build` takes them: the
    writers' check (``Journal.write``), same checks as ``build`` without building."""
    for f in _checks(cls):
        if f.name not in details:
            if f.required:
                return f"field {f.name!r} is missing (expected {_expected(cls, f.name)})"
            continue
        value = details[f.name]
        if not f.fits(value):
            return (
                f"field {f.name!r} is {value!r:.80} ({type(value).__name__}), expected "
                f"{_expected(cls, f.name)}"
            )
    return None


def _expected(cls: type[Record], name: str) -> str:
    return next(type_name(tp) for f, tp in fields_of(cls) if f.name == name)


def details_of(record: Record, skip_none: bool = False) -> dict[str, Any]:
    """A record's fields as an event's ``details`` (field order), the shape :func:`build`
    reads back; ``skip_none``: leave out the fields that are None (a reader takes an absent
    optional field as None too) rather than write them as null."""
    out = {f.name: getattr(record, f.name) for f, _ in fields_of(type(record))}
    return {k: v for k, v in out.items() if v is not None} if skip_none else out


def type_name(tp: Any) -> str:
    """``int | None`` as "int or null" (a markdown table cell holds no ``|``)."""
    name = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    text = (name or str(tp)).replace("typing.", "").replace("NoneType", "None")
    return text.replace(" | ", " or ").replace("None", "null").replace("Any", "any")


_FIELDS: dict[type[Record], list[tuple[dataclasses.Field[Any], Any]]] = {}
_CHECKS: dict[type[Record], list[FieldCheck]] = {}


def fields_of(cls: type[Record]) -> list[tuple[dataclasses.Field[Any], Any]]:
    """(field, its resolved type) of a record class, in order."""
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = [(f, hints[f.name]) for f in dataclasses.fields(cls)]
    return _FIELDS[cls]


def _checks(cls: type[Record]) -> list[FieldCheck]:
    if cls not in _CHECKS:
        _CHECKS[cls] = [
            FieldCheck(f.name, required(f), checker(tp), _floaty(tp)) for f, tp in fields_of(cls)
        ]
    return _CHECKS[cls]


def is_a(value: Any, tp: type) -> bool:
    """Whether a JSON value is a ``tp`` (an int is a float too; a bool is only a bool)."""
    if isinstance(value, bool):
        return tp is bool
    if tp is float:
        return isinstance(value, (int, float))
    return isinstance(value, tp)


def _floaty(tp: Any) -> bool:
    """Whether ``tp`` is ``float`` or ``float | None`` (a JSON int is stored as a float)."""
    return tp is float or (float in typing.get_args(tp) and int not in typing.get_args(tp))


def checker(tp: Any) -> Callable[[Any], bool]:
    """Whether a JSON value fits the annotation ``tp`` (the few forms records use), as a
    function built once."""
    if tp is Any:
        return lambda v: True
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if len(args) == 2 and type(None) in args:  # X | None, the common case: one test
            (only,) = [checker(t) for t in args if t is not type(None)]
            return lambda v: v is None or only(v)
        alternatives = [checker(t) for t in args]
        return lambda v: any(c(v) for c in alternatives)
    if tp is type(None):
        return lambda v: v is None
    if origin is list:
        (arg,) = typing.get_args(tp)
        if arg is Any:
            return lambda v: isinstance(v, list)
        item = checker(arg)
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        return lambda v: isinstance(v, dict)
    # Parsed JSON holds exactly these types (a bool is not an int here).
    exact = (int, float) if tp is float else (tp,)
    return lambda v: type(v) in exact
