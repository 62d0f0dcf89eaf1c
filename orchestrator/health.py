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

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import socket
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.comm import Comm
from orchestrator.policy import Policy
from orchestrator.policy_sections import HealthPolicy
from orchestrator.rundir import write_atomic

BASELINE = "health_baseline.json"
logger = logging.getLogger(__name__)
_PATTERN = 4099  # elements per rank in the correctness checks (odd: no alignment luck)
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


@dataclass
class HealthReport:
    """Every rank's evidence (the same list on every rank) and the verdict."""

    reason: str
    ranks: list[dict[str, Any]] = field(default_factory=list)
    bad: dict[int, list[str]] = field(default_factory=dict)  # rank -> failed checks
    bandwidth_gbps: float | None = None
    baseline_gbps: float | None = None
    seconds: float = 0.0
    absent: dict[int, str] = field(default_factory=dict)  # never entered the check -> host
    silent: dict[int, str] = field(default_factory=dict)  # entered, never reported -> host

    @property
    def healthy(self) -> bool:
        return not self.bad

    def hosts(self) -> dict[int, str]:
        """Rank -> host, of every rank known (those that came, and the absent)."""
        return {**self.absent, **self.silent, **{r["rank"]: r["host"] for r in self.ranks}}

    def bad_hosts(self) -> dict[int, str]:
        """Failing rank -> its host."""
        hosts = self.hosts()
        return {r: hosts.get(r, "?") for r in sorted(self.bad)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "healthy": self.healthy,
            "bad_ranks": {str(r): c for r, c in sorted(self.bad.items())},
            "hosts": {str(r): h for r, h in self.hosts().items()},
            "absent": {str(r): h for r, h in self.absent.items()},
            "silent": {str(r): h for r, h in self.silent.items()},
            "bandwidth_gbps": self.bandwidth_gbps,
            "baseline_gbps": self.baseline_gbps,
            "seconds": round(self.seconds, 3),
            "ranks": self.ranks,
        }

    def table(self) -> str:
        """The per-rank table ``orchestrator health`` prints."""
        rows = ["rank  host                  collectives  bandwidth   compute  memory  verdict"]
        for r in self.ranks:
            c = r["checks"]
            bw = c.get("bandwidth", {})
            bw_txt = f"{bw['gbps']:.3f} GB/s" if bw.get("gbps") is not None else "-"
            rows.append(
                f"{r['rank']:<5} {r['host'][:20]:<21} "
                f"{_ok(c.get('collectives')):<12} {bw_txt:<11} "
                f"{_ok(c.get('compute')):<8} {_ok(c.get('memory')):<7} "
                + (
                    "UNHEALTHY: " + ", ".join(self.bad[r["rank"]])
                    if r["rank"] in self.bad
                    else "ok"
                )
            )
        return "\n".join(rows)


def _default_store() -> Any:
    """The default process group's store (torchrun's TCPStore), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # not initialized by torchrun & co.: no roll call
        return None


def _ok(check: dict[str, Any] | None) -> str:
    if check is None:
        return "-"
    return "ok" if check.get("ok") else "FAIL"


@contextlib.contextmanager
def ieee_fp32() -> Iterator[None]:
    """fp32 matmuls at IEEE precision inside, whatever the script set (TF32 through
    ``torch.backends.cuda.matmul.allow_tf32`` or ``set_float32_matmul_precision("high")``,
    bf16 through ``"medium"`` on CPUs with oneDNN, cuDNN's TF32); every setting is restored
    on the way out.

    Set through ``set_float32_matmul_precision("highest")``, which keeps torch's legacy and new
    precision settings consistent (cuBLAS refuses a mix of them); restored through both. A
    legacy setting torch cannot read (the script mixed the two APIs) comes back as the new
    API's values, which are what the kernels follow."""
    b = torch.backends
    ops = (b.cuda.matmul, getattr(b.mkldnn, "matmul"))  # noqa: B009 (not in torch's stubs)
    new = [op.fp32_precision for op in ops]
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # the legacy and new APIs were mixed: torch will not say
        legacy = None
    try:
        cudnn: bool | None = b.cudnn.allow_tf32
    except RuntimeError:
        cudnn = None
    torch.set_float32_matmul_precision("highest")
    if cudnn is not None:
        b.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        if cudnn is not None:
            b.cudnn.allow_tf32 = cudnn
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for op, value in zip(ops, new, strict=True):
            if op.fp32_precision != value:
                op.fp32_precision = value


class HealthChecker:
    """Build on every rank of ``comm``'s group at start (creating the health group is
    collective, and so is its first, tiny, collective), then call :meth:`run` on every rank
    together."""

    @classmethod
    def for_policy(cls, policy: Policy, comm: Comm, run_dir: str) -> HealthChecker | None:
        """A checker if the policy runs health checks anywhere (preflight, on incidents, or
        as a diagnosis action), else None."""
        h, d = policy.health, policy.diagnose
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
        if self._multi:
            backend = dist.get_backend(comm.group)
            ranks = dist.get_process_group_ranks(comm.group)
            # Its own group: a timed-out collective leaves a group unusable. Its timeout is
            # longer than any wait of a check: the check's own deadline ends a wait first.
            self.group = dist.new_group(
                ranks=ranks,
                backend=backend,
                timeout=timedelta(seconds=_GROUP_TIMEOUT_FACTOR * policy.timeout_s),
                use_local_synchronization=True,  # only this group's ranks take part
            )
            if backend == "nccl":
                self.device = comm._device()  # the model's device (the Guard's), not cuda:0
            self._connect()
        elif torch.cuda.is_available():
            own = comm.device  # the model's (the Guard's), else the current device
            cuda = torch.device("cuda", torch.cuda.current_device())
            self.device = own if own is not None and own.type == "cuda" else cuda
        # The roll call and the evidence go through the process group's store, not a
        # collective: a rank that never enters a check, or never reports, is named by the
        # ones that did, with its host.
        self._store = _default_store() if self._multi else None
        self._prefix = "orchestrator/health/" + ",".join(
            str(r) for r in (dist.get_process_group_ranks(comm.group) if self._multi else [])
        )
        self._round = 0
        self._call(f"host/{comm.rank}", self.host)

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
            # Polled, never store.wait(timeout): a client's wait that timed out leaves the
            # server's answer on its socket, to be read as the answer to a later request.
            pause = 0.005
            while not self._store.check(keys) and time.monotonic() < deadline:
                time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
                pause = min(2 * pause, _STORE_POLL_MAX_S)
            present = [k for k in keys if self._store.check([k])]
            values = dict(zip(present, self._store.multi_get(present), strict=True))
        except Exception as err:  # only this rank's own view is known
            mine["checks"]["gather"] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}
            return [mine]
        return [mine if r == me else json.loads(values[k]) for r, k in enumerate(keys)
                if r == me or k in values]  # fmt: skip

    # --- verdict ------------------------------------------------------------------------------
    def _judge(self, report: HealthReport, baseline: float | None) -> None:
        bad: dict[int, list[str]] = {}

        def flag(rank: int, what: str) -> None:
            if what not in bad.setdefault(rank, []):
                bad[rank].append(what)

        for rank in report.absent:
            flag(rank, "absent: never entered the health check (hung or dead)")
        for rank in report.silent:
            flag(rank, "absent: entered the health check but never reported within "
                       "health.timeout_s (stopped, hung or dead)")  # fmt: skip
        missing = report.absent or report.silent
        for r in report.ranks:
            c = r["checks"]
            for name in ("compute", "memory"):
                if not c[name]["ok"]:
                    flag(r["rank"], name)
            coll = c.get("collectives")
            if coll is not None:
                for sender in coll.get("bad_senders", []):  # named by whoever received
                    flag(sender, "collectives")
                timed_out = "error" in coll or "gather" in c
                if timed_out and not missing:  # else the missing rank explains it
                    flag(r["rank"], "collectives (timed out or failed)")
            elif "gather" in c and not missing:
                flag(r["rank"], "collectives (timed out or failed)")
        sums = [r["checks"]["compute"]["checksum"] for r in report.ranks]
        if len(sums) >= 3:  # with 2 ranks there is no majority; the fp64 reference decides
            majority = max(set(sums), key=sums.count)
            for r, digest in zip(report.ranks, sums, strict=True):
                if digest != majority:
                    flag(r["rank"], "compute (result differs from the other ranks')")
        self._judge_bandwidth(report, baseline, flag)
        report.bad = bad

    def _judge_bandwidth(self, report: HealthReport, baseline: float | None, flag: Any) -> None:
        measured = [r["checks"].get("bandwidth") for r in report.ranks]
        if (
            len(measured) < self.comm.world_size
            or not measured
            or any(m is None or m.get("gbps") is None for m in measured)
        ):
            return
        gbps = min(m["gbps"] for m in measured)
        report.bandwidth_gbps = gbps
        if baseline is None:
            self._first_baseline(gbps)
        report.baseline_gbps = baseline
        if baseline is None or gbps >= self.policy.min_bandwidth_ratio * baseline:
            return
        # Everyone waits for the slowest rank inside the collective; the laggard waits least.
        waits = [m["wait_s"] for m in measured]
        cutoff = min(waits) + 0.5 * (statistics.median(waits) - min(waits))
        for r, m in zip(report.ranks, measured, strict=True):
            if m["wait_s"] <= cutoff:
                flag(r["rank"], f"bandwidth {gbps:.3f} GB/s < {self.policy.min_bandwidth_ratio}"
                     f" x baseline {baseline:.3f}")  # fmt: skip

    def _read_baseline(self) -> float | None:
        """Rank 0: the first bandwidth measured in this run directory (at preflight), which
        goes to every rank with rank 0's evidence."""
        if self.run_dir is None:
            return None
        path = os.path.join(self.run_dir, BASELINE)
        # Bookkeeping: a baseline that cannot be read (a damaged file) is said and the check
        # goes on without it.
        try:
            if os.path.exists(path):
                with open(path, encoding="utf-8") as f:
                    return float(json.load(f)["gbps"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.error("rank 0: bandwidth baseline %s: %r; checked without it", path, err)
        return None

    def _first_baseline(self, gbps: float) -> None:
        """Rank 0, at preflight with no baseline yet: keep ``gbps`` as the baseline."""
        if self.run_dir is None or self.comm.rank != 0 or not self.policy.preflight:
            return
        path = os.path.join(self.run_dir, BASELINE)
        try:  # a full disk: said, and the check goes on without a baseline
            if not os.path.exists(path):
                write_atomic(path, json.dumps({"gbps": gbps, "time": time.time()}))
        except OSError as err:
            logger.error("rank 0: bandwidth baseline %s: %r; checked without it", path, err)

    # --- the checks -----------------------------------------------------------------------------
    def _pattern(self, rank: int) -> torch.Tensor:
        """What rank ``rank`` contributes: distinct per rank, exact in float32."""
        base = torch.arange(_PATTERN, dtype=torch.float32, device=self.device)
        return (base % 1021) * (rank + 1) + rank

    def _mine(self) -> torch.Tensor:
        return self._pattern(self.comm.rank)

    def _all_reduce(self, t: torch.Tensor) -> None:
        self._settle(dist.all_reduce(t, group=self.group, async_op=True), t)

    def _collectives(self) -> dict[str, Any]:
        world, group = self.comm.world_size, self.group
        assert group is not None
        bad_senders: set[int] = set()
        # all_gather: every rank checks every other rank's block.
        out = [torch.empty(_PATTERN, device=self.device) for _ in range(world)]
        mine = self._mine()
        self._settle(dist.all_gather(out, mine, group=group, async_op=True), mine, *out)
        for r, got in enumerate(out):
            if r != self.comm.rank and not torch.equal(got, self._pattern(r)):
                bad_senders.add(r)
        # broadcast from every rank in turn.
        for root in range(world):
            t = (
                self._mine()
                if root == self.comm.rank
                else torch.empty(_PATTERN, device=self.device)
            )
            src = dist.get_global_rank(group, root)
            self._settle(dist.broadcast(t, src=src, group=group, async_op=True), t)
            if root != self.comm.rank and not torch.equal(t, self._pattern(root)):
                bad_senders.add(root)
        # all_reduce: the sum of every pattern (exact: small integers in float32).
        t = self._mine()
        self._all_reduce(t)
        expected = sum((self._pattern(r) for r in range(world)), torch.zeros_like(t))
        reduce_ok = torch.equal(t, expected)
        return {
            "ok": not bad_senders and reduce_ok,
            "bad_senders": sorted(bad_senders),
            "all_reduce_ok": reduce_ok,
        }

    def _bandwidth(self) -> dict[str, Any]:
        n = int(self.policy.bandwidth_mb * 2**20) // 4
        buf = torch.ones(n, dtype=torch.float32, device=self.device)
        self._all_reduce(buf)  # warm-up (connections, allocations)
        times: list[float] = []
        waits: list[float] = []
        for _ in range(self.policy.bandwidth_reps):
            self._all_reduce(torch.zeros(1, device=self.device))  # a barrier, bounded
            t0 = time.perf_counter()
            self._pace(times)
            t1 = time.perf_counter()
            self._all_reduce(buf)  # complete on the device when it returns
            t2 = time.perf_counter()
            times.append(t2 - t0)
            waits.append(t2 - t1)
        world = self.comm.world_size
        seconds = statistics.median(times)
        bus_bytes = 2 * (world - 1) / world * n * 4  # what a ring all-reduce moves per rank
        return {
            "ok": True,  # judged against the baseline once every rank's number is known
            "gbps": bus_bytes / seconds / 1e9,
            "seconds": seconds,
            "wait_s": statistics.median(waits),
        }

    def _compute(self) -> dict[str, Any]:
        n = self.policy.compute_size
        g = torch.Generator(device="cpu").manual_seed(1234)
        a = torch.randn(n, n, generator=g).to(self.device)
        c = self._product(a)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ref = a.double() @ a.double()
        err = float(((c.double() - ref).abs() / (ref.abs() + 1.0)).max())
        digest = hashlib.sha256(c.cpu().numpy().tobytes()).hexdigest()[:16]
        # fp32 accumulation over n terms: about n * 2^-24 relative, far below this.
        return {"ok": err < 1e-3, "max_rel_error": err, "checksum": digest}

    def _product(self, a: torch.Tensor) -> torch.Tensor:
        """The self-test's matmul (``a @ a``), at IEEE fp32."""
        with ieee_fp32():  # TF32 (or bf16 on CPU) would miss the threshold on every rank
            return a @ a

    def _pace(self, times: list[float]) -> None:
        """Called as each timed repetition of the bandwidth check starts (``times``: the
        repetitions before it); the time spent here counts, the wait does not. Nothing in a
        real check: a drill slows a rank down here."""

    def _memory(self) -> dict[str, Any]:
        n = int(self.policy.memory_mb * 2**20)
        if n == 0:
            return {"ok": True}
        # i % 251 as bytes (a prime period: no power-of-two stride aliases), built by
        # repeating one period and compared whole: an int32 modulo and an element-wise
        # count over 16 MiB took most of a second on a CPU, at every incident.
        period = torch.arange(251, dtype=torch.uint8, device=self.device)
        expected = period.repeat(-(-n // 251))[:n]
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        buf.copy_(expected)
        if torch.equal(buf, expected):
            return {"ok": True, "mismatches": 0}
        mismatches = int((buf != expected).sum())
        return {"ok": False, "mismatches": mismatches}

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
