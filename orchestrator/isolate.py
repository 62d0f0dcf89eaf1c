"""Isolation: which samples of a bad step reproduce its non-finite value.

The Guard re-runs sub-batches of the bad step through the user's own loop (``guard.batches``
yields them, ``guard.step`` reports each one's verdict), all ranks in lockstep: a rank with
nothing left to test runs a filler sub-batch, so collectives inside the model or the loop
stay matched. Cost: about 2 log2(batch) re-runs for one culprit, none on a healthy step.
"""

from __future__ import annotations

from typing import Any


class Bisection:
    """Adaptive group testing over one rank's suspect samples.

    A bad group is split in halves; a bad singleton is a culprit; a bad group whose halves
    are both clean (the samples only fail together) is quarantined whole.
    """

    def __init__(
        self, suspects: list[int], filler: list[int], split: bool = True, cap: int | None = None
    ) -> None:
        self.queue: list[tuple[list[int], dict[str, Any] | None]] = (
            [(suspects, None)] if suspects else []
        )
        self.filler = filler
        self.split = split  # False: only re-run the whole step; if it fails, all of it
        self.culprits: list[int] = []
        self.reproduced = False
        self.current: tuple[list[int], dict[str, Any] | None] | None = None
        # ``cap``: stop once more than this many culprits are certain (each bad group not
        # yet resolved holds at least one): a step bad on most of its samples is not the
        # data's doing, and bisecting it down to every sample would re-run all of them.
        self.cap = cap
        self.exceeded = False
        self._open: set[int] = set()  # ids of the bad groups with no bad part found yet

    def next_group(self) -> list[int]:
        self.current = self.queue.pop(0) if self.queue else None
        return self.current[0] if self.current is not None else self.filler

    def record(self, bad: bool) -> None:
        if self.current is None:
            return  # a filler pass, run only to keep the ranks in lockstep
        ids, parent = self.current
        if parent is None:
            self.reproduced = bad
        if bad and parent is not None:
            self._open.discard(id(parent))  # a bad part stands for it now
        if bad and (len(ids) == 1 or not self.split):
            self.culprits += ids
        elif bad:
            node = {"ids": ids, "pending": 2, "bad": 0}
            half = len(ids) // 2
            self.queue += [(ids[:half], node), (ids[half:], node)]
            self._open.add(id(node))
        if parent is not None:
            parent["pending"] -= 1
            parent["bad"] += int(bad)
            if parent["pending"] == 0 and parent["bad"] == 0:
                self.culprits += parent["ids"]
                self._open.discard(id(parent))
        if self.cap is not None and len(self.culprits) + len(self._open) > self.cap:
            self.exceeded, self.queue = True, []

    @property
    def pending(self) -> bool:
        return bool(self.queue)
