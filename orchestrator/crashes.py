"""Samples that kill the process are data too.

A token id past the vocabulary, a sequence too long for memory, an assert in a tokenizer:
such a sample kills its rank at the same step every attempt, and restarts alone only spend
the restart budget on it. Where a rank is in its loop body is kept in a few bytes of a file
mapped into memory (:class:`StepMarker`, one store per batch, no system call), which
survives the process however it dies (exception, SIGKILL, segfault). The next attempt reads
the previous one's markers (:func:`suspicion`):

1. it died in the loop body of step S (micro-batch m): when the replay reaches (S, m), each
   rank that was in its loop body re-runs its samples one at a time through the loop body
   before the real batch (forward only, :class:`CrashProbe`), its marker naming each one;
2. it died in such a probe: that sample is the culprit, quarantined at start like a NaN's
   (ledger, data budget);
3. it died in the real batch after its probes all passed (samples that kill only together,
   such as a batch too large for memory): those samples are quarantined together.

The data order is a pure function of the ledger and the position, so a replay reaches the
same samples at (S, m): only the step needs to survive the process, not its ids.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

MARKER_DIR = "markers"
_FORMAT = "<qqqqq"  # attempt, step, micro, probe sample (-1: the batch itself), state
_SIZE = struct.calcsize(_FORMAT)
IDLE, IN_BODY, IN_GUARD = 0, 1, 2  # states: between steps, the user's code, the Guard's


@dataclass(frozen=True)
class Mark:
    rank: int
    attempt: int
    step: int
    micro: int
    probe: int
    state: int


class StepMarker:
    """This rank's place in its loop body, in a small memory-mapped file
    (``RUN_DIR/markers/rank<r>.bin``): what the next attempt reads if this one dies."""

    def __init__(self, run_dir: str, rank: int, attempt: int) -> None:
        self.attempt = attempt
        self._map: mmap.mmap | None = None
        path = marker_path(run_dir, rank)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, _SIZE)
                self._map = mmap.mmap(fd, _SIZE)
            finally:
                os.close(fd)
        except OSError:
            pass  # the run directory's disk: a crash then only restarts, as before
        # Nothing is written before the first batch: an attempt that dies earlier (in its
        # start) leaves the marker of the one before, which still says where that died.

    def set(self, step: int, micro: int, probe: int, state: int) -> None:
        if self._map is not None:
            struct.pack_into(_FORMAT, self._map, 0, self.attempt, step, micro, probe, state)

    def close(self, keep: bool = False) -> None:
        """Close the marker, reset to idle unless ``keep`` (an error left the loop body:
        the marker says where, for the next attempt)."""
        if self._map is not None:
            if not keep:
                self.set(0, 0, -1, IDLE)
            self._map.close()
            self._map = None


def marker_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, MARKER_DIR, f"rank{rank}.bin")


def read_marks(run_dir: str) -> list[Mark]:
    """Every rank's marker as the last process left it (unreadable ones skipped)."""
    top = os.path.join(run_dir, MARKER_DIR)
    marks = []
    for name in sorted(os.listdir(top)) if os.path.isdir(top) else []:
        if not (name.startswith("rank") and name.endswith(".bin")):
            continue
        try:
            with open(os.path.join(top, name), "rb") as f:
                raw = f.read(_SIZE)
            rank = int(name[4:-4])
        except (OSError, ValueError):
            continue
        if len(raw) == _SIZE:
            marks.append(Mark(rank, *struct.unpack(_FORMAT, raw)))
    return marks


@dataclass
class Suspicion:
    """What the previous attempt's death says. ``culprits``: quarantine these now (a probe
    of one died, or every sample of the batch passed alone and the batch killed again);
    else ``ranks`` re-run their samples of (``step``, ``micro``) one at a time first."""

    step: int
    micro: int
    ranks: list[int] = field(default_factory=list)
    culprits: list[int] = field(default_factory=list)
    why: str = "died_in_loop_body"


def suspicion(marks: list[Mark], attempt: int, events: list[dict[str, Any]]) -> Suspicion | None:
    """What to do about the last attempt's death, from the markers it left and the
    journal's ``crash_probes_clean`` events; None when it did not die in a loop body."""
    before = [m.attempt for m in marks if m.attempt < attempt]
    if not before:
        return None
    latest = max(before)  # an attempt that died before its first batch wrote no marker
    last = [m for m in marks if m.attempt == latest and m.state == IN_BODY]
    if not last:
        return None
    # Ranks that died of a peer's death (their collective failed: loop_error says so) are
    # not the culprit's: where the model's forward has collectives (FSDP), every rank is in
    # a probe when one sample kills its rank.
    collateral = {
        e.get("rank")
        for e in events
        if e.get("kind") == "loop_error"
        and e.get("attempt") == latest
        and (e.get("details") or {}).get("collective")
    }
    probing = [m for m in last if m.probe >= 0]
    own = [m for m in probing if m.rank not in collateral]
    if own or probing:
        m = (own or probing)[0]
        return Suspicion(m.step, m.micro, [m.rank], [m.probe], why="died_in_probe")
    step, micro = min((m.step, m.micro) for m in last)
    ranks = sorted(m.rank for m in last if (m.step, m.micro) == (step, micro))
    clean = [
        e
        for e in events
        if e.get("kind") == "crash_probes_clean"
        and e.get("step") == step
        and e["details"].get("micro") == micro
        and e.get("rank") in ranks
    ]
    if clean:  # each sample alone passed; together they killed again
        ids = sorted({i for e in clean for i in e["details"].get("samples", [])})
        return Suspicion(step, micro, ranks, ids, why="died_together")
    return Suspicion(step, micro, ranks)


#: What a rank's error says when it died of a peer's death, not of its own samples.
_PEER_DIED = ("connection closed by peer", "connection reset", "broken pipe", "gloo", "nccl")


def collective_failure(err: BaseException) -> bool:
    """``err`` is a collective that failed because a peer died (gloo raises a plain
    RuntimeError naming its transport; NCCL a DistBackendError)."""
    dist_error = getattr(getattr(torch, "distributed", None), "DistError", None)
    if dist_error is not None and isinstance(err, dist_error):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(p in text for p in _PEER_DIED)


class CrashProbe:
    """The re-runs of one batch, one sample at a time (filler on the ranks without
    suspects, so that every rank runs as many forwards: collectives inside the model stay
    matched). A probe passes when the loop body returns."""

    def __init__(self, suspects: list[int], filler: list[int], count: int) -> None:
        # A suspect rank's filler is one of its samples that passed: the first one.
        pad = [suspects[0]] if suspects else filler
        self.queue = [[i] for i in suspects] + [pad] * (count - len(suspects))
        self.suspects = suspects
        self.current: list[int] = []

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def next(self) -> tuple[list[int], int]:
        """The next sub-batch and the sample it probes (-1: a filler)."""
        self.current = self.queue.pop(0)
        own = len(self.current) == 1 and self.current[0] in self.suspects
        return self.current, self.current[0] if own else -1
