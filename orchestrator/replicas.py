"""Replica agreement: a digest of the state every snapshot holds, compared across replicas.

The finite check sees only what becomes a NaN. A rank whose parameters drift from the others
(a loop that skips DDP's gradient all-reduce, a flipped bit in HBM, a wrong all-reduce that
stays finite) trains on, every flag green. So every snapshot carries a digest of the state
that training changes only in the optimizer step (:meth:`Engine.digest_tensors`), computed on
the device with no host sync per tensor, and at each snapshot step the replicas compare
digests in a second tiny all-reduce (MAX over ``[d, -d]``: equal iff max == min). A mismatch
is a ``divergence`` incident: roll back to the newest snapshot the replicas agreed on.

Naming the odd rank out: with three or more replicas the majority names the minority at
once. Two replicas tie; then the replay after the rollback decides, because it is exact: the
state it reaches at the incident's step is what every rank should have held. A rank whose
digest equals it was right. Otherwise every rank may differ from it (under DDP a drifted
rank's gradients reach the others through the all-reduce), so each rank keeps a small
sketch of its diverged state (per-tensor sums and sums of squares, cold path only) and the
rank much farther from the replayed state than the others is named (:class:`Culprits`).
A rank named repeatedly is sick (``detect.replicas.sick_after``).

Sharded state (FSDP, ZeRO-3) has no replicas to compare; its digest still guards the
snapshot itself: a restored snapshot is checked against the digest it was taken with.

The digest is a wrapping int32 sum of each tensor's bit pattern (exact, associative, so
replicas agree bit for bit whatever the reduction order; any single flipped bit changes it),
the tensors' sums combined with distinct odd weights in int64. It does not see two values
swapped inside one tensor; it is a corruption check, not a cryptographic hash.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from orchestrator.comm import Comm

# Digests travel as int64 with their negation: keep them clear of INT64_MIN.
_MASK = (1 << 62) - 1
# A tied divergence names a rank whose state was this many times farther from the replayed
# state than the nearest rank's: a drift of its own, not one it caught through the gradients.
ODD_RATIO = 4.0


def _words(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s bytes as int32 words (and the few trailing bytes as int32 values)."""
    if hasattr(t, "to_local"):  # DTensor: this rank's shard
        t = t.to_local()
    t = t.detach()
    if t.numel() == 0:
        return []
    raw = t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1).byte()
    whole = raw.numel() // 4 * 4
    out = [raw[:whole].view(torch.int32)] if whole else []
    if whole < raw.numel():
        out.append(raw[whole:].to(torch.int32))
    return out


def digest(tensors: Iterable[torch.Tensor]) -> torch.Tensor | None:
    """A 0-d int64 digest of ``tensors`` on their device (no host sync); None if empty."""
    sums = [w.sum(dtype=torch.int32) for t in tensors for w in _words(t)]
    if not sums:
        return None
    # On a GPU some state lives on the host: torch's Adam/AdamW (neither fused nor
    # capturable) keeps each parameter's ``step`` as a CPU tensor. Their sums join the
    # device's (a 0-d copy each, at snapshot steps only); an H200 run crashed here.
    device = next((x.device for x in sums if x.device.type != "cpu"), sums[0].device)
    stacked = torch.stack([x.to(device, non_blocking=True) for x in sums]).to(torch.int64)
    weights = torch.arange(1, 2 * len(sums), 2, dtype=torch.int64, device=stacked.device)
    return (stacked * weights).sum() & _MASK


def compare_async(comm: Comm, d: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
    """Start the replicas' comparison of ``d``: MAX over ``[d, -d]``. Read it with
    :func:`agreed` after the step's host sync (the all-reduce is queued before the step's
    own, so that sync covers it)."""
    t = torch.stack([d, -d]).to(comm._device())
    work = None
    if comm.world_size > 1:
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=comm.group, async_op=True)
    return t, work


def agreed(t: torch.Tensor, work: dist.Work | None) -> tuple[bool, int]:
    """Whether every replica's digest was the same, and the largest one."""
    if work is not None:
        work.wait()
    hi, neg_lo = t.tolist()
    return hi == -neg_lo, int(hi)


def sketch(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Per-tensor sum and sum of squares in float64, on the host (cold path): where a
    state sits, roughly, for distances between diverged states."""
    parts = []
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        x = local.detach().double()
        parts += [x.sum(), (x * x).sum()]
    return torch.stack(parts).cpu() if parts else torch.zeros(0, dtype=torch.float64)


def farthest(distances: list[float], ratio: float = ODD_RATIO) -> list[int]:
    """The ranks whose diverged state was more than ``ratio`` times farther from the
    replayed one than the nearest rank's ([] when no rank stands out)."""
    near = min(distances)
    odd = [r for r, d in enumerate(distances) if d > ratio * near and d > 0]
    return odd if len(odd) < len(distances) else []


def minority(digests: list[int]) -> list[int] | None:
    """Ranks whose digest differs from a strict majority's; None when no value has one
    (two replicas, or a split): the replay must decide."""
    value, count = Counter(digests).most_common(1)[0]
    if 2 * count <= len(digests):
        return None
    return [r for r, d in enumerate(digests) if d != value]


@dataclass
class Tie:
    """A divergence no majority decided: every rank's digest, this rank's sketch."""

    digests: list[int]
    sketch: torch.Tensor


@dataclass
class Culprits:
    """Who was the odd one out of each divergence, and who is sick.

    ``pending`` holds a tied divergence by step until the replay reaches that step again and
    the replicas agree there."""

    sick_after: int
    window_steps: int
    pending: dict[int, Tie] = field(default_factory=dict)
    named: list[tuple[int, int]] = field(default_factory=list)  # (step, rank)

    def name(self, step: int, ranks: list[int]) -> list[int]:
        """Count ``ranks`` as culprits at ``step``; returns those now sick."""
        self.named += [(step, r) for r in ranks]
        recent = Counter(r for s, r in self.named if s > step - self.window_steps)
        return sorted(r for r in set(ranks) if recent[r] >= self.sick_after)
