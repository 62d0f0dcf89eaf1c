"""Hang detection for the supervisor: this node's ranks' heartbeats, read and judged (on the
host's monotonic clock, launch/progress.py), and a hang described before it is ended (every
rank's stack and the culprits, launch/hangs.py, in the journal's ``hang`` event).

Hangs are not judged while the run directory refuses the supervisor's own writes: the
ranks' heartbeats cannot be written then, and silence is no hang.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from launch.alerts import Alerter
from launch.hangs import collect, culprit_words
from launch.launcher import Launcher, log_path
from launch.progress import Stalls
from orchestrator.heartbeat import REJOIN, progress_time, read_heartbeats, suspects
from orchestrator.journal import Journal
from orchestrator.policy_sections import SupervisorPolicy
from orchestrator.protocol import EVENT_HANG, clock_id

logger = logging.getLogger(__name__)

# Longer than this between two looks at the heartbeats, the supervisor itself did not run
# (a paused VM, a stopped process): hang ages restart (launch/progress.py). Bounded by half
# the hang timeout, and never under what a slow look can take.
PAUSE_S, MIN_PAUSE_S = 30.0, 5.0


def _say(msg: str) -> None:
    logger.warning("%s", msg)  # what a person watching the job must see


class HangWatch:
    """The heartbeats of this node's ranks in the current attempt, and the hang verdict."""

    def __init__(
        self,
        run_dir: str,
        node: str,
        sup: SupervisorPolicy,
        failing: Callable[[], str | None],
        refresh: Callable[[], str | None],
    ) -> None:
        self.run_dir, self.node, self.sup = run_dir, node, sup
        self.host = socket.gethostname()
        self._failing = failing  # why the run directory refuses our writes (None: it takes them)
        self._refresh = refresh  # the same, from a write tried now
        self.journal: Journal | None = None  # set once the supervisor opens it
        self._max_step: int | None = None  # highest step seen in the current attempt
        self._stalls = Stalls(clock_id(), MIN_PAUSE_S)
        self._blind: tuple[float, str] | None = None  # (since, why) hang judgement paused

    @property
    def step(self) -> int:
        """The highest step seen in the current attempt, -1 before any."""
        return self._max_step if self._max_step is not None else -1

    @property
    def max_step(self) -> int | None:
        return self._max_step

    def begin(self) -> None:
        """A new attempt: nothing seen yet, every age counted afresh."""
        self._max_step = None
        pause_s = max(MIN_PAUSE_S, min(PAUSE_S, self.sup.hang_timeout_s / 2))
        self._stalls = Stalls(clock_id(), pause_s)

    def beats(self, attempt: int) -> list[dict[str, Any]]:
        beats = [b for b in read_heartbeats(self.run_dir, self.node) if b.get("attempt") == attempt]
        steps = [int(b["step"]) for b in beats]
        if steps:  # the highest step seen, even if a rollback lowers a rank's latest beat
            self._max_step = max(steps + ([self._max_step] if self._max_step is not None else []))
        return beats

    def progress_time(self, attempt: int) -> float | None:
        """The latest progress of this node's ranks in ``attempt``, from their heartbeats."""
        times = [progress_time(b) for b in self.beats(attempt) if b.get("phase") != "done"]
        return max(times) if times else None

    def stalled(self, beats: list[dict[str, Any]], started: float) -> dict[int, int] | None:
        """The ranks (and their last steps) with no progress for hang_timeout_s; {} when
        none wrote a beat within start_timeout_s; None when nothing is late. On this host's
        monotonic clock (``started`` too), never the wall clock (launch/progress.py)."""
        stalls = self._stalls
        now = time.monotonic()
        if stalls.look(now):
            _say(
                f"the supervisor did not run for {stalls.paused_s:.0f} s (a paused VM or "
                "process?): hang ages count from now"
            )
        if self._run_dir_refuses(now, self._failing()):
            stalls.restart(now)  # silence is no hang while the beats cannot be written
            return None
        if not beats:
            limit = self.sup.start_timeout_s
            if limit is not None and stalls.elapsed(started, now) > limit:
                return {}  # nothing started: a hang before the first step
            return None
        late = {
            int(b["rank"]): int(b["step"])
            for b in beats
            if b.get("phase") != "done" and stalls.age(b, now) > self._limit(b)
        }
        return late or None

    def _limit(self, beat: dict[str, Any]) -> float:
        """The seconds without progress that make ``beat``'s rank hung: a survivor waiting
        in an in-place recovery gets the agent's own limit, past which it falls back."""
        if beat.get("phase") == REJOIN:
            return max(self.sup.hang_timeout_s, self.sup.in_place_timeout_s)
        return self.sup.hang_timeout_s

    def rearm(self, hold_s: float = 0.0) -> None:
        """Count every rank's age afresh from ``hold_s`` after now: hung ranks were killed
        alone, and their replacements start, heal and join (the survivors make no progress
        meanwhile) within the agent's ``in_place_timeout_s``, past which the agent itself
        falls back to a full restart. Judged at hang_timeout_s instead, a replacement slower
        to start than that (imports, CUDA: 8 s on an H200) restarted every rank."""
        self._stalls.restart(time.monotonic() + hold_s)

    def settle(self) -> None:
        """At an attempt's end: a pause whose cause has gone (the supervisor's own file is
        written again, tried now) is journaled as over, so no pause outlives its cause
        unsaid when the run ends between two looks."""
        if self._blind is not None:
            self._run_dir_refuses(time.monotonic(), self._refresh())

    def _run_dir_refuses(self, now: float, failing: str | None) -> bool:
        """While this supervisor's own file in the run directory cannot be written (read-only,
        I/O errors; a full disk is written in place), the ranks' heartbeats cannot be either:
        hangs are not judged by them. Said and journaled when it starts and when it ends
        (an event the journal cannot take waits for it, see orchestrator/journal.py)."""
        assert self.journal is not None
        if failing is not None and self._blind is None:
            self._blind = (now, failing)
            _say(
                f"the run directory refuses writes ({failing}): hang detection is paused "
                "(the ranks' heartbeats cannot be written either) until it takes them again"
            )
            self.journal.write(
                "hang_detection_paused", self.step, {"error": failing, "node": self.node}
            )
        elif failing is None and self._blind is not None:
            since, why = self._blind
            self._blind = None
            _say("the run directory takes writes again: hang detection resumes")
            self.journal.write(
                "hang_detection_resumed",
                self.step,
                {"error": why, "seconds": round(now - since, 3), "node": self.node},
            )
        return self._blind is not None

    def report(
        self,
        attempt: int,
        stalled: dict[int, int],
        beats: list[dict[str, Any]],
        launcher: Launcher,
        alerter: Alerter,
        action: str = "stopping",
    ) -> list[dict[str, Any]]:
        """Describe the hang before it is ended: every rank's stack and the culprits into
        the journal's ``hang`` event, an alert, a word on the console; the culprits."""
        assert self.journal is not None
        behind = suspects(beats)
        every_rank = [  # every node's, for the culprit: the one outside the collective
            b for b in read_heartbeats(self.run_dir) if b.get("attempt") == attempt
        ]
        stacks, named, states = collect(
            self.run_dir, attempt, self.node, beats, launcher.ask_stacks, every_rank,
            state=launcher.state,
        )  # fmt: skip
        log = log_path(self.run_dir, attempt)
        hang_event = self.journal.write(
            EVENT_HANG,
            max(stalled.values(), default=-1),
            {
                "stalled_ranks": stalled,
                # Where each rank stood; the ones behind the rest are the suspects.
                "phases": {int(b["rank"]): b.get("phase") for b in beats},
                "suspects": behind,
                # From the stacks: the ranks not inside the collective others wait in,
                # and those that could not answer (frozen: their /proc state).
                "culprits": named,
                "states": states,  # this node's ranks' /proc states
                "stacks": stacks,
                "hang_timeout_s": self.sup.hang_timeout_s,
                "host": self.host,
                "node": self.node,
                "log": log,
            },
        )
        what = (
            f"ranks {sorted(stalled)} made no progress for "
            f"{self.sup.hang_timeout_s:.0f} s (last steps {stalled}"
            + (f"; ranks {behind} are behind the others, suspect them)" if behind else ")")
            + "".join(f"; {culprit_words(c)}" for c in named)
            if stalled
            else f"no rank wrote a heartbeat within {self.sup.start_timeout_s} s"
        )
        alerter.alert("hang", hang_event, self.journal, hang_event["step"])
        _say(f"hang: {what}; {action} (log: {log})")
        return named
