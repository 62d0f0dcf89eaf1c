"""Per-rank heartbeats in RUN_DIR/heartbeats/<node>/, read by that node's supervisor to
detect hangs (each supervisor reads only its own node's ranks).

The training thread only records its progress in memory: where it is in the step (``beat``
at a commit, ``enter`` at backward and at the check) and when it got there; a clock read
and one attribute write. A writer thread, started at the first beat, writes that to
``rank<r>.json`` every ``interval_s``; phase changes that matter (closing, done) are written
at once. The file is replaced atomically, so a reader never sees half a beat.

A beat carries two times, each on two clocks. ``progress_mono`` says when the training
thread last moved, on the host's monotonic clock (``clock`` names it): the supervisor of
the node, on the same clock, judges hangs by it, exactly, whatever the writer's phase, and
a wall-clock step (NTP, a VM's clock set after a pause) changes nothing. ``progress_time``
is the same moment on the wall clock, for people and the goodput ledger. ``time`` and
``mono`` say when the file was written: a process that stopped writing altogether (frozen,
GIL held) is late by both. ``phase`` says where in the step the rank stopped: when one rank
hangs the others soon block in a collective further on (DDP's all-reduce in backward, the
Guard's check), so the ranks furthest behind are the suspects (``suspects``).

Writing is bookkeeping and never stops training: a full disk does not silence the beats
(the file is rewritten in place, :func:`orchestrator.rundir.write_record`); a write that
fails anyway is said once (``on_error``: the Guard journals ``heartbeat_failed``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from orchestrator.protocol import (
    ENV_SUPERVISOR_PID,
    HEARTBEAT_DIR,
    clock_id,
    node_name,
    node_path,
)
from orchestrator.rundir import write_record
from orchestrator.stacks import arm, disarm, main_thread_id

# Where a rank is in its step, in order. A rank blocked in a collective waits for the ranks
# at an earlier position; other phases (recovered, closing, ...) are not compared.
STEP_PHASES = ("train", "backward", "check")
# In-place recovery (orchestrator/rejoin.py): a survivor waits for the replacement to start,
# heal and join. The supervisor judges it by supervisor.in_place_timeout_s, not
# hang_timeout_s: a replacement's start (imports, CUDA, model build) can take longer.
REJOIN = "rejoin"

logger = logging.getLogger(__name__)


def beat_path(run_dir: str, rank: int) -> str:
    """Where ``rank`` (on this node) writes its beats."""
    return os.path.join(node_path(run_dir, HEARTBEAT_DIR, node_name()), f"rank{rank}.json")


def forget_beat(run_dir: str, rank: int) -> None:
    """A dead rank's last beat, removed when the node agent starts its replacement: it would
    age into a hang while the replacement starts; the replacement beats from its first step."""
    try:
        os.unlink(beat_path(run_dir, rank))
    except FileNotFoundError:
        pass


class Heartbeat:
    """``on_error(err)`` is called once, on the writer thread, the first time a beat cannot
    be written (a full or vanished disk): the supervisor would otherwise see this rank
    fall silent and call it a hang, with nothing in the journal to say why."""

    def __init__(
        self,
        run_dir: str,
        rank: int,
        attempt: int,
        interval_s: float,
        on_error: Callable[[OSError], object] | None = None,
    ) -> None:
        self.path = beat_path(run_dir, rank)
        self.dir = os.path.dirname(self.path)
        os.makedirs(self.dir, exist_ok=True)
        self.base = {
            "rank": rank,
            "attempt": attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node": node_name(),  # the supervisor of this node reads this rank's beats
            "thread": main_thread_id(),  # the training thread, in its stack dumps
            "clock": clock_id(),  # whose monotonic clock ``progress_mono`` is on
        }
        self.interval_s = interval_s
        self._on_error = on_error
        self.failures = 0  # beats that could not be written
        # The supervisor asks for this rank's stacks on a hang (orchestrator/stacks.py); the
        # signal is taken only under it, so a script's own SIGUSR2 handler stays otherwise.
        self._stacks: IO[str] | None = None
        if ENV_SUPERVISOR_PID in os.environ:
            try:
                self._stacks = arm(os.path.join(self.dir, f"rank{rank}.stack"))
            except OSError as err:  # a read-only run directory: no stacks on a hang
                self._failed(err)
        # (step, phase, monotonic time of the progress), replaced as one: the writer never
        # sees half an update. One clock read on the training thread: the wall time of the
        # progress is worked out when the beat is written.
        self.state: tuple[int, str, float] = (0, "train", time.monotonic())
        self._lock = threading.Lock()  # the writer thread and forced writes share the file
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None
        self._progress_wall = (-1.0, 0.0)  # (progress_mono, its wall time), see _write

    def beat(self, step: int, phase: str = "train", force: bool = False) -> None:
        """Progress at ``step`` (a commit, a recovery); ``force`` writes it now (a failure
        is said, never raised)."""
        self.state = (step, phase, time.monotonic())
        if force:
            self._try_write()
        elif self._writer is None:
            # The first beat: a first step that takes long (compilation, lazy init) is not
            # a hang, so nothing is written before it (supervisor.start_timeout_s covers it).
            self._writer = threading.Thread(
                target=self._run, name="orchestrator-heartbeat", daemon=True
            )
            self._writer.start()

    def enter(self, phase: str) -> None:
        """The rank moved on within its step (one of STEP_PHASES); nothing is written here."""
        self.state = (self.state[0], phase, time.monotonic())

    def close(self) -> None:
        """Stop the writer (after the final, forced, beat)."""
        self._stop.set()
        if self._writer is not None:
            self._writer.join()
        if self._stacks is not None:
            disarm(self._stacks)

    def _run(self) -> None:
        while True:
            self._try_write()
            if self._stop.wait(self.interval_s):
                return

    def _try_write(self) -> None:
        try:
            self._write()
        except OSError as err:  # read-only or failing: the supervisor will see silence
            self._failed(err)

    def _failed(self, err: OSError) -> None:
        self.failures += 1
        if self.failures > 1:
            return
        logger.error(
            "rank %d: heartbeat %s cannot be written (%s); the supervisor may judge this "
            "rank hung: check the run directory's disk",
            self.base["rank"],
            self.path,
            err,
        )
        if self._on_error is not None:
            try:
                self._on_error(err)
            except Exception:  # the journal may sit on the same disk: it says so itself
                pass

    def _write(self) -> None:
        step, phase, progress = self.state
        mono, wall = time.monotonic(), time.time()
        with self._lock:
            # The progress on the wall clock, worked out once per progress (a reader that
            # compares beats sees it change only when the rank moved).
            if self._progress_wall[0] != progress:
                self._progress_wall = (progress, wall - (mono - progress))
            beat = {**self.base, "step": step, "phase": phase, "progress_mono": progress,
                    "progress_time": self._progress_wall[1], "mono": mono,
                    "time": wall}  # fmt: skip
            write_record(self.path, json.dumps(beat))


def progress_time(beat: dict[str, Any]) -> float:
    """When the rank last moved (beats written before progress_time existed: their time)."""
    return float(beat.get("progress_time", beat["time"]))


def suspects(beats: list[dict[str, Any]]) -> list[int]:
    """The ranks furthest behind in the step sequence, when the others are further on (so
    probably waiting for them in a collective). Empty when all stand at the same place or a
    rank is outside the step phases: then the beats cannot tell."""
    if not beats or any(b.get("phase") not in STEP_PHASES for b in beats):
        return []
    at = {int(b["rank"]): (int(b["step"]), STEP_PHASES.index(b["phase"])) for b in beats}
    behind = min(at.values())
    if all(pos == behind for pos in at.values()):
        return []
    return sorted(r for r, pos in at.items() if pos == behind)


def read_heartbeats(run_dir: str, node: str | None = None) -> list[dict[str, Any]]:
    """Each rank's latest beat (any attempt), sorted by rank: of ``node``'s ranks, or of
    every node (a rank that ran on several nodes across attempts: its newest beat)."""
    top = os.path.join(run_dir, HEARTBEAT_DIR)
    if node is not None:
        dirs = [node_path(run_dir, HEARTBEAT_DIR, node)]
    else:  # every node's folder, and the flat folder of older run directories
        subs = sorted(os.listdir(top)) if os.path.isdir(top) else []
        dirs = [top] + [os.path.join(top, s) for s in subs]
    newest: dict[int, dict[str, Any]] = {}
    for d in dirs:
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if not (name.startswith("rank") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    b = json.load(f)
            except (OSError, ValueError):
                continue  # replaced while we read it: the next poll gets it
            r = int(b.get("rank", 0))
            if r not in newest or _age_key(b) > _age_key(newest[r]):
                newest[r] = b
    return [newest[r] for r in sorted(newest)]


def _age_key(beat: dict[str, Any]) -> tuple[int, float]:
    return int(beat.get("attempt", 0)), float(beat.get("time", 0.0))
