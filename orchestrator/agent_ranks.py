"""The node agent's ranks: one process per local rank, started with torchrun's environment
contract (docs/dev/issue-33-design.md 1.3) plus the in-place protocol's variables
(orchestrator/inplace_protocol.py), each in its own session as torchrun's workers are, so
the agent forwards the signals it gets, as torchrun does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator import inplace_protocol as IP
from orchestrator.agent_spare import Spares

STOP_TIMEOUT_S = 30.0  # torchrun's PContext.close(timeout=30): SIGTERM, then SIGKILL
_PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    if sys.platform != "linux":
        return None
    import ctypes

    return ctypes.CDLL(None, use_errno=True).prctl


# Resolved in the parent: between fork and exec (preexec_fn) nothing may load or lock.
_PRCTL = _prctl()


def _die_with_agent() -> None:
    """A rank outlives no agent (killed by SIGKILL too: the supervisor's escalation): the
    stores its process group and the in-place protocol use live in the agent of node 0."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass(frozen=True)
class Layout:
    """Where this node's ranks sit in the job (torchrun's _assign_worker_ranks, one role)."""

    nproc: int  # LOCAL_WORLD_SIZE
    group_rank: int  # this node's rank among the nodes
    group_world_size: int  # nodes
    base_rank: int  # global rank of local rank 0
    world_size: int
    run_id: str

    def env(self, local: int) -> dict[str, str]:
        """torchrun's per-worker variables for local rank ``local``."""
        rank = str(self.base_rank + local)
        return {
            "RANK": rank,
            "LOCAL_RANK": str(local),
            "GROUP_RANK": str(self.group_rank),
            "ROLE_RANK": rank,
            "ROLE_NAME": "default",
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "WORLD_SIZE": str(self.world_size),
            "GROUP_WORLD_SIZE": str(self.group_world_size),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(True),
        }


@dataclass
class Rank:
    """One local rank's current process."""

    local: int
    rank: int
    proc: subprocess.Popen[bytes]
    gen: int
    started: float = field(default_factory=time.time)
    spare: bool = False  # a warm spare took it (orchestrator/agent_spare.py)

    def poll(self) -> int | None:
        return self.proc.poll()


@dataclass
class Ranks:
    """The node's ranks: start, replace, signal, stop."""

    layout: Layout
    cmd: list[str]  # what every rank runs: python -u script.py args...
    base_env: dict[str, str]  # the agent's environment plus what is the same for every rank
    ranks: list[Rank] = field(default_factory=list)
    spares: Spares | None = None  # warm spares for replacements (supervisor.in_place_spares)

    def start_all(self, master: tuple[str, int], gen: int) -> None:
        self.ranks = [self._start(local, master, gen) for local in range(self.layout.nproc)]
        self.refill_spares()

    def refill_spares(self) -> None:
        """Start the warm spares that are missing (at the start; after one was used, once
        its generation formed: not while the survivors wait on the replacement)."""
        if self.spares is not None:
            self.spares.refill(_die_with_agent)

    def close_spares(self) -> None:
        if self.spares is not None:
            self.spares.close()

    def replace(self, local: int, master: tuple[str, int], gen: int) -> Rank:
        """Start local rank ``local`` again, alone, in generation ``gen``: a warm spare
        when one is alive, else a fresh process."""
        new = self._start(local, master, gen, spare=True)
        self.ranks[local] = new
        return new

    def _start(self, local: int, master: tuple[str, int], gen: int, spare: bool = False) -> Rank:
        env = {
            **self.base_env,
            **self.layout.env(local),
            "MASTER_ADDR": master[0],
            "MASTER_PORT": str(master[1]),
            IP.ENV_GENERATION: str(gen),
        }
        taken = self.spares.take(env) if spare and self.spares is not None else None
        # torchrun's workers run in their own sessions: a signal to the agent's group
        # reaches the agent, which forwards it (the supervisor's launcher holds every
        # descendant by pidfd anyway).
        proc = taken or subprocess.Popen(
            self.cmd, env=env, start_new_session=True, preexec_fn=_die_with_agent
        )
        return Rank(local, self.layout.base_rank + local, proc, gen, spare=taken is not None)

    def send(self, sig: int) -> None:
        for r in self.ranks:
            if r.poll() is None:
                try:
                    r.proc.send_signal(sig)
                except ProcessLookupError:  # exited between the poll and the signal
                    pass

    def wait_all(self, timeout: float | None) -> bool:
        """Wait until every rank exited, at most ``timeout`` s; whether they all did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(r.poll() is None for r in self.ranks):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every rank as torchrun's PContext.close does: ``sig``, then SIGKILL."""
        self.send(sig)
        if not self.wait_all(timeout):
            self.send(signal.SIGKILL)
            self.wait_all(None)


def rank_command(script: str, args: list[str], module: bool, no_python: bool) -> list[str]:
    """What torchrun runs for each worker (run.py: ``python -u script args``)."""
    if no_python:
        return [script, *args]
    return [sys.executable, "-u", *(["-m"] if module else []), script, *args]


def common_env(nproc: int, in_place: bool) -> dict[str, str]:
    """The agent's environment plus what torchrun adds for every worker."""
    env = dict(os.environ)
    if nproc > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default for several workers per node
    # 1 (torchrun's default) lets NCCL's watchdog tear the process down; in place, the
    # survivor must live: 2 (CleanUpOnly) aborts the communicator only.
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2" if in_place else "1")
    if in_place:
        env[IP.ENV_INPLACE] = "1"
    else:
        env.pop(IP.ENV_INPLACE, None)
    return env
