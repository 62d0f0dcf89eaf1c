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
    """Robust spike test on the all-reduced values: ``(x - reference) / noise > zscore``.

    The reference is the median of the last ``reference_steps`` values moved along the
    falling trend, the flattest of three robust slopes: the window's median step-to-step
    change, the median change over half of the last ``2 * reference_steps`` values, and the
    change between the medians of the last two blocks of ``reference_steps``. A loss that
    falls and flattens has a window slope steeper than its slope now: extrapolating along
    it alone put the reference below healthy values.
    The noise comes from second differences over the window, at lags 1 and 2 (their
    geometric mean): they cancel a locally straight trend, so early training's descent is
    not taken for noise, and their medians ignore outliers and most of the bend where it
    flattens. A value below the median of the last ``reference_steps`` is never a spike.
    docs/incidents.md has the measured false positives and power.

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
        k = self.policy.reference_steps
        for m, hist in self.history.items():
            x = values[m]
            if len(hist) >= self.policy.min_history and math.isfinite(x):
                h = [v for _, v in hist]
                bar = self._bar(m, h)
                # Never a spike below the recent level, whatever the extrapolation says.
                if bar.exceeded(x, 1.0) and x > _median(h[-k:]):
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
        changes = [b - a for a, b in itertools.pairwise(h)]
        # A falling trend (early training) lowers what the next value should be: the median
        # of the last k values stands (k + 1) / 2 steps back. A rising one is not followed:
        # a loss climbing step after step is what this is here to catch. Of the slopes, the
        # flattest: on a flattening curve the older ones are too steep.
        slopes = [_median(changes), _slope(h[-2 * k :])]
        if len(h) >= 2 * k:
            slopes.append((_median(h[-k:]) - _median(h[-2 * k : -k])) / k)
        trend = min(max(slopes), 0.0)
        ref = _median(h[-k:]) + trend * (k + 1) / 2
        # x[i+1] - 2 x[i] + x[i-1] has variance 6 sigma^2 for white noise, at lag 2 likewise.
        # A real loss's noise drifts (is correlated), which lag 1 misses, and lag 2 sees 4x
        # a curve's bend: their geometric mean, each from the median (robust to outliers).
        d1 = [b - a for a, b in itertools.pairwise(changes)]
        d2 = [h[i + 2] - 2 * h[i] + h[i - 2] for i in range(2, len(h) - 2)]
        noise = math.sqrt(_mad(d1) * _mad(d2 or d1) / 6)  # 4 values have no lag-2 one
        # A flat history (a constant loss) has no noise: a relative floor keeps a rounding
        # error from being a spike.
        noise = max(noise, 1e-3 * abs(ref), 1e-12)
        return SpikeBar(metric, ref, noise, self.policy.zscore)


def _median(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2]


def _slope(seg: list[float]) -> float:
    """Robust slope of ``seg`` (at least 2 values): the median of its changes over half its
    length, per step."""
    lag = len(seg) // 2
    return _median([(seg[i + lag] - seg[i]) / lag for i in range(len(seg) - lag)])


def _mad(v: list[float]) -> float:
    """Standard deviation of zero-centred ``v`` from its median absolute value: blind to
    up to half of it being outliers or a curve's bend."""
    return 1.4826 * _median([abs(x) for x in v]) if v else 0.0
