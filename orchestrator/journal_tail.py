"""Every node's journal read as it grows (``orchestrator status --follow``): the lines
appended since the last look, per file, merged by time with what was read before."""

from __future__ import annotations

import json
import os
from typing import Any

from orchestrator.events import EventLog
from orchestrator.journal import journal_files


class JournalTail:
    """Every node's journal read as it grows: each :meth:`update` parses only the lines
    appended since the last one (per file, from where it stopped), so a reader that looks
    again and again (``orchestrator status --follow``) reads each byte once, not the whole
    journal at every look (docs/scale.md). A last line still being written waits for its
    end (a full read counts it as damaged). A file that shrank, vanished or is another
    file now (the run directory archived and started again) makes it read all again."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._reset()

    def _reset(self) -> None:
        self.log = EventLog()
        # path -> ((st_dev, st_ino) of the file read, bytes read, lines read)
        self._at: dict[str, tuple[tuple[int, int], int, int]] = {}

    def update(self) -> EventLog:
        """The events so far, merged by time."""
        grew = False
        paths = journal_files(self.run_dir)
        if not self._at.keys() <= set(paths):  # one vanished: the journal is another now
            self._reset()
        for path in paths:
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    ident, offset, n = self._at.get(path, ((st.st_dev, st.st_ino), 0, 0))
                    if ident != (st.st_dev, st.st_ino) or st.st_size < offset:
                        self._reset()  # replaced: start over
                        return self.update()
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:  # archived while we listed it
                continue
            whole = data[: data.rfind(b"\n") + 1]
            where = os.path.relpath(path, self.run_dir)
            for line in whole.decode("utf-8", errors="replace").split("\n")[:-1]:
                n += 1
                if line.strip():
                    self.log.add(_json_or_none(line), f"{where}:{n}")
                    grew = True
            self._at[path] = (ident, offset + len(whole), n)
        if grew:
            self.log.events.sort(key=lambda e: e.time)  # stable, as read_events
        return self.log


def _json_or_none(line: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None
