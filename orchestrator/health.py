"""Health checks: is a rank's hardware (or its link) lying?

Three checks, each returning evidence per rank, all on a process group of their own: a rank
that does not answer makes the others fail the check in bounded time instead of hanging with
it. Backend-agnostic: the group has the backend of the Guard's group (NCCL on GPU, gloo on
CPU), and both take the same path:

* every collective is issued with ``async_op=True`` and waited for on the host, polling
  ``work.is_completed()`` against the check's deadline (the first ``_COLLECTIVE_SHARE`` of
  ``health.timeout_s``). NCCL's ``work.wait()`` only orders streams, and its group timeout
  only arms the watchdog (which, by default, kills the process): neither bounds a host wait.
  The group's own timeout is longer than the check (``_GROUP_TIMEOUT_FACTOR``), so our
  deadline always comes first. A collective that misses it has its group aborted and
  abandoned (never destroyed: that can wait for the peer that never came);
* the evidence is exchanged through the default group's store (torchrun's TCPStore), not a
  collective, polled until ``_GATHER_SHARE`` of ``health.timeout_s``: a rank that never came
  (``absent``), or came and never reported (``silent``: stopped, hung, dead), is named by the
  others, with its host;
* the communicator is created when the checker is (one tiny collective at start), not at
  the incident: on NCCL creating it costs GPU memory and blocks the host until every rank
  joins.

* collectives: ``all_gather`` and ``broadcast`` of known patterns, every value compared
  exactly. Every rank checks what every other rank sent, so a rank whose data arrives
  wrong is named by the others; ``all_reduce`` of the same patterns checks the reduction.
* bandwidth: a timed ``all_reduce`` of ``health.bandwidth_mb``, compared with the baseline
  measured at preflight. Below ``min_bandwidth_ratio`` of it fails; the ranks that arrived
  last (the least time spent waiting inside the collective) are named.
* compute: the same seeded matmul on every rank, at IEEE fp32 whatever the script set
  (TF32, ``set_float32_matmul_precision``: :func:`ieee_fp32`), compared with an fp64
  reference, and its checksum gathered (odd ones out are evidence); a memory pattern written
  and read back.

Runs only at start (``health.preflight``), on incidents (``health.on_incident``) and as
``orchestrator health``: never in a healthy step.
"""

from __future__ import annotations

import ctypes
import json
import logging
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.comm import Comm
from orchestrator.health_checks import _PATTERN, HealthChecks, ieee_fp32
from orchestrator.health_verdict import BASELINE, HealthReport, HealthVerdict
from orchestrator.policy_sections import DiagnosePolicy, HealthPolicy

__all__ = ["BASELINE", "_PATTERN", "HealthChecker", "HealthReport", "HealthTimeout", "ieee_fp32"]

logger = logging.getLogger(__name__)
# The share of health.timeout_s the collectives of a check get on each rank; the rest is for
# the exchange of the evidence through the store (a rank that came late still reports).
_COLLECTIVE_SHARE = 0.75
# ...and the share by which every rank's evidence must be in the store: the rest is for the
# verdict, so that the check ends within health.timeout_s.
_GATHER_SHARE = 0.95
# The health group's own timeout, in health.timeout_s: longer than any wait of ours, so that
# NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING=3 kills the process) never fires first.
_GROUP_TIMEOUT_FACTOR = 2.0
_POLL_MAX_S = 0.001  # the longest pause between two looks at a collective (timing resolution)
_STORE_POLL_MAX_S = 0.2  # ...and at the store (one request per look, from every rank)

# Aborted health groups, with their pending work and its tensors: kept, never freed. Freeing
# a gloo group joins its worker threads, which stay in the collective the absent rank never
# joined until the group's timeout; and a worker thread that frees a tensor during
# interpreter finalization aborts the process (orchestrator/comm.py, fence_gloo_at_exit).
# The list itself is leaked (one reference more), so finalization does not free it either.
_ABANDONED: list[Any] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_ABANDONED))


class HealthTimeout(RuntimeError):
    """A collective of the health group did not complete within the check's deadline."""


def _default_store() -> Any:
    """The default process group's store (torchrun's TCPStore), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not initialized by torchrun & co.: no roll call
        return None


class HealthChecker(HealthChecks, HealthVerdict):
    """Build on every rank of ``comm``'s group at start (creating the health group is
    collective, and so is its first, tiny, collective), then call :meth:`run` on every rank
    together."""

    @classmethod
    def for_policy(
        cls, h: HealthPolicy, d: DiagnosePolicy, comm: Comm, run_dir: str
    ) -> HealthChecker | None:
        """A checker if the policy's ``health`` and ``diagnose`` sections run health checks
        anywhere (preflight, on incidents, or as a diagnosis action), else None."""
        actions = d.actions.values()
        if h.preflight or h.on_incident or (d.rerun and any("health" in a for a in actions)):
            return cls(h, comm, run_dir)
        return None

    def __init__(self, policy: HealthPolicy, comm: Comm, run_dir: str | None) -> None:
        self.policy = policy
        self.comm = comm
        self.run_dir = run_dir
        self.host = socket.gethostname()
        self.group: dist.ProcessGroup | None = None
        self.device = torch.device("cpu")
        self._broken: str | None = None  # why the health group cannot be used again
        self._deadline = 0.0  # monotonic: the collectives of the check under way end by then
        self._in_flight: list[Any] = []  # the collective waited for, and its tensors
        self._multi = comm.enabled and comm.world_size > 1
        # The roll call and the evidence go through the process group's store, not a
        # collective: a rank that never enters a check, or never reports, is named by the
        # ones that did, with its host. Keyed by this checker's generation, taken before the
        # group's first collective (see _generation).
        self._store = _default_store() if self._multi else None
        self._prefix = self._generation()
        self._round = 0
        if self._multi:
            backend = dist.get_backend(comm.group)
            ranks = dist.get_process_group_ranks(comm.group)
            # Its own group: a timed-out collective leaves a group unusable. Its timeout is
            # longer than any wait of a check: the check's own deadline ends a wait first.
            # Only this group's ranks take part, and a subgroup's name is the hash of its
            # ranks salted with the number of groups alive: a checker built after an earlier
            # one closed (destroyed its group) gets the same name, and gloo then reads the
            # earlier group's addresses from the store (connection refused). A group of the
            # whole world, where every rank takes part anyway, takes torch's sequential name
            # instead, never reused in the process.
            self.group = dist.new_group(
                ranks=ranks,
                backend=backend,
                timeout=timedelta(seconds=_GROUP_TIMEOUT_FACTOR * policy.timeout_s),
                use_local_synchronization=len(ranks) < dist.get_world_size(),
            )
            if backend == "nccl":
                self.device = comm._device()  # the model's device (the Guard's), not cuda:0
            self._connect()
        elif torch.cuda.is_available():
            own = comm.device  # the model's (the Guard's), else the current device
            cuda = torch.device("cuda", torch.cuda.current_device())
            self.device = own if own is not None and own.type == "cuda" else cuda
        self._call(f"host/{comm.rank}", self.host)

    def _generation(self) -> str:
        """This checker's key prefix in the store: the group's ranks and this checker's
        generation. Another checker on the same group and store (a second Guard in the
        process after the first closed) counts its rounds from 1 again: without the
        generation it would read the first one's roll call and evidence as its own.

        Agreed without a collective: every rank adds 1 to a counter under the group's prefix
        here, before the health group's first collective (:meth:`_connect`), so no rank
        adds for checker k+1 before every rank added for checker k: checker k reads a value
        in ((k-1) * world, k * world] on every rank."""
        prefix = "orchestrator/health/" + ",".join(
            str(r) for r in (dist.get_process_group_ranks(self.comm.group) if self._multi else [])
        )
        if self._store is None:
            return prefix
        try:
            count = int(self._store.add(f"{prefix}/checkers", 1))
        except Exception:  # no roll call then (as without a store): the checks decide
            self._store = None
            return prefix
        return f"{prefix}/{(count - 1) // self.comm.world_size + 1}"

    def _connect(self) -> None:
        """Create the communicator now, while every rank is here and memory is plentiful
        (NCCL creates it at a group's first collective, blocking the host until every rank
        joins: at an incident that could be a rank that never comes)."""
        self._deadline = time.monotonic() + self.policy.timeout_s
        try:
            t = torch.zeros(1, device=self.device)
            self._settle(dist.all_reduce(t, group=self.group, async_op=True), t)
        except Exception as err:  # every check's collectives then fail, naming why
            self._abandon(f"the health group could not be created: {type(err).__name__}: {err}")

    # --- the run ----------------------------------------------------------------------------
    def run(self, reason: str) -> HealthReport:
        """Run every check on this rank and gather every rank's evidence; never longer than
        about ``health.timeout_s`` (a rank absent or stopped is named, not waited for).
        Collective: call it on every rank of the group."""
        t0 = time.perf_counter()
        start = time.monotonic()
        self._round += 1
        self._deadline = start + _COLLECTIVE_SHARE * self.policy.timeout_s
        self._call(f"{self._round}/{self.comm.rank}", "here")
        checks: dict[str, dict[str, Any]] = {
            "compute": self._compute(),
            "memory": self._memory(),
        }
        if self._multi:
            checks["collectives"] = self._guarded(self._collectives)
            checks["bandwidth"] = self._guarded(self._bandwidth)
        mine: dict[str, Any] = {"rank": self.comm.rank, "host": self.host, "checks": checks}
        if self.comm.rank == 0 and "bandwidth" in checks:
            mine["baseline_gbps"] = self._read_baseline()  # every rank judges against it
        ranks = self._gather(mine, start + _GATHER_SHARE * self.policy.timeout_s)
        baseline = ranks[0].pop("baseline_gbps", None) if ranks[0]["rank"] == 0 else None
        report = HealthReport(reason=reason, ranks=ranks)
        # Who never came, or never reported? (Not known without the store: then each rank
        # judges its own view.)
        if len(ranks) < self.comm.world_size and "gather" not in checks:
            report.absent, report.silent = self._absent({r["rank"] for r in ranks})
        self._judge(report, baseline)
        report.seconds = time.perf_counter() - t0
        return report

    def _call(self, key: str, value: str) -> None:
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/{key}", value)
            except Exception:  # the roll call only names culprits; the checks decide
                self._store = None

    def _absent(self, present: set[int]) -> tuple[dict[int, str], dict[int, str]]:
        """The ranks whose evidence is missing (rank -> host), from the roll call: those
        that never entered this round, and those that entered and never reported."""
        absent: dict[int, str] = {}
        silent: dict[int, str] = {}
        for r in range(self.comm.world_size):
            if r in present:
                continue
            host, entered = "?", False
            if self._store is not None:
                try:
                    entered = self._store.check([f"{self._prefix}/{self._round}/{r}"])
                    host_key = f"{self._prefix}/host/{r}"
                    if self._store.check([host_key]):
                        host = self._store.get(host_key).decode()
                except Exception:  # the store is gone: the rank is named all the same
                    pass
            (silent if entered else absent)[r] = host
        return absent, silent

    def _guarded(self, check: Any) -> dict[str, Any]:
        """A check whose collective fails or times out fails, with the error as evidence;
        the health group is then abandoned."""
        if self._broken is not None:
            return {"ok": False, "error": self._broken}
        try:
            result: dict[str, Any] = check()
            return result
        except Exception as err:  # HealthTimeout, or gloo/NCCL errors of a broken link
            why = f"{type(err).__name__}: {err}"[:300]
            self._abandon(why)
            return {"ok": False, "error": why}

    def _settle(self, work: Any, *tensors: torch.Tensor) -> None:
        """Wait on the host for ``work`` (a collective issued with ``async_op=True``) until
        the check's deadline: NCCL's ``work.wait()`` would only make the current stream
        wait, and a host sync on the result would then block for as long as a peer stays
        away. Keeps ``work`` and its ``tensors`` for :meth:`_abandon` while waiting.

        Raises:
            HealthTimeout: the collective did not complete in time.
            RuntimeError: it failed (a peer left, the group was aborted).
        """
        self._in_flight = [work, *tensors]
        spin_until = time.monotonic() + (0.01 if self.device.type == "cuda" else 0.0)
        pause = 1e-5
        while not work.is_completed():
            now = time.monotonic()
            if now >= self._deadline:
                raise HealthTimeout(
                    "a collective of the health check did not complete within "
                    f"{_COLLECTIVE_SHARE:g} x health.timeout_s={self.policy.timeout_s:g} s"
                )
            if now >= spin_until:  # a GPU collective takes micro-seconds: look often first
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
        work.wait()  # complete: raises its error, if any; never blocks the host now
        self._in_flight = []

    def _abandon(self, why: str) -> None:
        """Abort the health group after a collective failed or timed out, and keep it (and
        the collective still in flight) for good: destroying a broken group can wait for the
        peer that never came. Later checks fail at once, saying ``why``."""
        self._broken = why
        group, self.group = self.group, None
        if group is None:
            return
        _ABANDONED.append((group, self._in_flight))
        self._in_flight = []
        try:
            dist.distributed_c10d._abort_process_group(group)
        except Exception as err:  # still abandoned: no collective is issued on it again
            logger.warning("rank %d: aborting the health group: %r", self.comm.rank, err)

    def _gather(self, mine: dict[str, Any], deadline: float) -> list[dict[str, Any]]:
        """Every rank's evidence through the store, in rank order: those that reported by
        ``deadline`` (monotonic). Never a collective: an absent rank cannot block it."""
        if not self._multi:  # a single rank: nobody to hear from
            return [mine]
        me, world = self.comm.rank, self.comm.world_size
        keys = [f"{self._prefix}/{self._round}/evidence/{r}" for r in range(world)]
        try:
            if self._store is None:
                raise RuntimeError("no store to exchange the evidence through")
            self._store.set(keys[me], json.dumps(mine))
            # Counted as they come: a poll reads one number, where a check of every key
            # costs the one store O(world), from every rank (docs/scale.md). Polled, never
            # store.wait(timeout): a client's wait that timed out leaves the server's answer
            # on its socket, to be read as the answer to a later request.
            count = f"{self._prefix}/{self._round}/reported"
            reported, pause = self._store.add(count, 1), 0.005
            while reported < world and time.monotonic() < deadline:
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
                pause = min(2 * pause, _STORE_POLL_MAX_S)
                reported = self._store.add(count, 0)
            every = reported >= world and self._store.check(keys)  # once, to be sure
            # A look per key only when some are missing: from every rank, that is world^2
            # requests on the one store.
            present = keys if every else [k for k in keys if self._store.check([k])]
            values = dict(zip(present, self._store.multi_get(present), strict=True))
        except Exception as err:  # only this rank's own view is known
            mine["checks"]["gather"] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
            return [mine]
        return [mine if r == me else json.loads(values[k]) for r, k in enumerate(keys)
                if r == me or k in values]  # fmt: skip

    def close(self, abort: bool = False) -> None:
        """Release the health group: destroyed after a clean run; aborted with ``abort``
        (the run ends on an error: destroying an NCCL group can wait for a peer that left or
        hangs). A group a failed check abandoned is already aborted."""
        group, self.group = self.group, None
        if group is None:
            return
        if abort:
            _ABANDONED.append((group, []))
            try:
                dist.distributed_c10d._abort_process_group(group)
            except Exception as err:  # at the end: said, never raised
                logger.warning("rank %d: aborting the health group: %r", self.comm.rank, err)
        else:
            dist.destroy_process_group(group)
