"""The verdict of a health check: every rank's evidence judged (the same on every rank), the
bandwidth against the baseline measured at preflight, and the :class:`HealthReport`.

:class:`HealthVerdict` is a part of :class:`orchestrator.health.HealthChecker`.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from orchestrator.comm import Comm
from orchestrator.policy_sections import HealthPolicy
from orchestrator.rundir import write_atomic

BASELINE = "health_baseline.json"
logger = logging.getLogger("orchestrator.health")  # one logger for the health checks


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


def _ok(check: dict[str, Any] | None) -> str:
    if check is None:
        return "-"
    return "ok" if check.get("ok") else "FAIL"


class HealthVerdict:
    """The verdict of :class:`orchestrator.health.HealthChecker` (its state, declared here)."""

    policy: HealthPolicy
    comm: Comm
    run_dir: str | None

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
