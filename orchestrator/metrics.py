"""RUN_DIR/metrics.jsonl: per-step training metrics, cheap enough for every step.

Rank 0 of the Guard's group appends one line per recorded step (loss and grad norm as the
step's all-reduce already gave them, LR, loss scale, step time), buffered and flushed every
``metrics.flush_every`` lines or ``metrics.flush_s`` seconds. Every
``metrics.update_ratio_every`` steps it also records the update-to-weight ratio
||w_after - w_before|| / ||w_after|| of its parameters (its shard under FSDP and ZeRO): a
silent bf16 stall shows as updates far below 1e-3 of the weights, and the journal says so
(``update_ratio_low``) when it stays there.

The file is bookkeeping: a write that fails (a full disk, an I/O error) never stops
training. The rows wait in memory (up to ``MAX_PENDING_ROWS``) and are written once the
file takes writes again; the first failure is said once (``on_error``: the Guard journals
``write_failed``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from orchestrator.errors import PolicyError
from orchestrator.policy_sections import MetricsPolicy
from orchestrator.protocol import METRICS_NAME

logger = logging.getLogger(__name__)
MAX_PENDING_ROWS = 100_000  # rows kept while metrics.jsonl cannot be written (~20 MB)


class Metrics:
    """``tensorboard_dir``: the rows also go there as TensorBoard scalars (rank 0).
    ``on_error(err)`` is called once, the first time a flush fails."""

    def __init__(
        self,
        policy: MetricsPolicy,
        run_dir: str,
        attempt: int,
        enabled: bool,
        tensorboard_dir: str | None = None,
        on_error: Callable[[OSError], object] | None = None,
    ) -> None:
        self.policy = policy
        self.enabled = enabled and policy.enabled
        self._tb: Any = None
        if self.enabled and tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:  # torch's writer needs the tensorboard package
                raise PolicyError(
                    "export.tensorboard_dir is set but tensorboard is not installed: "
                    "pip install tensorboard, or set export.tensorboard_dir: null"
                ) from err
            self._tb = SummaryWriter(log_dir=tensorboard_dir)
        self.path = os.path.join(run_dir, METRICS_NAME)
        self.attempt = attempt
        self._lines: list[str] = []
        self._last: tuple[float, int] | None = None  # (time, step) of the last row
        # Since the last row (a row stands for metrics.every_steps steps): the checks'
        # seconds, and the steps run with a durable write in flight.
        self._check_s, self._writing = 0.0, 0
        self._before: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._low = 0  # consecutive ratios below the threshold
        self._flushed = time.monotonic()
        self._on_error = on_error
        self.failures = 0  # flushes that failed
        self.dropped = 0  # rows dropped past MAX_PENDING_ROWS
        self._torn = False  # a failed append may have left part of a line

    # --- per step -----------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and step % self.policy.every_steps == 0

    def ratio_due(self, step: int) -> bool:
        every = self.policy.update_ratio_every
        return self.enabled and every > 0 and step % every == 0

    def before_update(self, params: list[torch.Tensor]) -> None:
        """A copy of the weights before the optimizer step (every update_ratio_every)."""
        self._before = [(p, _local(p).detach().clone()) for p in params]

    def update_ratio(self) -> float | None:
        """||w - w_before|| / ||w|| after the step, over the parameters whose local storage
        kept its shape (ZeRO-3 frees gathered ones), if ``before_update`` came first."""
        before, self._before = self._before, None
        delta = norm = 0.0
        for p, b in before or []:
            w = _local(p).detach()
            if w.shape == b.shape and w.numel() > 0:
                delta += float((w.float() - b.float()).pow(2).sum())
                norm += float(w.float().pow(2).sum())
        return (delta**0.5) / (norm**0.5) if norm > 0 else None

    def drop_update(self) -> None:
        self._before = None  # the step was not applied (incident)

    def low_streak(self, ratio: float) -> bool:
        """True once, when the ratio has stayed below the threshold ``patience`` times."""
        self._low = self._low + 1 if ratio < self.policy.update_ratio_warn else 0
        return self._low == self.policy.update_ratio_patience

    def after_step(
        self,
        step: int,
        outcome: str,
        loss: float,
        grad_norm: float,
        lr: Callable[[], float | None],
        loss_scale: Callable[[], float | None],
        check_s: float | None = None,
        writing: bool = False,
    ) -> dict[str, Any] | None:
        """After a step is applied (or skipped by the loss scaler): one row when due (values
        already on the host), and the update-to-weight ratio when due. Returns the details
        of an ``update_ratio_low`` event to journal, if the ratio just became low."""
        self._check_s += check_s or 0.0
        self._writing += 1 if writing else 0
        if not (self.due(step) or self.ratio_due(step)):
            return None
        ratio = self.update_ratio()
        low = None
        if ratio is not None and self.low_streak(ratio):
            low = {
                "ratio": ratio,
                "threshold": self.policy.update_ratio_warn,
                "measurements": self.policy.update_ratio_patience,
                "hint": "updates are tiny next to the weights (a bf16 stall?): check the LR "
                "and that the optimizer keeps fp32 master weights",
            }
        if self.due(step):
            self.record(
                step,
                loss=loss,
                grad_norm=grad_norm,
                lr=lr(),
                # A GradScaler's scale lives on the device: read it now and then, and at
                # overflows (where it changes), not at every step.
                loss_scale=loss_scale() if outcome == "overflow_skip" or step % 50 == 0 else None,
                update_ratio=ratio,
                outcome=outcome,
                # For the goodput ledger, over the steps since the last row: the checks'
                # cost, and how many ran with a durable write in flight (its interference
                # shows as slower steps).
                check_s=None if check_s is None else round(self._check_s, 6),
                writing=self._writing or None,
            )
            self._check_s, self._writing = 0.0, 0
        return low

    def record(self, step: int, **values: Any) -> None:
        now = time.monotonic()
        step_s = None
        if self._last is not None and step > self._last[1]:
            step_s = (now - self._last[0]) / (step - self._last[1])
        self._last = (now, step)
        if not self.enabled:
            return
        row = {"step": step, "time": time.time(), "attempt": self.attempt, "step_s": step_s}
        row.update({k: v for k, v in values.items() if v is not None})
        self._lines.append(json.dumps(row))
        if self._tb is not None:
            for key in ("loss", "grad_norm", "lr", "loss_scale", "step_s", "update_ratio"):
                value = row.get(key)
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step, walltime=row["time"])
        if (
            len(self._lines) >= self.policy.flush_every
            or now - self._flushed >= self.policy.flush_s
        ):
            self.flush()

    def restart_clock(self) -> None:
        """After a rollback or a pause, the next step's time is not a step time."""
        self._last = None

    def flush(self) -> None:
        """Append the buffered rows; a failure keeps them for the next flush (bounded) and
        never raises: metrics are bookkeeping, training goes on."""
        self._flushed = time.monotonic()
        try:
            if self._tb is not None:
                self._tb.flush()
        except OSError as err:
            self._failed(err)
        if not self._lines:
            return
        # After a failed append, start on a line of our own: the part it left is skipped.
        prefix = b"\n" if self._torn else b""
        data = prefix + ("\n".join(self._lines) + "\n").encode()
        done = 0
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                while done < len(data):
                    done += os.write(fd, data[done:])
            finally:
                os.close(fd)
        except OSError as err:
            if done:  # the rows written whole stay written; the rest wait for the next flush
                del self._lines[: data[:done].count(b"\n") - len(prefix)]
                self._torn = not data[:done].endswith(b"\n")
            self._failed(err)
            return
        self._torn = False
        self._lines = []

    @property
    def unwritten(self) -> int:
        """Rows not in the file: waiting for the disk, or dropped past ``MAX_PENDING_ROWS``."""
        return len(self._lines) + self.dropped

    def _failed(self, err: OSError) -> None:
        self.failures += 1
        if len(self._lines) > MAX_PENDING_ROWS:
            drop = len(self._lines) - MAX_PENDING_ROWS
            del self._lines[:drop]
            self.dropped += drop
        if self.failures > 1:
            return
        logger.error(
            "rank 0: metrics %s cannot be written (%s); rows wait in memory (up to %d) and "
            "are written when it can be again; training goes on: check the run directory's "
            "disk",
            self.path,
            err,
            MAX_PENDING_ROWS,
        )
        if self._on_error is not None:
            try:
                self._on_error(err)
            except Exception as inner:  # journaling it may fail the same way: said there
                logger.debug("journaling the metrics failure failed: %r", inner)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p  # FSDP2: this rank's shard
