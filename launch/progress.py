"""Hang judgement: how long each rank of this node has made no progress, on this host's
monotonic clock, never on the wall clock (an NTP step or a VM's clock set after a pause
moves ``time.time()`` in every process at once; the supervisor killed ranks that were
making progress).

A rank's beat says when it last moved on its host's ``CLOCK_MONOTONIC``, which every
process of one boot of a host shares (``clock`` names it): when it is the supervisor's
clock, the age is exact. A beat on another clock (or from before beats carried one) is
judged by change: its progress is as old as the time since the supervisor, on its own
clock, saw it change. Other nodes' supervisors judge their own ranks; several nodes agree
through their supervisors' files, read the same way (launch/nodes.py).

And the supervisor itself may not have run for a while (a paused VM whose clocks all jump,
the supervisor stopped): a gap between its looks longer than ``pause_s`` restarts every
rank's clock from the moment it looks again, so that ranks about to beat are not killed for
time nobody ran. The supervisor restarts them too while the run directory refuses its own
writes (read-only, I/O errors): the beats cannot be written then, and silence is no hang.
"""

from __future__ import annotations

from typing import Any


class Stalls:
    """Ages of the ranks' progress in one attempt (a pure function of what it is shown)."""

    def __init__(self, clock: str, pause_s: float) -> None:
        self.clock = clock
        self.pause_s = pause_s
        self._seen: dict[int, tuple[tuple[Any, ...], float]] = {}  # rank -> (progress, when)
        self._looked: float | None = None
        self._awake_since = -float("inf")
        self.paused_s = 0.0  # the last gap taken for a pause (0: none)

    def look(self, now: float) -> bool:
        """The supervisor looks at ``now`` (its monotonic clock); True when it had not
        looked for over ``pause_s`` (then ages count from now)."""
        paused = self._looked is not None and now - self._looked > self.pause_s
        if paused:
            assert self._looked is not None
            self.paused_s = now - self._looked
            self._awake_since = now
        self._looked = now
        return paused

    def restart(self, now: float) -> None:
        """Count every age afresh from ``now`` (the beats could not be trusted until then)."""
        self._awake_since = now

    def elapsed(self, since: float, now: float) -> float:
        """Seconds from ``since`` to ``now`` that the supervisor was awake for."""
        return now - max(since, self._awake_since)

    def age(self, beat: dict[str, Any], now: float) -> float:
        """Seconds since the rank of ``beat`` last made progress, as of ``now``."""
        mono = beat.get("progress_mono")
        if self.clock and beat.get("clock") == self.clock and isinstance(mono, (int, float)):
            age = now - float(mono)
        else:  # another host's clock, or an older beat: by change, on our clock
            key = (beat.get("pid"), beat.get("step"), beat.get("phase"),
                   beat.get("progress_mono", beat.get("progress_time")))  # fmt: skip
            rank = int(beat["rank"])
            last = self._seen.get(rank)
            if last is None or last[0] != key:
                self._seen[rank] = last = (key, now)
            age = now - last[1]
        return min(age, now - self._awake_since)
