"""Health checks: is a rank's hardware (or its link) lying?

Three checks, each returning evidence per rank, all on a process group of their own whose
timeout is ``health.timeout_s``: a rank that does not answer makes the others fail the
check in bounded time instead of hanging with it. Backend-agnostic: the group has the
backend of the Guard's group (NCCL on GPU, gloo on CPU).

* collectives: ``all_gather`` and ``broadcast`` of known patterns, every value compared
  exactly. Every rank checks what every other rank sent, so a rank whose data arrives
  wrong is named by the others; ``all_reduce`` of the same patterns checks the reduction.
* bandwidth: a timed ``all_reduce`` of ``health.bandwidth_mb``, compared with the baseline
  measured at preflight. Below ``min_bandwidth_ratio`` of it fails; the ranks that arrived
  last (the least time spent waiting inside the collective) are named.
* compute: the same seeded matmul on every rank, compared with an fp64 reference, and its
  checksum gathered (odd ones out are evidence); a memory pattern written and read back.

Runs only at start (``health.preflight``), on incidents (``health.on_incident``) and as
``orchestrator health``: never in a healthy step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.comm import Comm
from orchestrator.faults import FaultInjector
from orchestrator.policy import Policy
from orchestrator.policy_sections import HealthPolicy
from orchestrator.rundir import write_atomic

BASELINE = "health_baseline.json"
logger = logging.getLogger(__name__)
_PATTERN = 4099  # elements per rank in the correctness checks (odd: no alignment luck)


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

    @property
    def healthy(self) -> bool:
        return not self.bad

    def hosts(self) -> dict[int, str]:
        """Rank -> host, of every rank known (those that came, and the absent)."""
        return {**self.absent, **{r["rank"]: r["host"] for r in self.ranks}}

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


class HealthChecker:
    """Build on every rank of ``comm``'s group at start (creating the health group is
    collective), then call :meth:`run` on every rank together."""

    @classmethod
    def for_policy(
        cls, policy: Policy, comm: Comm, faults: FaultInjector, run_dir: str
    ) -> HealthChecker | None:
        """A checker if the policy runs health checks anywhere (preflight, on incidents, or
        as a diagnosis action), else None."""
        h, d = policy.health, policy.diagnose
        actions = d.actions.values()
        if h.preflight or h.on_incident or (d.rerun and any("health" in a for a in actions)):
            return cls(h, comm, faults, run_dir)
        return None

    def __init__(
        self, policy: HealthPolicy, comm: Comm, faults: FaultInjector, run_dir: str | None
    ) -> None:
        self.policy = policy
        self.comm = comm
        self.faults = faults
        self.run_dir = run_dir
        self.host = socket.gethostname()
        self.group: dist.ProcessGroup | None = None
        self.device = torch.device("cpu")
        if comm.enabled and comm.world_size > 1:
            backend = dist.get_backend(comm.group)
            ranks = dist.get_process_group_ranks(comm.group)
            # Its own group: a timed-out collective leaves a group unusable, and the timeout
            # must be the health one, not the training one.
            self.group = dist.new_group(
                ranks=ranks,
                backend=backend,
                timeout=timedelta(seconds=policy.timeout_s),
                use_local_synchronization=True,  # only this group's ranks take part
            )
            if backend == "nccl":
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        # The roll call (the process group's store, not a collective): a rank that never
        # enters a check is named by the ones that did, with its host.
        self._store = _default_store() if self.group is not None else None
        self._prefix = "orchestrator/health/" + ",".join(
            str(r) for r in (dist.get_process_group_ranks(comm.group) if self.group else [])
        )
        self._round = 0
        self._call(f"host/{comm.rank}", self.host)

    # --- the run ----------------------------------------------------------------------------
    def run(self, reason: str) -> HealthReport:
        t0 = time.perf_counter()
        self.faults.miss_health()  # a drill: this rank never comes
        self._round += 1
        self._call(f"{self._round}/{self.comm.rank}", "here")
        checks: dict[str, dict[str, Any]] = {
            "compute": self._compute(),
            "memory": self._memory(),
        }
        if self.group is not None:
            checks["collectives"] = self._guarded(self._collectives)
            checks["bandwidth"] = self._guarded(self._bandwidth)
        mine = {"rank": self.comm.rank, "host": self.host, "checks": checks}
        ranks = self._gather(mine)
        report = HealthReport(reason=reason, ranks=ranks)
        if len(ranks) < self.comm.world_size:  # a collective failed: who never came?
            report.absent = self._absent()
        self._judge(report)
        report.seconds = time.perf_counter() - t0
        return report

    def _call(self, key: str, value: str) -> None:
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/{key}", value)
            except Exception:  # the roll call only names culprits; the checks decide
                self._store = None

    def _absent(self) -> dict[int, str]:
        """The ranks that never entered this round (rank -> host), from the roll call."""
        if self._store is None:
            return {}
        out = {}
        try:
            for r in range(self.comm.world_size):
                if not self._store.check([f"{self._prefix}/{self._round}/{r}"]):
                    host_key = f"{self._prefix}/host/{r}"
                    host = (
                        self._store.get(host_key).decode() if self._store.check([host_key]) else "?"
                    )
                    out[r] = host
        except Exception:
            return {}
        return out

    def _guarded(self, check: Any) -> dict[str, Any]:
        """A check whose collective fails or times out fails, with the error as evidence."""
        try:
            result: dict[str, Any] = check()
            return result
        except Exception as err:  # gloo/NCCL raise RuntimeError & co. on timeouts
            self._broken = True
            return {"ok": False, "error": f"{type(err).__name__}: {err}"[:300]}

    _broken = False  # a collective of the health group failed: it cannot be trusted again

    def _gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        if self.group is None:
            return [mine]
        if not self._broken:
            try:
                out: list[Any] = [None] * self.comm.world_size
                dist.all_gather_object(out, mine, group=self.group)
                return out
            except Exception as err:
                mine["checks"]["gather"] = {"ok": False, "error": f"{err}"[:300]}
        # Only this rank's own view is known; the others time out the same way.
        return [mine]

    # --- verdict ------------------------------------------------------------------------------
    def _judge(self, report: HealthReport) -> None:
        bad: dict[int, list[str]] = {}

        def flag(rank: int, what: str) -> None:
            if what not in bad.setdefault(rank, []):
                bad[rank].append(what)

        for rank in report.absent:
            flag(rank, "absent: never entered the health check (hung or dead)")
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
                if timed_out and not report.absent:  # else the absent rank explains it
                    flag(r["rank"], "collectives (timed out or failed)")
            elif "gather" in c and not report.absent:
                flag(r["rank"], "collectives (timed out or failed)")
        sums = [r["checks"]["compute"]["checksum"] for r in report.ranks]
        if len(sums) >= 3:  # with 2 ranks there is no majority; the fp64 reference decides
            majority = max(set(sums), key=sums.count)
            for r, digest in zip(report.ranks, sums, strict=True):
                if digest != majority:
                    flag(r["rank"], "compute (result differs from the other ranks')")
        self._judge_bandwidth(report, flag)
        report.bad = bad

    def _judge_bandwidth(self, report: HealthReport, flag: Any) -> None:
        measured = [r["checks"].get("bandwidth") for r in report.ranks]
        if not measured or any(m is None or m.get("gbps") is None for m in measured):
            return
        gbps = min(m["gbps"] for m in measured)
        report.bandwidth_gbps = gbps
        baseline = self._baseline(gbps)
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

    def _baseline(self, gbps: float) -> float | None:
        """The first bandwidth measured in this run directory (at preflight); the same
        value on every rank (rank 0 decides)."""
        if self.run_dir is None:
            return None
        path = os.path.join(self.run_dir, BASELINE)
        value = None
        if self.comm.rank == 0:
            # Bookkeeping: a baseline that cannot be read or written (a full disk, a damaged
            # file) is said and the check goes on without it, never leaving the other ranks
            # in the broadcast below.
            try:
                if os.path.exists(path):
                    with open(path, encoding="utf-8") as f:
                        value = float(json.load(f)["gbps"])
                elif self.policy.preflight:
                    write_atomic(path, json.dumps({"gbps": gbps, "time": time.time()}))
            except (OSError, ValueError, KeyError, TypeError) as err:
                logger.error("rank 0: bandwidth baseline %s: %r; checked without it", path, err)
        if self.group is not None and not self._broken:
            box = [value]
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(self.group, 0), group=self.group
            )
            value = box[0]
        return value

    # --- the checks -----------------------------------------------------------------------------
    def _pattern(self, rank: int) -> torch.Tensor:
        """What rank ``rank`` contributes: distinct per rank, exact in float32."""
        base = torch.arange(_PATTERN, dtype=torch.float32, device=self.device)
        return (base % 1021) * (rank + 1) + rank

    def _mine(self) -> torch.Tensor:
        t = self._pattern(self.comm.rank)
        if self.faults.corrupt_collectives:
            t[_PATTERN // 2] += 1.0  # one wrong value, as a flipped bit would make
        return t

    def _collectives(self) -> dict[str, Any]:
        world, group = self.comm.world_size, self.group
        assert group is not None
        bad_senders: set[int] = set()
        # all_gather: every rank checks every other rank's block.
        out = [torch.empty(_PATTERN, device=self.device) for _ in range(world)]
        dist.all_gather(out, self._mine(), group=group)
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
            dist.broadcast(t, src=dist.get_global_rank(group, root), group=group)
            if root != self.comm.rank and not torch.equal(t, self._pattern(root)):
                bad_senders.add(root)
        # all_reduce: the sum of every pattern (exact: small integers in float32).
        t = self._mine()
        dist.all_reduce(t, group=group)
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
        dist.all_reduce(buf, group=self.group)  # warm-up (connections, allocations)
        times: list[float] = []
        waits: list[float] = []
        for _ in range(self.policy.bandwidth_reps):
            dist.barrier(group=self.group)
            t0 = time.perf_counter()
            if self.faults.slow_factor > 1.0 and times:
                time.sleep((self.faults.slow_factor - 1.0) * times[-1])  # a slow rank/link
            t1 = time.perf_counter()
            dist.all_reduce(buf, group=self.group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
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
        c = a @ a
        if self.faults.flaky_compute:
            c[n // 2, n // 3] += 1.0
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        ref = a.double() @ a.double()
        err = float(((c.double() - ref).abs() / (ref.abs() + 1.0)).max())
        digest = hashlib.sha256(c.cpu().numpy().tobytes()).hexdigest()[:16]
        # fp32 accumulation over n terms: about n * 2^-24 relative, far below this.
        return {"ok": err < 1e-3, "max_rel_error": err, "checksum": digest}

    def _memory(self) -> dict[str, Any]:
        n = int(self.policy.memory_mb * 2**20)
        if n == 0:
            return {"ok": True}
        expected = (torch.arange(n, dtype=torch.int32, device=self.device) % 251).to(torch.uint8)
        buf = torch.empty(n, dtype=torch.uint8, device=self.device)
        buf.copy_(expected)
        mismatches = int((buf != expected).sum())
        return {"ok": mismatches == 0, "mismatches": mismatches}

    def close(self) -> None:
        if self.group is not None and not self._broken:
            dist.destroy_process_group(self.group)
            self.group = None
