"""The quarantine ledger: sample ids never to be trained on again, as JSONL through fsspec.

One line per quarantined id: ``{"sample": 123, "step": 57, "reason": "...", "time": ...}``.
Rank 0 writes after every rank agreed on the ids; every rank reads it at start. The file is
rewritten whole through a temporary name and a move, which works on object stores that
cannot append and never leaves a half-written ledger behind.

Reading is strict: a line that is not an entry (not UTF-8, not JSON, no integer sample) is
an error naming the file and line, never skipped, since a dropped entry would train on a
sample the run quarantined.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import fsspec

from orchestrator.errors import LedgerError


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

    def load(self) -> set[int]:
        """Every quarantined id.

        Raises:
            LedgerError: a line is not an entry (the message names the file and line and
                says what to do); no entry is ever skipped.
        """
        ids: set[int] = set()
        for n, raw in self._read_lines():
            try:
                ids.add(int(json.loads(raw.decode("utf-8"))["sample"]))
            except (ValueError, KeyError, TypeError) as err:  # UnicodeDecodeError included
                what = "is not UTF-8 text" if isinstance(err, UnicodeDecodeError) else (
                    "is not a ledger entry"
                )  # fmt: skip
                raise LedgerError(
                    f"quarantine ledger {self.url} line {n} {what} ({err}): expected "
                    f'{{"sample": <int>, ...}} per line. A restart cannot fix this: repair '
                    f"line {n} (the journal's quarantine events list every sample the run "
                    "quarantined) or remove it, then start the same command again",
                    self.url,
                    n,
                ) from None
        return ids

    def add(self, ids: Iterable[int], step: int, reason: str) -> None:
        now = time.time()
        new = [
            json.dumps({"sample": int(i), "step": step, "reason": reason, "time": now})
            for i in sorted(set(ids))
        ]
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


def held_back(
    events: Iterable[dict[str, Any]], in_ledger: set[int]
) -> list[tuple[list[int], int, str]]:
    """Quarantine entries a storage failure kept out of the ledger and the process then
    died with (the journal has them: ``quarantine`` with ``persisted: false`` and no later
    ``ledger_written``): what rank 0 writes at start, so no entry is ever lost."""
    events = list(events)
    written = {int(i) for e in events if e["kind"] == "ledger_written"
               for i in e["details"].get("samples", [])}  # fmt: skip
    out = []
    for e in events:
        if e["kind"] == "quarantine" and e["details"].get("persisted") is False:
            ids = [int(i) for i in e["details"].get("samples", [])]
            ids = [i for i in ids if i not in written and i not in in_ledger]
            if ids:
                out.append((ids, int(e["step"]), str(e["details"].get("reason", "unknown"))))
    return out
