"""Files of the run directory written by one process and read by others, and starting a new
run in a used one (``launch --fresh``, ``Guard(fresh=True)``). Torch-free: the supervisor
imports it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time

import yaml

from orchestrator.policy import Policy
from orchestrator.protocol import (
    ARCHIVE_DIR,
    SUPERVISORS_DIR,
    local_tier_key,
    node_name,
    shm_root,
)


def write_atomic(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: a reader in another process sees the old
    file or the new one, never half of one."""
    write_bytes(path, text.encode())


def write_bytes(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (see :func:`write_atomic`). A write that
    fails (a full disk) leaves no temporary file behind to hold the space."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# A full file system: a new file cannot get blocks, but one that has them can be rewritten.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
RECORD_BYTES = 2048  # a small record file's fixed size (heartbeats, supervisor files)


def write_record(path: str, text: str, size: int = RECORD_BYTES) -> None:
    """Replace a small record file that is read while it is written (a heartbeat, a
    supervisor's file): atomically, padded to ``size`` bytes (JSON readers ignore the
    trailing spaces), and on a full file system in place, into the blocks the file already
    holds, so that a run directory that fills up does not silence it. A reader may then
    catch a write half done: it fails to parse and is read again at the next poll.

    Raises:
        OSError: the record cannot be written at all (read-only, I/O error, or full and
            not written before).
    """
    body = text.encode()
    try:
        write_bytes(path, _padded(body, size))
    except OSError as err:
        if err.errno not in NO_SPACE:
            raise
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            raise err from None  # not written before: no blocks to reuse
        try:
            held = os.fstat(fd).st_size
            if len(body) >= held:
                raise err from None  # would need blocks the file does not have
            os.pwrite(fd, _padded(body, held), 0)
        finally:
            os.close(fd)


def _padded(body: bytes, size: int) -> bytes:
    """``body`` and spaces up to ``size`` bytes, ending in a newline (at least the newline)."""
    return body + b" " * max(size - len(body) - 1, 0) + b"\n"


def write_policy(path: str, policy: Policy) -> None:
    """The resolved policy as YAML, atomically (the other half and ``status`` read it)."""
    write_atomic(path, yaml.safe_dump(policy.model_dump(mode="json"), sort_keys=False))


def archive_run_dir(run_dir: str, policy: Policy) -> list[str]:
    """Start a new run in a used directory: move what earlier runs left in ``run_dir``
    (journal, ledger, metrics, snapshots, ...) to ``run_dir/archive/<time>/``, so the new
    run neither resumes from it nor prunes its snapshots; drop the node-local copy (a cache
    of the durable one). Returns what to tell the user."""
    said = []
    keep = (ARCHIVE_DIR, SUPERVISORS_DIR)  # the running supervisor's lock stays
    old = [e for e in os.listdir(run_dir) if e not in keep] if os.path.isdir(run_dir) else []
    if old:
        dest = os.path.join(run_dir, ARCHIVE_DIR, time.strftime("%Y%m%d-%H%M%S"))
        os.makedirs(dest)
        for entry in old:
            os.rename(os.path.join(run_dir, entry), os.path.join(dest, entry))
        said.append(f"the earlier run's files are in {dest}")
    if policy.persist.local_dir:
        shutil.rmtree(
            os.path.join(policy.persist.local_dir, local_tier_key(run_dir)), ignore_errors=True
        )
    # An earlier run's shared-memory ring on this node: the new run must not resume from it.
    shutil.rmtree(shm_root(policy.snapshot.shm_dir, run_dir, node_name()), ignore_errors=True)
    if policy.persist.url:
        said.append(
            f"persist.url {policy.persist.url} is not moved; if it holds the earlier run's "
            "snapshots the new run resumes from them: give it a new location"
        )
    return said
