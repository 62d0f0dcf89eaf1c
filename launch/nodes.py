"""The supervisors of one job's nodes, agreeing through the run directory.

Each node's supervisor writes ``RUN_DIR/supervisors/<node>.json`` (its pid, host, attempt,
state and, at the end, its exit code) every ``heartbeat_interval_s``, and reads the other
nodes' files. That is all the coordination there is: the shared file system Slurm clusters
have, no server of our own. The workers meet in torchrun's rendezvous as before.

- **One attempt id, agreed before the launcher starts**: each supervisor proposes its next
  attempt (``outcomes.next_attempt_number``) in its file, phase ``agreeing``, and takes up
  the highest attempt any live node proposes or runs; it starts its launcher once every
  node is alive and at that attempt (:func:`agree`). Proposals only grow and every node
  takes the highest, so any starting counts converge: after a lost node, a requeue of all
  of them, a partition of any length, nodes started in any order. A node still running an
  older attempt while another proposes a newer one ends its own (the other left it, so it
  can never complete): nobody waits for anybody in a cycle. The Guard checks the ids at
  start (all ranks' attempt ids must match).
- **One end**: a node whose supervisor stops for good (gave up, unhealthy, crash loop, lost
  a node) says so in its file; the others stop with the same exit code instead of waiting
  for it in the rendezvous.
- **A lost node**: when fewer than the launcher's node count have a live supervisor for
  ``supervisor.node_timeout_s``, the job ends with exit 77 naming the missing nodes.

Liveness is judged by change, on this node's own clock: a peer is alive while its file keeps
changing (a sequence number), so clocks that disagree between hosts do not matter.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from orchestrator.protocol import SUPERVISORS_DIR, node_path
from orchestrator.rundir import write_record

RUNNING, EXITED = "running", "exited"
# What a running supervisor is doing (its file's "phase"): waiting for the nodes to agree on
# the next attempt, or running its launcher in it.
AGREEING, IN_ATTEMPT = "agreeing", "in_attempt"
logger = logging.getLogger(__name__)


def launcher_nodes(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """The job's node count, from the launcher command (torchrun ``--nnodes N`` or
    ``MIN:MAX``, deepspeed ``--num_nodes N``), else Slurm's step variables under ``srun``,
    else 1. An elastic range counts its minimum: the job can run with that many."""
    for i, arg in enumerate(cmd):
        name, eq, value = arg.partition("=")
        if name not in ("--nnodes", "--num_nodes", "--num-nodes"):
            continue
        value = value if eq else (cmd[i + 1] if i + 1 < len(cmd) else "")
        m = re.fullmatch(r"(\d+)(?::\d+)?", value)
        if m:
            return max(1, int(m.group(1)))
    for var in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if env.get(var, "").isdigit():
            return max(1, int(env[var]))
    return 1


def is_agent(cmd: Sequence[str]) -> bool:
    """Whether the launcher command is the node agent (``orchestrator launch
    --nproc-per-node``: ``python -m orchestrator.agent``), which replaces a rank alone."""
    return list(cmd[1:3]) == ["-m", "orchestrator.agent"]


def supervisors(run_dir: str) -> list[dict[str, Any]]:
    """Every node's supervisor file (``orchestrator status`` shows them)."""
    d = os.path.join(run_dir, SUPERVISORS_DIR)
    out = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if name.endswith(".json"):
            try:
                with open(os.path.join(d, name), encoding="utf-8") as f:
                    out.append(dict(json.load(f)))
            except (OSError, ValueError):
                continue  # being replaced: the next look reads it
    return out


@dataclass
class Ended:
    """A peer's supervisor that stopped for good since this one started."""

    node: str
    exit_code: int
    reason: str


class Coordinator(Protocol):
    """What a node's supervisor asks of the others: :class:`FilePeers` (the run directory)
    or launch/store_peers.py's ``StorePeers`` (a key-value store, for many nodes)."""

    node: str
    nnodes: int
    stale_s: float

    @property
    def poll_s(self) -> float:
        """How long the supervisor may wait before its next look."""
        ...

    @property
    def failing(self) -> str | None: ...

    def start(self) -> None: ...

    def publish(self, **fields: Any) -> None: ...

    def at(self, attempt: int, phase: str) -> None: ...

    def exited(self, code: int, reason: str) -> None: ...

    def refresh(self) -> str | None: ...

    def propose(self, attempt: int) -> tuple[int, bool]: ...

    def others(self) -> dict[str, dict[str, Any]]: ...

    def live(self) -> dict[str, dict[str, Any]]: ...

    def ended(self, fresh: bool = True) -> Ended | None: ...

    def lost(self, timeout_s: float) -> str | None: ...

    def ahead(self, attempt: int) -> str | None: ...

    def silent(self, seconds: float) -> list[str]: ...


class FilePeers:
    """This node's supervisor file (written by a thread) and what the others' say.

    ``watch_others=False``: the file is only written (for ``orchestrator status``), the
    others are reached another way (launch/store_peers.py)."""

    def __init__(
        self, run_dir: str, node: str, nnodes: int, interval_s: float, *, watch_others: bool = True
    ) -> None:
        self.run_dir, self.node, self.nnodes = run_dir, node, nnodes
        self.watch_others = watch_others
        self.interval_s = interval_s
        self.stale_s = max(10.0, 5 * interval_s)  # no change for this long: not alive
        self.path = node_path(run_dir, SUPERVISORS_DIR, node, ".json")
        self._mine: dict[str, Any] = {
            "node": node,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "attempt": -1,
            "phase": AGREEING,
            "state": RUNNING,
            "seq": 0,
        }
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # node -> (its last (pid, seq), when we saw it change, on our monotonic clock)
        self._seen: dict[str, tuple[tuple[Any, Any], float]] = {}
        self._complete_at = time.monotonic()  # the last time every node was alive
        self._old: set[tuple[str, Any]] = set()  # peers already exited when we started
        # Reading every node's file is for when it matters (an attempt waiting for its
        # nodes), and at most every poll_s: 250 nodes polling 250 files stays cheap.
        self.poll_s = max(interval_s, 2.0)
        self._polled_at = -float("inf")
        self._verdict: str | None = None
        self._last_read: dict[str, dict[str, Any]] = {}
        self._ahead_at: tuple[float, dict[str, dict[str, Any]]] = (-float("inf"), {})
        self._failed = False  # a write failed (said once)
        # The error of the last write, None when it succeeded: a run directory this process
        # cannot write is one the ranks' heartbeats cannot reach either (the supervisor then
        # stops judging hangs by them).
        self.failing: str | None = None

    # --- our own file --------------------------------------------------------------------------
    def start(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        if self.watch_others:
            self._old = {
                (n, i.get("pid")) for n, i in self.others().items() if i.get("state") == EXITED
            }
        self._write()
        self._thread = threading.Thread(target=self._run, name="supervisor-beat", daemon=True)
        self._thread.start()

    def publish(self, **fields: Any) -> None:
        """Say more in this node's file (the replica server's address)."""
        with self._lock:
            self._mine.update(fields)
        self._write()

    def at(self, attempt: int, phase: str) -> None:
        """Say which attempt this node proposes (``AGREEING``) or runs (``IN_ATTEMPT``)."""
        with self._lock:
            changed = (self._mine["attempt"], self._mine["phase"]) != (attempt, phase)
            self._mine.update(attempt=attempt, phase=phase)
        if changed:
            self._write()

    def record(self) -> dict[str, Any]:
        """What this node's file says (a copy)."""
        with self._lock:
            return dict(self._mine)

    def exited(self, code: int, reason: str) -> None:
        """Stop beating and say how this node's supervisor ended (read by the others)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._mine.update(state=EXITED, exit_code=code, reason=reason)
        self._write()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write()

    def refresh(self) -> str | None:
        """Write this node's file now: why the run directory refuses it (None: it took it)."""
        self._write()
        return self.failing

    def _write(self) -> None:
        """Write this node's file; a failure is said once and never raised (a full disk
        rewrites it in place; a read-only one leaves it stale, and the other nodes see us
        stale, which is the truth)."""
        with self._lock:
            self._mine["seq"] += 1
            self._mine["time"] = time.time()
            try:
                write_record(self.path, json.dumps(self._mine))
                self.failing = None
            except OSError as err:
                self.failing = f"{self.path}: {err}"
                if not self._failed:
                    self._failed = True
                    logger.error(
                        "%s cannot be written (%s): the other nodes' supervisors will see "
                        "this one stale; check the run directory's disk",
                        self.path,
                        err,
                    )

    # --- the others ----------------------------------------------------------------------------
    def propose(self, attempt: int) -> tuple[int, bool]:
        """One look at the agreement on the next attempt (:func:`agree`)."""
        return agree(attempt, self.live(), self.nnodes)

    def others(self) -> dict[str, dict[str, Any]]:
        return {
            str(i.get("node")): i for i in supervisors(self.run_dir) if i.get("node") != self.node
        }

    def ended(self, fresh: bool = True) -> Ended | None:
        """A peer that stopped for good since we started (exits we found at start belong to
        an earlier job on this run directory, which the same commands are resuming).
        ``fresh=False``: from the files as last read by :meth:`lost` (a cheap poll)."""
        for node, info in (self.others() if fresh else self._last_read).items():
            if info.get("state") == EXITED and (node, info.get("pid")) not in self._old:
                return Ended(node, int(info.get("exit_code", 1)), str(info.get("reason", "")))
        return None

    def lost(self, timeout_s: float) -> str | None:
        """Why the job cannot go on, when fewer than ``nnodes`` supervisors have been alive
        for ``timeout_s``; None otherwise (and always for one node). Reads the files at most
        every ``poll_s``."""
        if self.nnodes <= 1:
            return None
        now = time.monotonic()
        if now - self._polled_at < self.poll_s:
            return self._verdict
        if now - self._polled_at > 3 * self.poll_s + 1.0:  # not watched for a while: afresh
            self._seen.clear()
            self._complete_at = now
        self._polled_at = now
        self._verdict = self._judge(now, timeout_s)
        return self._verdict

    def live(self) -> dict[str, dict[str, Any]]:
        """The live peers' files (read afresh)."""
        now = time.monotonic()
        return {n: i for n, i in self.others().items() if self._alive(n, i, now)}

    def ahead(self, attempt: int) -> str | None:
        """A live peer that proposes or runs an attempt after ``attempt``: it has left this
        one, which can therefore never complete (read at most every ``poll_s``)."""
        now = time.monotonic()
        if now - self._ahead_at[0] >= self.poll_s:
            self._ahead_at = (now, self.live())
        for node, info in self._ahead_at[1].items():
            if int(info.get("attempt", -1)) > attempt:
                return f"{node} (host {info.get('host')}) is at attempt {info.get('attempt')}"
        return None

    def silent(self, seconds: float) -> list[str]:
        """The running peers whose file does not change within ``seconds`` (looked at now,
        waited for): a supervisor that died a moment ago still looks alive to :meth:`live`."""
        first = {n: (i.get("pid"), i.get("seq")) for n, i in self.others().items()
                 if i.get("state") == RUNNING}  # fmt: skip
        deadline = time.monotonic() + seconds
        while first and time.monotonic() < deadline:
            time.sleep(min(0.2, self.interval_s))
            now = self.others()
            first = {n: k for n, k in first.items()
                     if n in now and (now[n].get("pid"), now[n].get("seq")) == k}  # fmt: skip
        return sorted(first)

    def _alive(self, node: str, info: dict[str, Any], now: float) -> bool:
        """Running, and its file changed within ``stale_s`` (on our clock)."""
        key = (info.get("pid"), info.get("seq"))
        last = self._seen.get(node)
        if last is None or last[0] != key:
            self._seen[node] = (key, now)
        return info.get("state") == RUNNING and now - self._seen[node][1] <= self.stale_s

    def _judge(self, now: float, timeout_s: float) -> str | None:
        self._last_read = others = self.others()
        alive, stale = [], []
        for node, info in others.items():
            if self._alive(node, info, now):
                alive.append(node)
            else:
                stale.append(
                    f"{node} (host {info.get('host')}, pid {info.get('pid')}, "
                    f"{info.get('state')}, unchanged for {now - self._seen[node][1]:.0f} s)"
                )
        if 1 + len(alive) >= self.nnodes:
            self._complete_at = now
            return None
        if now - self._complete_at <= timeout_s:
            return None
        never = self.nnodes - 1 - len(others)
        return (
            f"{1 + len(alive)} of {self.nnodes} nodes have a live supervisor for "
            f"{now - self._complete_at:.0f} s (supervisor.node_timeout_s={timeout_s:g})"
            + (f"; not alive: {', '.join(stale)}" if stale else "")
            + (f"; {never} node(s) never started one in this run directory" if never > 0 else "")
            + ": bring the node back (or replace it) and start the same command there, or "
            "requeue the job; the run resumes from its newest durable snapshot"
        )


Peers = FilePeers  # its name before issue 34


def agree(attempt: int, live: Mapping[str, Mapping[str, Any]], nnodes: int) -> tuple[int, bool]:
    """One look at the agreement on the next attempt: (the attempt to propose now, whether
    to start it). ``attempt``: this node's proposal; ``live``: the live peers' files. The
    highest attempt any of them proposes or runs wins (a node that comes back late joins
    the attempt the others wait in); the launcher starts once all ``nnodes`` are alive and
    at it, so a peer still in an older attempt (it ends it on seeing ours, see
    :meth:`FilePeers.ahead`) or still proposing a lower one is waited for."""
    attempts = [int(i.get("attempt", -1)) for i in live.values()]
    top = max([attempt, *attempts])
    return top, 1 + len(live) >= nnodes and all(a == top for a in attempts)


def agree_view(attempt: int, view: Mapping[str, Any], node: str) -> tuple[int, bool]:
    """:func:`agree` from the store's view (launch/store_view.py): the view's ``top`` is the
    highest attempt a live node proposes or runs, ``agreed`` whether every node is alive and
    at it (this one included: start only once the view shows our own record at it)."""
    top = max(attempt, int(view.get("top", -1)))
    return top, bool(view.get("agreed")) and int(view.get("top", -1)) == attempt == top
