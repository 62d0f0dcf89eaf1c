"""The hot-path check: local flags packed into one tensor, and spike detection on its sum.

``pack_local`` builds, on the loss's device and without a host sync,
``[loss non-finite, grads non-finite, stop request, persist request, persist failed,
persist busy, loss, grad-norm^2 partial]``. The Guard all-reduces it once; the SUM gives
every rank the same decision and the global values. The control slots carry facts that all
ranks must act on at the same step (rank 0's persist timer, a busy or failed writer).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from orchestrator.policy_sections import SpikePolicy

# Slots of the packed tensor.
(
    LOSS_NONFINITE,
    GRAD_NONFINITE,
    STOP,
    PERSIST_REQUEST,
    PERSIST_FAILED,
    PERSIST_BUSY,
    LOSS,
    GRAD_NORM_SQ,
) = range(8)


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of local gradients, in fp32, as a 0-d tensor (no host sync)."""
    return torch.nn.utils.get_total_norm(grads, 2.0, error_if_nonfinite=False).float()


def pack_local(
    loss: torch.Tensor,
    grads: Iterable[torch.Tensor],
    check_grads: bool,
    control: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
) -> torch.Tensor:
    """``control`` = (stop, persist request, persist failed, persist busy), local values."""
    loss32 = loss.detach().float().reshape(())
    gl = list(grads) if check_grads else []
    if gl:
        norm = grad_norm(gl).to(loss32.device)
    else:
        norm = torch.zeros((), device=loss32.device)
    return torch.stack(
        [
            (~torch.isfinite(loss32)).float(),
            (~torch.isfinite(norm)).float(),
            *(torch.full((), c, device=loss32.device) for c in control),  # fills, no H2D copy
            loss32,
            norm * norm,
        ]
    )


@dataclass(frozen=True)
class SpikeBar:
    """Where a spike's metric stood: the reference level, the noise of one step's global
    value, and the threshold in noise units; judges the isolation re-runs."""

    metric: str
    reference: float
    noise: float
    zscore: float

    def exceeded(self, value: float, fraction: float) -> bool:
        """``value`` is a spike for a mean over ``fraction`` of the step's samples: the
        noise of a mean grows as 1/sqrt(samples), so a sub-batch gets a wider margin."""
        if not math.isfinite(value):
            return True
        return value > self.reference + self.zscore * self.noise / math.sqrt(fraction)

    def z(self, value: float) -> float:
        return (value - self.reference) / self.noise


class SpikeDetector:
    """Robust spike test on the all-reduced values: ``(x - reference) / noise > zscore``,
    the reference the median of the last ``reference_steps`` values moved along a falling
    trend (the median step-to-step change), the noise ``1.4826 * median |change - trend| /
    sqrt(2)`` over the window.

    Step-to-step changes measure the noise whatever the trend (a window's spread around its
    median would take a falling loss for noise and miss real spikes early in training).
    Fed with the all-reduced values, it reaches the same verdict on every rank with no extra
    collective or host sync. Values that triggered a spike are not added to the history.
    """

    def __init__(self, policy: SpikePolicy) -> None:
        self.policy = policy
        # (step, value) per metric: a rollback takes back the values of the steps it undid.
        self.history: dict[str, deque[tuple[int, float]]] = {
            m: deque(maxlen=policy.window) for m in policy.metrics
        }

    def check(self, values: dict[str, float], step: int = 0) -> SpikeBar | None:
        """The bar of the first spiking metric, else record the values of ``step`` and
        return None."""
        if not self.policy.enabled:
            return None
        for m, hist in self.history.items():
            x = values[m]
            if len(hist) >= self.policy.min_history and math.isfinite(x):
                bar = self._bar(m, [v for _, v in hist])
                if bar.exceeded(x, 1.0):
                    return bar
        for m, hist in self.history.items():
            if math.isfinite(values[m]):
                hist.append((step, values[m]))
        return None

    def rewind(self, step: int) -> None:
        """Rolled back to ``step``: forget the values of the steps from there on (their
        replay is compared with the history before them, not with its own future)."""
        for hist in self.history.values():
            while hist and hist[-1][0] >= step:
                hist.pop()

    def _bar(self, metric: str, h: list[float]) -> SpikeBar:
        k = self.policy.reference_steps
        changes = sorted(b - a for a, b in itertools.pairwise(h))
        # A falling trend (early training) lowers what the next value should be: the median
        # of the last k values stands (k + 1) / 2 steps back. A rising one is not followed:
        # a loss climbing step after step is what this is here to catch.
        trend = min(changes[len(changes) // 2], 0.0)
        recent = sorted(h[-k:])
        ref = recent[len(recent) // 2] + trend * (k + 1) / 2
        spread = sorted(abs(c - trend) for c in changes)
        noise = 1.4826 * spread[len(spread) // 2] / math.sqrt(2)
        # A flat history (a constant loss) has no noise: a relative floor keeps a rounding
        # error from being a spike.
        noise = max(noise, 1e-3 * abs(ref), 1e-12)
        return SpikeBar(metric, ref, noise, self.policy.zscore)
