"""The engine registry: which adapter the Guard builds for what the user gave it.

An engine is registered by name with a builder (an :class:`Engine` subclass, built by its
``from_args``, or a factory taking :class:`EngineArgs`) and, optionally, a predicate saying
whether it handles those objects. ``Guard(engine="name", model=..., optimizer=...)`` picks a
registered engine by name. Otherwise the predicates choose, the most recently registered
first: the built-ins register first (torch, fsdp2, fsdp1, deepspeed, so DeepSpeed is asked
first and plain PyTorch, which takes any model, last), and a user's engine with a predicate
is asked before any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orchestrator.errors import UsageError

if TYPE_CHECKING:
    from orchestrator.engines.base import Engine


@dataclass(frozen=True)
class EngineArgs:
    """What the user gave the Guard, as an engine's builder and predicate see it."""

    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    #: The framework's own engine object (what ``deepspeed.initialize`` returned), never a
    #: name: ``Guard(engine="name")`` chooses by name and leaves this None.
    engine: Any = None
    #: Micro-batches per optimizer step (None: the user did not say; builders use 1).
    grad_accum_steps: int | None = None


Builder = Callable[[EngineArgs], "Engine"]
Predicate = Callable[[EngineArgs], bool]


@dataclass(frozen=True)
class _Entry:
    build: Builder
    matches: Predicate | None


_ENGINES: dict[str, _Entry] = {}  # by name, in registration order


def register_engine(
    name: str,
    engine: type[Engine] | Builder,
    *,
    matches: Predicate | None = None,
    replace: bool = False,
) -> None:
    """Make an engine available to the Guard under ``name``.

    Args:
        name: what ``Guard(engine=name)`` chooses it by.
        engine: an :class:`Engine` subclass (built by its ``from_args(args)``; a subclass of
            ``TorchEngine`` takes model, optimizer, scheduler and scaler), or a factory
            taking :class:`EngineArgs` and returning an engine.
        matches: optional; given the Guard's arguments, whether this engine handles them
            when the Guard is not told an engine's name (asked before the engines
            registered earlier).
        replace: register over an engine of that name (in its place in the order)
            instead of refusing.

    Raises:
        UsageError: the name is taken (and not ``replace``), or ``engine`` is neither an
            Engine subclass nor callable.
    """
    from orchestrator.engines.base import Engine

    if not isinstance(name, str) or not name:
        raise UsageError(f"register_engine({name!r}, ...): the name must be a non-empty string")
    if name in _ENGINES and not replace:
        raise UsageError(
            f"register_engine({name!r}, ...): an engine of that name is registered already; "
            "choose another name, or pass replace=True to replace it"
        )
    if isinstance(engine, type) and issubclass(engine, Engine):
        build: Builder = engine.from_args
    elif callable(engine) and not isinstance(engine, type):
        build = engine
    else:
        raise UsageError(
            f"register_engine({name!r}, {engine!r}): takes a subclass of "
            "orchestrator.engines.Engine or a factory taking EngineArgs"
        )
    # A replaced engine keeps its place in the order (replacing "torch" must not put it
    # before FSDP and DeepSpeed).
    _ENGINES[name] = _Entry(build, matches)


def unregister_engine(name: str) -> None:
    """Forget the engine registered as ``name``.

    Raises:
        UsageError: no engine is registered by that name.
    """
    if name not in _ENGINES:
        raise UsageError(
            f"unregister_engine({name!r}): no engine is registered by that name; registered: "
            f"{', '.join(sorted(_ENGINES))}"
        )
    del _ENGINES[name]


def registered_engines() -> list[str]:
    """The registered engines' names, in registration order."""
    return list(_ENGINES)


def build_engine(args: EngineArgs, name: str | None = None) -> Engine:
    """The engine called ``name``, or the first whose predicate takes ``args``.

    Raises:
        UsageError: no engine of that name (the registered ones are listed), or none
            handles ``args``.
    """
    if name is not None:
        entry = _ENGINES.get(name)
        if entry is None:
            raise UsageError(
                f"Guard(engine={name!r}): no engine is registered by that name; registered: "
                f"{', '.join(sorted(_ENGINES))} (orchestrator.engines.register_engine adds one)"
            )
        return _built(name, entry.build(args))
    for key, entry in reversed(_ENGINES.items()):
        if entry.matches is not None and entry.matches(args):
            return _built(key, entry.build(args))
    if args.engine is not None:
        raise UsageError(
            f"Guard(engine=...) takes the engine deepspeed.initialize returned, or the name of "
            f"a registered engine ({', '.join(sorted(_ENGINES))}), not a "
            f"{type(args.engine).__name__}; pass torch objects as model=/optimizer="
        )
    raise UsageError("Guard needs model= and optimizer= (or engine= for DeepSpeed)")


def _built(name: str, engine: Any) -> Engine:
    from orchestrator.engines.base import Engine

    if not isinstance(engine, Engine):
        raise UsageError(
            f"the engine registered as {name!r} built a {type(engine).__name__}, not an "
            "orchestrator.engines.Engine: its factory must return one"
        )
    return engine
