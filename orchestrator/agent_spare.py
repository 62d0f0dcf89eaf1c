"""The node agent's warm spares (``supervisor.in_place_spares``): processes started ahead of
need that have imported torch and the orchestrator and wait (orchestrator/spare.py), so that
a dead rank's replacement skips the interpreter's start and ``import torch`` (most of the
2 s a fresh replacement cost, issue 33).

A spare is no rank: the agent polls, signals and counts only its ranks, the spare writes no
heartbeat and no journal event, and it runs nothing until it is handed a rank, through a
pipe only the agent holds; if the agent dies, the kernel SIGKILLs it (``PR_SET_PDEATHSIG``)
and its pipe reads end of file, so it exits having run nothing. Once handed a rank it is
that rank: the agent keeps its ``Popen``, its exit code and signals are a fresh rank's.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("orchestrator.agent")
PIPE_BYTES = 1 << 20  # the assignment (the rank's environment) fits, so the write never blocks
# What may differ between the spare's environment and a rank's: torchrun's per-rank variables
# (agent_ranks.Layout.env), the generation's store and the generation. Nothing here is read
# before the script runs, by the interpreter, libgomp, MKL or CUDA.
PER_RANK = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
    "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "MASTER_ADDR", "MASTER_PORT", "ORCHESTRATOR_INPLACE_GEN",
})  # fmt: skip


def target(cmd: list[str]) -> tuple[bool, str, list[str]] | None:
    """(``-m``, the script or module, its arguments) of a rank's command as
    agent_ranks.rank_command builds it; None when a spare cannot run it (``--no-python``)."""
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-u":
        return None
    if cmd[2] == "-m":
        return (True, cmd[3], cmd[4:]) if len(cmd) > 3 else None
    return False, cmd[2], cmd[3:]


@dataclass
class Spare:
    """One waiting spare: its process and the agent's end of its pipe."""

    proc: subprocess.Popen[bytes]
    fd: int

    def close(self) -> None:
        """Stop it (SIGKILL: it holds nothing) and reap it."""
        os.close(self.fd)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@dataclass
class Spares:
    """Up to ``count`` warm spares of this node's ranks."""

    count: int
    cmd: list[str]  # the ranks' command (agent_ranks.rank_command)
    env: dict[str, str]  # the ranks' common environment: the spare starts with it
    idle: list[Spare] = field(default_factory=list)

    def refill(self, preexec: Callable[[], None]) -> None:
        """Start spares until ``count`` are alive (a dead one is reaped and replaced);
        ``preexec``: the ranks' ``preexec_fn`` (PR_SET_PDEATHSIG)."""
        if target(self.cmd) is None:
            return
        for s in [s for s in self.idle if s.proc.poll() is not None]:
            logger.warning("agent: spare %d ended unused (%s)", s.proc.pid, s.proc.returncode)
            self.idle.remove(s)
            s.close()
        while len(self.idle) < self.count:
            self.idle.append(self._start(preexec))

    def _start(self, preexec: Callable[[], None]) -> Spare:
        r, w = os.pipe()
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        fcntl.fcntl(w, fcntl.F_SETFL, os.O_NONBLOCK)  # a payload too big fails, never blocks
        cmd = [sys.executable, "-u", "-m", "orchestrator.spare", str(r), str(os.getpid())]
        try:  # its own session, as the ranks (agent_ranks.Ranks._start)
            proc = subprocess.Popen(
                cmd, env=self.env, pass_fds=(r,), start_new_session=True,
                preexec_fn=preexec,
            )  # fmt: skip
        finally:
            os.close(r)  # a dead spare's pipe then fails the agent's write (EPIPE)
        return Spare(proc, w)

    def take(self, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """Hand a rank (its whole environment) to a live spare: the spare's process, now
        that rank's; None when none can take it (the caller starts a fresh process)."""
        found = target(self.cmd)
        if found is None or not self._same_start(env):
            return None
        module, script, args = found
        payload = json.dumps(
            {"env": env, "cwd": os.getcwd(), "module": module, "target": script, "args": args}
        ).encode()
        if len(payload) > PIPE_BYTES:
            return None
        while self.idle:
            spare = self.idle.pop(0)
            try:
                if spare.proc.poll() is not None or os.write(spare.fd, payload) != len(payload):
                    raise OSError(f"spare {spare.proc.pid} exited ({spare.proc.returncode})")
            except OSError as e:  # dead, or a payload over the pipe's size: a fresh rank
                logger.warning("agent: spare not used (%s): starting a fresh process", e)
                spare.close()
                continue
            os.close(spare.fd)  # end of file: the spare runs the rank
            return spare.proc
        return None

    def _same_start(self, env: dict[str, str]) -> bool:
        """Whether ``env`` differs from the spares' only in variables read after start."""
        keys = env.keys() | self.env.keys()
        return all(env.get(k) == self.env.get(k) for k in keys - PER_RANK)

    def close(self) -> None:
        for s in self.idle:
            s.close()
        self.idle = []
