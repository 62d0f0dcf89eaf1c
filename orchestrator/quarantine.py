"""The quarantine ledger: sample ids never to be trained on again, as JSONL through fsspec.

One line per quarantined id: ``{"sample": 123, "step": 57, "reason": "...", "time": ...}``,
or per half-open range of ids: ``{"range": [96, 129], ...}`` holds ids 96 to 128 (the
windows of a token stream that overlap a bad one: orchestrator/samplers.py). Rank 0 writes
after every rank agreed on the ids; every rank reads it at start. The file is rewritten
whole through a temporary name and a move, which works on object stores that cannot append
and never leaves a half-written ledger behind.

Reading is strict: a line that is not an entry (not UTF-8, not JSON, no integer sample or
valid range) is an error naming the file and line, never skipped, since a dropped entry
would train on a sample the run quarantined.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

import fsspec

from orchestrator.errors import LedgerError
from orchestrator.idset import IdSet

# An entry to write: (ids, step, reason, ranges as [lo, hi] pairs, hi excluded).
Entry = tuple[list[int], int, str, list[list[int]]]


def _entry(line: dict[str, Any], ids: list[int], ranges: list[tuple[int, int]]) -> None:
    """One parsed line's ids: ``sample`` (one id) or ``range`` ([lo, hi), lo < hi)."""
    if "range" in line:
        lo, hi = line["range"]
        if not (type(lo) is int and type(hi) is int and lo < hi):
            raise ValueError(f"range {line['range']!r} is not [lo, hi] with integers lo < hi")
        ranges.append((lo, hi))
    else:
        ids.append(int(line["sample"]))


class Ledger:
    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.path = fsspec.core.url_to_fs(url)

    def _read_lines(self) -> list[tuple[int, bytes]]:
        """The non-blank lines with their numbers, as bytes (decoded by the reader)."""
        if not self.fs.exists(self.path):
            return []
        with self.fs.open(self.path, "rb") as f:
            data = f.read()
        return [(n, ln) for n, ln in enumerate(data.splitlines(), start=1) if ln.strip()]

    def load(self) -> IdSet:
        """Every quarantined id, the ranges' included.

        Raises:
            LedgerError: a line is not an entry (the message names the file and line and
                says what to do); no entry is ever skipped.
        """
        ids: list[int] = []
        ranges: list[tuple[int, int]] = []
        for n, raw in self._read_lines():
            try:
                _entry(json.loads(raw.decode("utf-8")), ids, ranges)
            except (ValueError, KeyError, TypeError) as err:  # UnicodeDecodeError included
                what = "is not UTF-8 text" if isinstance(err, UnicodeDecodeError) else (
                    "is not a ledger entry"
                )  # fmt: skip
                raise LedgerError(
                    f"quarantine ledger {self.url} line {n} {what} ({err}): expected "
                    f'{{"sample": <int>, ...}} or {{"range": [<lo>, <hi>], ...}} (ids lo to '
                    f"hi - 1) per line. A restart cannot fix this: repair line {n} (the "
                    "journal's quarantine events list every sample and range the run "
                    "quarantined) or remove it, then start the same command again",
                    self.url,
                    n,
                ) from None
        return IdSet(ids, ranges)  # merged once: a long ledger loads in O(n log n)

    def add(
        self, ids: Iterable[int], step: int, reason: str, ranges: Iterable[Sequence[int]] = ()
    ) -> None:
        """Append lines for ``ids`` and for ``ranges`` (``[lo, hi]`` pairs, hi excluded)."""
        now = time.time()
        meta = {"step": step, "reason": reason, "time": now}
        new = [json.dumps({"sample": int(i), **meta}) for i in sorted(set(ids))]
        new += [json.dumps({"range": [int(lo), int(hi)], **meta}) for lo, hi in ranges]
        if not new:
            return
        lines = [ln for _, ln in self._read_lines()] + [ln.encode() for ln in new]
        parent = self.path.rsplit("/", 1)[0] if "/" in self.path else ""
        if parent:
            self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{self.path}.tmp"
        with self.fs.open(tmp, "wb") as f:
            f.write(b"\n".join(lines) + b"\n")
        self.fs.mv(tmp, self.path)


def held_back(events: Iterable[dict[str, Any]], in_ledger: IdSet) -> list[Entry]:
    """Quarantine entries a storage failure kept out of the ledger and the process then
    died with (the journal has them: ``quarantine`` with ``persisted: false`` and no later
    ``ledger_written``): what rank 0 writes at start, so no entry is ever lost."""
    events = list(events)
    written = IdSet()
    for e in events:
        if e["kind"] == "ledger_written":
            written.update(int(i) for i in e["details"].get("samples", []))
            for lo, hi in e["details"].get("ranges", []):
                written.add_range(lo, hi)
    out: list[Entry] = []
    for e in events:
        if e["kind"] == "quarantine" and e["details"].get("persisted") is False:
            d = e["details"]
            # A range's ids are in the ledger once the range is: its samples are written
            # as the range only (orchestrator/recovery.py).
            spans = [[int(lo), int(hi)] for lo, hi in d.get("ranges", [])
                     if not _covered(lo, hi, written, in_ledger)]  # fmt: skip
            inside = IdSet(ranges=[(lo, hi) for lo, hi in d.get("ranges", [])])
            ids = [int(i) for i in d.get("samples", []) if int(i) not in inside]
            ids = [i for i in ids if i not in written and i not in in_ledger]
            if ids or spans:
                out.append((ids, int(e["step"]), str(d.get("reason", "unknown")), spans))
    return out


def _covered(lo: int, hi: int, *sets: IdSet) -> bool:
    """Whether every id of ``[lo, hi)`` is in one of ``sets``."""
    union = IdSet()
    for s in sets:
        union.update(s)
    return union.count_in(lo, hi) == hi - lo
