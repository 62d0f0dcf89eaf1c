"""The launcher of one attempt, as a process, and the stop requests that reach the supervisor.

The launcher runs in a session of its own (its whole group is signalled at once), with a
parent-death signal (nothing outlives a SIGKILLed supervisor); its output goes to the
console and the attempt's log; every process seen under it is held by pidfd (torchrun
starts its workers in sessions of their own, out of reach of the group), so the workers it
leaves behind are swept and a recycled pid is never hit.

A SIGTERM or SIGINT to the supervisor is forwarded from the handler at once; nothing is
said or logged there (a handler that takes the logging or stdout lock the interrupted code
holds deadlocks or raises): the main loop says it (:meth:`StopRequests.announce`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from launch.procs import Handles, descendants, die_with_parent, proc_state, tee
from orchestrator.journal import Journal
from orchestrator.protocol import ATTEMPTS_DIR, EVENT_STOP_REQUESTED
from orchestrator.stacks import STACK_SIGNAL

logger = logging.getLogger(__name__)


def log_path(run_dir: str, attempt: int) -> str:
    """Where the output of ``attempt`` goes."""
    return os.path.join(run_dir, ATTEMPTS_DIR, str(attempt), "output.log")


def open_log(path: str) -> IO[bytes]:
    """The attempt's output log; where it cannot be opened (a full or read-only disk), the
    output still goes to the console."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "ab")
    except OSError as err:
        logger.warning("%s", f"{path} cannot be written ({err}): console only")
        return open(os.devnull, "ab")


class Launcher:
    """The current attempt's launcher process and every process seen under it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.term_sent_at: float | None = None  # when SIGTERM was forwarded (monotonic)
        self.seen = Handles()  # every process seen under the current attempt
        self._copier: threading.Thread | None = None

    def start(
        self, cmd: list[str], env: Mapping[str, str], log: IO[bytes], at_end: Any
    ) -> str | None:
        """Start ``cmd``, its output teed into ``log`` (``at_end`` called at its end of
        output); returns why it cannot start at all (not found, not executable), else None."""
        try:
            self.proc = proc = subprocess.Popen(
                cmd,
                env=dict(env),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: we signal all of it
                preexec_fn=die_with_parent,  # nothing outlives a SIGKILLed supervisor
            )
        except OSError as err:  # not found, not executable: no attempt can succeed
            found = shutil.which(cmd[0]) or os.path.isfile(cmd[0])
            hint = (
                "the file is there, so its interpreter (its #! line) was not found"
                if isinstance(err, FileNotFoundError) and found
                else "on PATH? executable?"
            )
            return (
                f"cannot start {cmd[0]!r}: {err.strerror or err} "
                f"({type(err).__name__}); check the command after `--` ({hint})"
            )
        # Its end of output wakes the supervisor's watch at once, not at its next poll: the
        # next attempt starts that much sooner.
        self._copier = threading.Thread(target=tee, args=(proc.stdout, log, at_end), daemon=True)
        self._copier.start()
        return None

    def finish(self) -> int:
        """Wait for the launcher's end, sweep what it left behind; its exit code."""
        assert self.proc is not None
        rc = self.proc.wait()
        self.sweep()
        return rc

    def forget(self) -> None:
        """After :meth:`finish` and the log's copy: no launcher until the next start."""
        if self._copier is not None:
            self._copier.join(timeout=5)
        self._copier = None
        self.proc = None
        self.term_sent_at = None

    def kill(self, sig: int) -> None:
        """Signal the launcher's process group and every worker under it (torchrun starts
        its workers in sessions of their own, out of reach of the group)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self.seen.add(descendants(proc.pid))
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        self.seen.send(sig)

    def terminate(self, grace_s: float) -> None:
        """SIGTERM, and SIGKILL when the launcher is still there ``grace_s`` later."""
        self.kill(signal.SIGTERM)
        self.wait_or_kill(grace_s)

    def wait_or_kill(self, grace_s: float) -> None:
        assert self.proc is not None
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)

    def sweep(self) -> None:
        """Kill workers the launcher left behind (SIGKILLed torchrun leaves orphans)."""
        self.seen.send(signal.SIGKILL)
        self.seen.close()

    def ask_stacks(self, beats: list[dict[str, Any]]) -> list[int]:
        """Signal the ranks of ``beats`` for their stacks, through the pidfds held since they
        were seen (never a recycled pid); returns the ranks reached."""
        reached = self.seen.send(STACK_SIGNAL, only={int(b.get("pid", -1)) for b in beats})
        return [int(b["rank"]) for b in beats if b.get("pid") in reached]

    def state(self, pid: int) -> str | None:
        """The /proc state of a worker this attempt holds (never a recycled pid's)."""
        return proc_state(pid) if self.seen.holds(pid) else None


class StopRequests:
    """The signals that reached the supervisor: counted and forwarded by the handler, said
    and journaled by the main loop; ``wake`` ends the main loop's waits early."""

    def __init__(self, launcher: Launcher, node: str, grace_s: float) -> None:
        self.launcher, self.node, self.grace_s = launcher, node, grace_s
        self.count = 0
        self.wake = threading.Event()
        self.last: int = signal.SIGTERM
        self.first_at: float | None = None  # set by the handler
        self._announced = 0  # signals said to the person watching (outside the handler)
        self._journaled = False  # stop_requested written (once the journal is open)
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _on_signal(self, signum: int, frame: object) -> None:
        """Forward the stop (see the module's docstring for why nothing is said here)."""
        self.count += 1
        self.last = signum
        if self.first_at is None:
            self.first_at = time.time()
        self.wake.set()
        if self.count == 1 or signum == signal.SIGTERM:
            # Forward: the Guard turns it into a collective stop with a durable snapshot.
            self.launcher.kill(signal.SIGTERM)
            if self.launcher.term_sent_at is None:
                self.launcher.term_sent_at = time.monotonic()
        else:
            self.launcher.kill(signal.SIGKILL)

    def announce(self, journal: Journal | None, step: int) -> None:
        """Say, from the main loop, what the handler did since the last call (and journal
        it: the goodput ledger counts a preemption from its signal)."""
        if journal is not None and self.first_at is not None and not self._journaled:
            self._journaled = True
            journal.write(
                EVENT_STOP_REQUESTED,
                step,
                {
                    "signal": signal.Signals(self.last).name,
                    "signal_time": self.first_at,
                    "node": self.node,
                },
            )
        if self._announced >= self.count:
            return
        if self._announced == 0 or self.last == signal.SIGTERM:
            logger.warning(
                "%s",
                f"got {signal.Signals(self.last).name}: stopping the workers "
                f"gracefully (up to {self.grace_s:.0f} s); press Ctrl-C again to kill "
                "them now",
            )
        else:
            logger.warning("%s", "second interrupt: killing the workers now")
        self._announced = self.count

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``, or less if a signal comes (then True)."""
        deadline = time.monotonic() + seconds
        while True:
            self.wake.clear()  # set by other wakes too (the launcher's end of output)
            if self.count:  # after the clear: the handler counts before it wakes us
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.wake.wait(left)
