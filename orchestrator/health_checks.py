"""The health checks themselves, each run on this rank and returning its evidence: the
collectives (``all_gather``, ``broadcast`` and ``all_reduce`` of known patterns, compared
exactly), the bandwidth (a timed ``all_reduce``), compute (a seeded matmul at IEEE fp32
against an fp64 reference) and memory (a pattern written and read back).

:class:`HealthChecks` is a part of :class:`orchestrator.health.HealthChecker`, which owns the
group, the deadline and the bounded wait (``_settle``) the collectives here go through.
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from orchestrator.comm import Comm
from orchestrator.policy_sections import HealthPolicy

_PATTERN = 4099  # elements per rank in the correctness checks (odd: no alignment luck)


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


class HealthChecks:
    """The checks of :class:`orchestrator.health.HealthChecker` (its state, declared here)."""

    policy: HealthPolicy
    comm: Comm
    group: dist.ProcessGroup | None
    device: torch.device

    def _settle(self, work: Any, *tensors: torch.Tensor) -> None:
        raise NotImplementedError  # HealthChecker's: the bounded wait on a collective

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
