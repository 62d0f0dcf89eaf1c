"""The hot-path check: local flags packed into one tensor, and spike detection on its sum.

``pack_local`` builds, on the loss's device and without a host sync,
``[loss non-finite, grads non-finite, stop request, persist request, persist failed,
persist busy, loss, grad-norm^2 partial]``. The Guard all-reduces it once; the SUM gives
every rank the same decision and the global values. The control slots carry facts that all
ranks must act on at the same step (rank 0's persist timer, a busy or failed writer).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

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


class SpikeDetector:
    """Robust rolling z-score: (x - median) / (1.4826 * MAD) over the last ``window`` values.

    Fed with the all-reduced values, it reaches the same verdict on every rank with no extra
    collective. Values that triggered a spike are not added to the history.
    """

    def __init__(self, policy: SpikePolicy) -> None:
        self.policy = policy
        self.history: dict[str, deque[float]] = {
            m: deque(maxlen=policy.window) for m in policy.metrics
        }

    def check(self, values: dict[str, float]) -> tuple[str, float] | None:
        """Return ``(metric, zscore)`` of the first spiking metric, else record and return None."""
        if not self.policy.enabled:
            return None
        for m, hist in self.history.items():
            x = values[m]
            if len(hist) >= self.policy.min_history and math.isfinite(x):
                ordered = sorted(hist)
                med = ordered[len(ordered) // 2]
                mad = sorted(abs(v - med) for v in ordered)[len(ordered) // 2]
                scale = 1.4826 * mad if mad > 0 else 1e-12 * max(abs(med), 1.0)
                z = (x - med) / scale
                if z > self.policy.zscore:
                    return m, z
        for m, hist in self.history.items():
            if math.isfinite(values[m]):
                hist.append(values[m])
        return None
