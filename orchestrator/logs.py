"""Rank-aware logging: every record of the library says which rank (and step) wrote it.

The library never installs handlers (entry points do); it logs through ``logging`` with
this adapter, so a 2,000-rank job's interleaved output can be read back per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # generic in the stubs; subscriptable at run time only from Python 3.11
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:
    _Adapter = logging.LoggerAdapter


class RankLogger(_Adapter):
    """Prefixes each message with ``[rank R step S]`` and puts ``rank`` (and ``step``) in
    the record's attributes for handlers that format them."""

    def __init__(
        self, logger: logging.Logger, rank: int, step: Callable[[], int] | None = None
    ) -> None:
        super().__init__(logger, {"rank": rank})
        self._rank, self._step = rank, step

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        extra = {"rank": self._rank}
        where = f"[rank {self._rank}"
        if self._step is not None:
            extra["step"] = self._step()
            where += f" step {extra['step']}"
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        return f"{where}] {msg}", kwargs
