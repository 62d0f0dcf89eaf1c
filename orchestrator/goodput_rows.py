"""One attempt's metrics rows as the goodput ledger (orchestrator/goodput.py) keeps them:
a few arrays in time order, so a long run's ledger stays cheap."""

from __future__ import annotations

import bisect
import math
from array import array
from typing import Any


class Rows:
    """One attempt's metrics rows, as compact arrays in time order (a long run's too)."""

    def __init__(self) -> None:
        self.times = array("d")
        self.steps = array("q")
        self.step_s = array("d")  # nan: not known (the first row after a restart)
        self.check = array("d")
        self.writing = array("i")  # steps of the row with a durable write in flight

    def add(self, row: dict[str, Any]) -> None:
        self.times.append(float(row["time"]))
        self.steps.append(int(row["step"]))
        self.step_s.append(float(row["step_s"]) if row.get("step_s") is not None else math.nan)
        self.check.append(float(row.get("check_s") or 0.0))
        self.writing.append(int(row.get("writing") or 0))

    def __len__(self) -> int:
        return len(self.times)

    def span(self, t0: float, t1: float) -> range:
        return range(bisect.bisect_left(self.times, t0), bisect.bisect_right(self.times, t1))

    def window(self, t0: float, t1: float) -> Rows:
        """The rows within [t0, t1] (a copy)."""
        r, out = self.span(t0, t1), Rows()
        for name in ("times", "steps", "step_s", "check", "writing"):
            getattr(out, name).extend(getattr(self, name)[r.start : r.stop])
        return out


__all__ = ["Rows"]
