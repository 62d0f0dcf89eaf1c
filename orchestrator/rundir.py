"""Files of the run directory written by one process and read by others, and starting a new
run in a used one (``launch --fresh``, ``Guard(fresh=True)``). Torch-free: the supervisor
imports it."""

from __future__ import annotations

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
    """Replace ``path`` with ``data`` atomically (see :func:`write_atomic`)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


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
