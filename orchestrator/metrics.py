"""RUN_DIR/metrics.jsonl: per-step training metrics, cheap enough for every step.

Rank 0 of the Guard's group appends one line per recorded step (loss and grad norm as the
step's all-reduce already gave them, LR, loss scale, step time), buffered and flushed every
``metrics.flush_every`` lines or ``metrics.flush_s`` seconds. Every
``metrics.update_ratio_every`` steps it also records the update-to-weight ratio
||w_after - w_before|| / ||w_after|| of its parameters (its shard under FSDP and ZeRO): a
silent bf16 stall shows as updates far below 1e-3 of the weights, and the journal says so
(``update_ratio_low``) when it stays there. The ratio is computed on the device (a copy of
the weights before the step, two norms per parameter summed into one tensor) and read by the
next step's check with its own host sync (:meth:`Metrics.pending`): that step's row waits
for it, so no rank ever waits for rank 0's measurement.

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
        on_low: Callable[[int, dict[str, Any]], object] | None = None,
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
        # A measured ratio not read yet: (step, [||dw||^2, ||w||^2] on the device, the row
        # of that step waiting for it, or None where no row is due).
        self._pending: tuple[int, torch.Tensor, dict[str, Any] | None] | None = None
        self._on_low = on_low
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

    def _measure(self) -> torch.Tensor | None:
        """[||w - w_before||^2, ||w||^2] after the step, on the device (no host sync), over
        the parameters whose local storage kept its shape (ZeRO-3 frees gathered ones), if
        ``before_update`` came first. The copies taken before become the differences."""
        before, self._before = self._before, None
        pairs = [(_local(p).detach(), b) for p, b in before or []]
        pairs = [(w, b) for w, b in pairs if w.shape == b.shape and w.numel() > 0]
        if not pairs:
            return None
        after = [w for w, _ in pairs]
        diffs = [b for _, b in pairs]
        torch._foreach_sub_(diffs, after)  # w_before - w: the same norm as the update's
        device = after[0].device
        sq = [
            torch.stack([n.to(device) for n in torch._foreach_norm(ts, 2, dtype=torch.float32)])
            .pow(2)
            .sum()
            for ts in (diffs, after)
        ]
        return torch.stack(sq)

    def pending(self) -> torch.Tensor | None:
        """The measured ratio's norms for the next check to read with its host sync (then
        :meth:`resolve`), or None."""
        return self._pending[1] if self._pending is not None else None

    def resolve(self, values: list[float] | None = None) -> None:
        """The pending ratio's norms as read (``values``; None: read them now, a host sync,
        e.g. at close): its row is written, and a low streak journaled (``on_low``)."""
        if self._pending is None:
            return
        step, sq, row = self._pending
        self._pending = None
        delta_sq, norm_sq = values if values is not None else sq.tolist()
        ratio = (delta_sq**0.5) / (norm_sq**0.5) if norm_sq > 0 else None
        if ratio is not None and self.low_streak(ratio) and self._on_low is not None:
            self._on_low(
                step,
                {
                    "ratio": ratio,
                    "threshold": self.policy.update_ratio_warn,
                    "measurements": self.policy.update_ratio_patience,
                    "hint": "updates are tiny next to the weights (a bf16 stall?): check the "
                    "LR and that the optimizer keeps fp32 master weights",
                },
            )
        if row is not None:
            if ratio is not None:
                row["update_ratio"] = ratio
            self._append(row)

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
    ) -> None:
        """After a step is applied (or skipped by the loss scaler): one row when due (values
        already on the host), and the update-to-weight ratio when due: its norms are measured
        on the device and read by the next check (:meth:`pending`, :meth:`resolve`); the
        row of this step waits for them."""
        self._check_s += check_s or 0.0
        self._writing += 1 if writing else 0
        if not (self.due(step) or self.ratio_due(step)):
            return
        self.resolve()  # not read by a check since (none ran): read now
        measured = self._measure() if self.ratio_due(step) else None
        row = None
        if self.due(step):
            row = self._row(
                step,
                loss=loss,
                grad_norm=grad_norm,
                lr=lr(),
                # A GradScaler's scale lives on the device: read it now and then, and at
                # overflows (where it changes), not at every step.
                loss_scale=loss_scale() if outcome == "overflow_skip" or step % 50 == 0 else None,
                outcome=outcome,
                # For the goodput ledger, over the steps since the last row: the checks'
                # cost, and how many ran with a durable write in flight (its interference
                # shows as slower steps).
                check_s=None if check_s is None else round(self._check_s, 6),
                writing=self._writing or None,
            )
            self._check_s, self._writing = 0.0, 0
        if measured is not None:
            self._pending = (step, measured, row)
        elif row is not None:
            self._append(row)

    def record(self, step: int, **values: Any) -> None:
        row = self._row(step, **values)
        if row is not None:
            self._append(row)

    def _row(self, step: int, **values: Any) -> dict[str, Any] | None:
        """The row of ``step`` (its step time measured now), or None when disabled."""
        now = time.monotonic()
        step_s = None
        if self._last is not None and step > self._last[1]:
            step_s = (now - self._last[0]) / (step - self._last[1])
        self._last = (now, step)
        if not self.enabled:
            return None
        row = {"step": step, "time": time.time(), "attempt": self.attempt, "step_s": step_s}
        row.update({k: v for k, v in values.items() if v is not None})
        return row

    def _append(self, row: dict[str, Any]) -> None:
        self._lines.append(json.dumps(row))
        if self._tb is not None:
            for key in ("loss", "grad_norm", "lr", "loss_scale", "step_s", "update_ratio"):
                value = row.get(key)
                if isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, row["step"], walltime=row["time"])
        if (
            len(self._lines) >= self.policy.flush_every
            or time.monotonic() - self._flushed >= self.policy.flush_s
        ):
            self.flush()

    def restart_clock(self) -> None:
        """After a rollback or a pause, the next step's time is not a step time."""
        self._last = None

    def flush(self) -> None:
        """Append the buffered rows; a failure keeps them for the next flush (bounded) and
        never raises: metrics are bookkeeping, training goes on."""
        self.resolve()  # a ratio no check will read any more (the run's end)
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
