"""Alerts: the supervisor runs ``alerts.command`` when the job needs a person (gave up,
unhealthy, a crash loop, a hang, ...), with the event as JSON on stdin, so a team can page
itself (a script, ``curl`` to a webhook, ``mail``). Each run is journaled (``alert``).

A command runs on a thread of its own and is killed after ``alerts.timeout_s``: an alert
never holds up the supervisor's decisions; the supervisor waits for the ones still running
(bounded by the same timeout) before it exits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
from typing import Any

from orchestrator.journal import Journal
from orchestrator.policy_sections import AlertsPolicy
from orchestrator.protocol import EVENT_ALERT

logger = logging.getLogger(__name__)


class Alerter:
    def __init__(self, policy: AlertsPolicy, run_dir: str, node: str) -> None:
        self.policy, self.run_dir, self.node = policy, run_dir, node
        self._threads: list[threading.Thread] = []

    def wants(self, kind: str) -> bool:
        return self.policy.command is not None and kind in self.policy.events

    def alert(self, kind: str, event: dict[str, Any], journal: Journal, step: int) -> None:
        """Run the command for ``kind`` (if the policy alerts on it) with ``event``."""
        if not self.wants(kind):
            return
        payload = {"alert": kind, "run_dir": self.run_dir, "node": self.node, "event": event}
        t = threading.Thread(
            target=self._run, args=(kind, payload, journal, step), name="alert", daemon=True
        )
        t.start()
        self._threads.append(t)

    def _run(self, kind: str, payload: dict[str, Any], journal: Journal, step: int) -> None:
        cmd = self.policy.command
        assert cmd is not None
        said: dict[str, Any] = {"alert": kind, "node": self.node}
        try:
            # Its own session: a timeout kills the whole command (a shell line's children,
            # e.g. its curl, too), not only the shell.
            proc = subprocess.Popen(
                cmd,
                shell=isinstance(cmd, str),  # a string is a shell line, by the user's choice
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            try:
                _, err = proc.communicate(
                    json.dumps(payload, default=str).encode(), timeout=self.policy.timeout_s
                )
                said.update(returncode=proc.returncode, stderr=err.decode(errors="replace")[-500:])
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                said.update(error=f"timed out after {self.policy.timeout_s} s")
        except OSError as err:  # not found, not executable
            said.update(error=repr(err))
        if said.get("returncode", 1) != 0:
            logger.warning(
                "alerts.command for the %s alert failed (%s); nobody was paged. Try the "
                "command by hand with an event of RUN_DIR/journal/ on stdin, and check "
                "alerts.command and alerts.timeout_s in the policy",
                kind,
                said,
            )
        try:
            journal.write(EVENT_ALERT, step, said)
        except OSError as err:  # a full disk must not kill the thread silently
            logger.warning("could not journal the %s alert: %r", kind, err)

    def wait(self) -> None:
        """Let the alerts still running finish (each bounded by its timeout)."""
        for t in self._threads:
            t.join(self.policy.timeout_s + 5)
        self._threads = []
