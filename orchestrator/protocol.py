"""The protocol between the two halves: what the supervisor (``launch/``) and the Guard in
every rank (``orchestrator/``) agree on. They talk only through environment variables, the
run directory and exit codes (ARCHITECTURE), so those are named here, once.

Torch-free on purpose: the supervisor imports this (and the policy), never torch, so
``orchestrator launch`` runs, and stays small, in an environment that only launches.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket

# --- environment: set by the supervisor, read by the Guard ---------------------------------
ENV_RUN_DIR = "ORCHESTRATOR_RUN_DIR"  # the run directory every rank writes into
ENV_ATTEMPT = "ORCHESTRATOR_ATTEMPT"  # the supervisor's attempt number (journaled by ranks)
ENV_POLICY = "ORCHESTRATOR_POLICY"  # path of the policy YAML
# The supervisor's pid: a rank ends itself when that process is gone (orchestrator/lifeline.py).
ENV_SUPERVISOR_PID = "ORCHESTRATOR_SUPERVISOR_PID"
# The node's name (default: the hostname); set it to simulate several nodes on one machine.
ENV_NODE = "ORCHESTRATOR_NODE"
# The node's shared-memory folder of the run (snapshot.shared_memory), owned by the supervisor.
ENV_SHM_DIR = "ORCHESTRATOR_SHM_DIR"
# The key that signs durable manifests (HMAC-SHA256); persist.signing_key_file otherwise.
ENV_SIGNING_KEY = "ORCHESTRATOR_SIGNING_KEY"
ENV_ALLOW_GLOBALS = "ORCHESTRATOR_ALLOW_GLOBALS"  # more classes engine files may hold
# Test-only: a YAML file with a list of faults (the policy's ``faults`` format), injected
# besides the policy's own: the drill keeps its faults apart from the policy it tests.
ENV_FAULTS = "ORCHESTRATOR_FAULTS"

# --- worker exit codes (README "Exit codes"); the supervisor classifies on them -------------
EXIT_OK = 0
# A budget spent (incidents, bad data), or input a restart cannot fix (a quarantine ledger
# that does not parse): restarting would loop, do not restart. The journal's gave_up says.
EXIT_GAVE_UP = 71
EXIT_UNHEALTHY = 72  # a health check failed on this rank: restart elsewhere / evict the node
EXIT_PREEMPTED = 73  # stopped on request after a durable snapshot: requeue
# Stopped on request with NO durable snapshot written (a full or failing store, a write past
# supervisor.grace_s), or signalled and the workers did not stop as preempted: 128+SIGTERM.
# Requeue at will; it resumes from an older snapshot (the preempted event says how old).
EXIT_STOPPED = 143
# Supervisor only (``orchestrator launch``):
EXIT_CRASH_LOOP = 74  # attempts in a row made no progress: a bug or a broken node, not luck
EXIT_RESTARTS_EXHAUSTED = 75  # supervisor.max_restarts spent
EXIT_LOCKED = 76  # another supervisor runs this node of this run directory: do not requeue
EXIT_NODE_LOST = 77  # a node's supervisor was not seen for supervisor.node_timeout_s
EXIT_CANNOT_START = 78  # the command cannot be started at all (not found, not executable)

# --- the run directory ----------------------------------------------------------------------
JOURNAL_DIR = "journal"  # journal/<node>.jsonl: one event per line, from each node's processes
JOURNAL_NAME = "journal.jsonl"  # the single journal of run directories before per-node files
LEDGER_NAME = "quarantine.jsonl"  # the quarantine ledger (default place)
METRICS_NAME = "metrics.jsonl"  # rank 0's per-step metrics
POLICY_NAME = "policy.yaml"  # the resolved policy
HEARTBEAT_DIR = "heartbeats"  # heartbeats/<node>/rank<r>.json (and .stack)
ATTEMPTS_DIR = "attempts"  # attempts/<n>/ per-attempt logs (supervisor)
SNAPSHOTS_DIR = "snapshots"  # durable snapshots (default persist.url)
EXCLUDE_NAME = "exclude_hosts"  # hosts the health checks named: leave them out on requeue
ARCHIVE_DIR = "archive"  # archive/<time>/: what earlier runs left, moved by launch --fresh
# supervisors/<node>.lock: one supervisor per node (flock); supervisors/<node>.json: its
# liveness, attempt and exit, read by the other nodes' supervisors.
SUPERVISORS_DIR = "supervisors"


def clock_id() -> str:
    """Which CLOCK_MONOTONIC this process reads: the same for every process of one boot of a
    host in one time namespace, whose ``time.monotonic()`` values therefore compare. Empty
    when it cannot be told (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    try:
        return f"{boot}/{os.readlink('/proc/self/ns/time')}"
    except OSError:  # kernels before time namespaces: one monotonic clock per boot
        return boot


def node_name() -> str:
    """This node's name: $ORCHESTRATOR_NODE, else the hostname."""
    return os.environ.get(ENV_NODE) or socket.gethostname()


def node_path(run_dir: str, sub: str, node: str, suffix: str = "") -> str:
    """``RUN_DIR/<sub>/<node><suffix>``, the node's name made safe for a file name."""
    return os.path.join(run_dir, sub, _safe(node) + suffix)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def shm_root(shm_dir: str, run_dir: str, node: str) -> str:
    """The shared-memory folder of a run on a node (orchestrator/shm.py)."""
    return os.path.join(shm_dir, f"orchestrator-{local_tier_key(run_dir)}-{_safe(node)}")


def local_tier_key(run_dir: str) -> str:
    """The node-local tier's directory under ``persist.local_dir`` for a run directory (one
    per run, so runs sharing a node and its /dev/shm never mix)."""
    return hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]


# --- journal events one half writes and the other reads -------------------------------------
# Written by the ranks; the supervisor classifies an attempt by them (torchrun masks the
# workers' own exit codes). "preempting" comes before the snapshot: a worker killed while
# writing it was still preempted.
EVENT_GAVE_UP = "gave_up"
EVENT_UNHEALTHY = "unhealthy"
EVENT_PREEMPTED = "preempted"
EVENT_PREEMPTING = "preempting"
EVENT_RUN_END = "run_end"
# Written by the supervisor.
EVENT_ATTEMPT_START = "attempt_start"
EVENT_ATTEMPT_END = "attempt_end"
EVENT_RESTART = "restart"
EVENT_HANG = "hang"
EVENT_NODE_LOST = "node_lost"
EVENT_FLUSH = "flush"  # by the supervisor's helper (orchestrator/flush.py)
# Buddy replication of the shared-memory ring, by the supervisor (launch/replica.py).
EVENT_REPLICATED, EVENT_REPLICATE_FAILED = "replicated", "replicate_failed"
EVENT_BUDDY_RESTORE = "buddy_restore"
SUPERVISOR_RANK = -1  # the journal's rank field for the supervisor's (and its helper's) events
EVENT_SUPERVISOR_EXIT = "supervisor_exit"
EVENT_STOP_REQUESTED = "stop_requested"  # a SIGTERM/SIGINT reached the supervisor (when)
EVENT_ALERT = "alert"  # the supervisor ran alerts.command
EVENT_EXPORTER = "exporter"  # the supervisor's Prometheus endpoint (its port)
