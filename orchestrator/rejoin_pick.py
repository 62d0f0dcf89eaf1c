"""The parts of in-place recovery (orchestrator/rejoin.py) that hold no Guard state: the
environment the agent sets, the control store, the agreement's choice of the step and of
each rank's source, and the checksum a peer's copy is checked by."""

from __future__ import annotations

import os
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.comm import Comm
from orchestrator.inplace_protocol import (
    ENV_CONTROL_ADDR,
    ENV_CONTROL_PORT,
    ENV_GENERATION,
    ENV_INPLACE,
    NEXT_WAIT_S,
)


class RejoinFailed(RuntimeError):
    """The in-place path cannot go on here (why): the collective's error is raised instead."""


def inplace_on() -> bool:
    """This rank runs under the agent, with in-place recovery on."""
    return os.environ.get(ENV_INPLACE) == "1"


def started_generation() -> int:
    """The generation this process was started in (0: the attempt's start)."""
    return int(os.environ.get(ENV_GENERATION, "0") or 0)


def replacement_start(comm: Comm) -> Comm:
    """``comm``, solo when this process replaces a dead rank: the survivors run no start-up
    collectives, so its Guard starts without any (until ``Rejoin.join``)."""
    comm.solo = inplace_on() and started_generation() > 0 and comm.world_size > 1
    return comm


def control_store() -> dist.TCPStore:
    """A client of the agent's control store."""
    return dist.TCPStore(
        os.environ[ENV_CONTROL_ADDR],
        int(os.environ[ENV_CONTROL_PORT]),
        is_master=False,
        timeout=timedelta(seconds=NEXT_WAIT_S),
    )


def group_timeout() -> timedelta:
    """The default group's timeout, kept for the next generation's group."""
    try:
        pg = dist.group.WORLD
        assert pg is not None
        backend = pg._get_backend(torch.device("cpu"))
        return timedelta(seconds=backend.options._timeout.total_seconds())
    except (AssertionError, AttributeError, RuntimeError):
        return dist.distributed_c10d._get_default_timeout(dist.get_backend())


def pick(said: list[dict[str, Any]]) -> tuple[int, dict[int, str]]:
    """The step every rank resumes from and each rank's source (by global rank), the same
    on every rank: the newest step every survivor holds sealed in its ring that every
    replacement loads from its own shared-memory slot or its durable part (exact: its own
    RNG and data position; the slot first), else the newest the survivors hold, the
    replacements taking a survivor's copy.

    Raises:
        RejoinFailed: no such step, or a replacement that no source fits.
    """
    rings = [set(s["ring"]) for s in said if not s["replacement"]]
    common = set.intersection(*rings) if rings else set()
    news = [s for s in said if s["replacement"]]
    exact = set(common)  # a replacement's own slot in shared memory first, then durable
    for s in news:
        exact &= set(s.get("shm", [])) | set(s["durable"])
    if exact:
        step = max(exact)
        own = {s["rank"]: "shm" if step in s.get("shm", []) else "durable" for s in news}
    elif common and all(s["peer"] for s in news):
        step, own = max(common), {s["rank"]: "peer" for s in news}
    else:
        raise RejoinFailed(
            f"no step that every survivor's ring holds and every replacement can load "
            f"({said}): in-place recovery falls back"
        )
    return step, {s["rank"]: own[s["rank"]] if s["replacement"] else "ring" for s in said}


def crc_of(tree: Any) -> int:
    """CRC32 of every tensor of ``tree`` (and the repr of everything else), in order."""
    crc = 0
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x[k] for k in sorted(x, key=str, reverse=True))
        elif isinstance(x, (list, tuple)):
            stack.extend(reversed(x))
        elif isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            crc = zlib.crc32(t.view(torch.uint8).numpy().tobytes(), crc)
        else:
            crc = zlib.crc32(repr(x).encode(), crc)
    return crc
