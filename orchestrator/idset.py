"""The quarantined sample ids: single ids and half-open id ranges, as sorted disjoint intervals.

A bad token in a stream of token windows (orchestrator/samplers.py) poisons every window
that holds it, so the Guard quarantines a range of window ids at once; a range of
``2 * block_size + 1`` ids kept as a ``set[int]`` would cost a hash entry per id and a
ledger line per id. :class:`IdSet` keeps ``[lo, hi)`` intervals, merged on add (adjacent
ones too), so a membership test is one bisect and a range costs two integers. It is a
``MutableSet[int]``: ``in``, ``len`` (ids, not intervals), iteration in order, ``|=``,
equality with a ``set`` keep working for the callers that took a ``set[int]``.
"""

from __future__ import annotations

import heapq
import operator
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, MutableSet

import torch

__all__ = ["IdSet"]


class IdSet(MutableSet[int]):
    """Sample ids as sorted, disjoint, non-adjacent half-open intervals ``[lo, hi)``.

    Args:
        ids: single ids to start with.
        ranges: ``(lo, hi)`` pairs to start with, each the ids ``lo .. hi - 1``.
    """

    def __init__(self, ids: Iterable[int] = (), ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._lo: list[int] = []
        self._hi: list[int] = []
        self._len = 0
        self._merge(sorted((int(lo), int(hi)) for lo, hi in ranges if lo < hi))
        self.update(ids)

    # --- MutableSet -----------------------------------------------------------------------
    def __contains__(self, x: object) -> bool:
        if not isinstance(x, int):
            if not hasattr(x, "__index__"):
                return False
            x = operator.index(x)  # numpy's integers too, as a set of ints would find them
        i = bisect_right(self._lo, x) - 1
        return i >= 0 and x < self._hi[i]

    def __iter__(self) -> Iterator[int]:
        for lo, hi in zip(self._lo, self._hi, strict=True):
            yield from range(lo, hi)

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"IdSet(ranges={self.ranges()})"

    def add(self, value: int) -> None:
        self.add_range(int(value), int(value) + 1)

    def discard(self, value: int) -> None:
        x = int(value)
        if x not in self:
            return
        i = bisect_right(self._lo, x) - 1
        lo, hi = self._lo[i], self._hi[i]
        del self._lo[i], self._hi[i]
        self._len -= hi - lo
        for a, b in ((x + 1, hi), (lo, x)):  # the right part first: inserted at i, in order
            if a < b:
                self._lo.insert(i, a)
                self._hi.insert(i, b)
                self._len += b - a

    def __ior__(self, other: Iterable[int]) -> IdSet:  # type: ignore[override,misc]
        self.update(other)  # another IdSet's ranges stay ranges
        return self

    # --- ranges ---------------------------------------------------------------------------
    def add_range(self, lo: int, hi: int) -> None:
        """Add the ids ``lo .. hi - 1``, merged with the intervals it overlaps or touches."""
        lo, hi = int(lo), int(hi)
        if lo >= hi:
            return
        first = bisect_left(self._hi, lo)  # the first interval ending at or after lo
        last = bisect_right(self._lo, hi)  # past the last one starting at or before hi
        if first < last:
            lo, hi = min(lo, self._lo[first]), max(hi, self._hi[last - 1])
            gone = zip(self._lo[first:last], self._hi[first:last], strict=True)
            self._len -= sum(b - a for a, b in gone)
        self._lo[first:last] = [lo]
        self._hi[first:last] = [hi]
        self._len += hi - lo

    def update(self, ids: Iterable[int]) -> None:
        """Add ``ids``: single ids, or another IdSet's intervals (never expanded). One
        merge of sorted runs, so a ledger of many single ids loads in O(n log n)."""
        if isinstance(ids, IdSet):
            new = ids.ranges()
        else:
            new = []
            for x in sorted({int(x) for x in ids}):
                if new and new[-1][1] == x:
                    new[-1] = (new[-1][0], x + 1)
                else:
                    new.append((x, x + 1))
        self._merge(new)

    def _merge(self, new: list[tuple[int, int]]) -> None:
        """Add non-empty intervals sorted by their start (one pass; one: a bisect)."""
        if len(new) <= 1:
            for lo, hi in new:
                self.add_range(lo, hi)
            return
        los: list[int] = []
        his: list[int] = []
        for lo, hi in heapq.merge(self.ranges(), new):
            if los and lo <= his[-1]:  # overlapping or adjacent: one interval
                his[-1] = max(his[-1], hi)
            else:
                los.append(lo)
                his.append(hi)
        self._lo, self._hi = los, his
        self._len = sum(b - a for a, b in zip(los, his, strict=True))

    def ranges(self) -> list[tuple[int, int]]:
        """The intervals ``(lo, hi)``, in order."""
        return list(zip(self._lo, self._hi, strict=True))

    def count_in(self, lo: int, hi: int) -> int:
        """How many ids lie in ``lo .. hi - 1``."""
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in self.ranges())

    def copy(self) -> IdSet:
        out = IdSet()
        out._lo, out._hi, out._len = list(self._lo), list(self._hi), self._len
        return out

    def mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` (an int64 tensor) are in the set, as a bool tensor."""
        if not self._lo:
            return torch.zeros_like(ids, dtype=torch.bool)
        lo = torch.tensor(self._lo, dtype=torch.int64)
        hi = torch.tensor(self._hi, dtype=torch.int64)
        i = torch.searchsorted(lo, ids, right=True) - 1  # the interval starting at or before
        inside = ids < hi[i.clamp(min=0)]
        return inside & (i >= 0)
