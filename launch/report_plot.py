"""report.png, the picture of `orchestrator report` (:mod:`launch.report` writes the page):
loss and grad norm against the step, the LR on a second axis, incidents as vertical lines
coloured by classification, rolled-back steps shaded, restarts and durable snapshots marked,
steps without metrics hatched, and the wall time split by the goodput ledger. Needs
matplotlib (``pip install -e '.[report]'``), imported only when a picture is drawn.
"""

from __future__ import annotations

import math
from typing import Any

from launch.report import RunRecord, _share, metric_gaps, totals
from orchestrator.events import Diagnosis, Incident, Persist, Resume, Rollback
from orchestrator.goodput import Ledger

COLOURS = {
    "transient": "tab:orange",
    "deterministic": "tab:red",
    "precision": "tab:purple",
    "data_or_model": "tab:brown",
    None: "tab:red",
}


def plot(rec: RunRecord, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    final, gaps = _points(rec)
    steps = sorted(final)
    fig = plt.figure(figsize=(11, 8))
    grid = fig.add_gridspec(3, 1, height_ratios=[3, 2, 0.7])
    ax_loss = fig.add_subplot(grid[0])
    ax_gn = fig.add_subplot(grid[1], sharex=ax_loss)
    _goodput_bar(fig.add_subplot(grid[2]), rec.goodput)
    _draw_loss(ax_loss, steps, final)
    _draw_grad_norm(ax_gn, steps, final)
    classes = {e.record.incident_step: e.record.classification for e in rec.of(Diagnosis)}
    for ax in (ax_loss, ax_gn):
        _mark_events(ax, rec, gaps, classes)
    ax_loss.legend(handles=_legend_handles(bool(gaps)), loc="upper right", fontsize=8)
    t = totals(rec)
    fig.suptitle(
        f"{t['incidents']} incident(s), {t['rollbacks']} rollback(s), {t['restarts']} "
        f"restart(s), {t['quarantined_samples']} quarantined sample(s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _points(rec: RunRecord) -> tuple[dict[float, dict[str, Any]], list[tuple[int, int]]]:
    """The metrics row of each step (a replayed step's last record wins: the timeline kept),
    an empty row in each gap of the steps, and the gaps."""
    final: dict[float, dict[str, Any]] = {}
    for m in rec.metrics:
        final[int(m["step"])] = m
    gaps = metric_gaps(sorted(int(s) for s in final))
    for a, _ in gaps:  # a NaN point in each gap breaks the lines: nothing drawn through it
        final[a + 0.5] = {}
    return final, gaps


def _draw_loss(ax_loss: Any, steps: list[float], final: dict[float, dict[str, Any]]) -> None:
    """The loss (log scale when it spans more than a decade), the LR on a second axis."""
    loss = [final[s].get("loss", math.nan) for s in steps]
    ax_loss.plot(steps, loss, lw=1, color="tab:blue", label="loss")
    finite = [v for v in loss if v is not None and v > 0]
    if finite and max(finite) / min(finite) > 10:
        ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    lrs = [final[s].get("lr", math.nan) for s in steps]
    if any(v is not None for v in lrs):
        ax_lr = ax_loss.twinx()
        ax_lr.plot(steps, lrs, lw=1, color="tab:green", alpha=0.7, label="LR")
        ax_lr.set_ylabel("LR", color="tab:green")


def _draw_grad_norm(ax_gn: Any, steps: list[float], final: dict[float, dict[str, Any]]) -> None:
    """The grad norm, on a log scale when any is positive."""
    gn = [final[s].get("grad_norm", math.nan) for s in steps]
    ax_gn.plot(steps, gn, lw=1, color="tab:gray", label="grad norm")
    if any(v is not None and v > 0 for v in gn):
        ax_gn.set_yscale("log")
    ax_gn.set_ylabel("grad norm")
    ax_gn.set_xlabel("step")


def _mark_events(
    ax: Any, rec: RunRecord, gaps: list[tuple[int, int]], classes: dict[int, Any]
) -> None:
    """On one axis: the gaps hatched, rolled-back steps shaded, incidents (coloured by their
    diagnosis' classification), resumed steps and durable snapshots."""
    for a, b in gaps:
        ax.axvspan(a, b, color="tab:gray", alpha=0.15, lw=0, hatch="//")
    for r in rec.of(Rollback):
        if r.record.from_step is not None:
            ax.axvspan(r.record.to_step, r.record.from_step, color="tab:red", alpha=0.12, lw=0)
    for e in rec.of(Incident):
        ax.axvline(e.step, color=COLOURS.get(classes.get(e.step), "tab:red"), lw=1.5)
    for s in rec.of(Resume):
        ax.axvline(s.record.snapshot_step, color="black", ls="--", lw=1)
    for p in rec.of(Persist):
        ax.plot([p.step], [0], marker="v", color="tab:blue", ms=5,
                transform=ax.get_xaxis_transform(), clip_on=False)  # fmt: skip


def _legend_handles(gaps: bool) -> list[Any]:
    """The legend of what :func:`_mark_events` draws (the gaps' entry only when there are)."""
    import matplotlib.pyplot as plt

    handles = [
        plt.Line2D([], [], color="tab:red", lw=1.5, label="incident"),
        plt.Rectangle((0, 0), 1, 1, color="tab:red", alpha=0.12, label="rolled back"),
        plt.Line2D([], [], color="black", ls="--", label="restart (resumed step)"),
        plt.Line2D([], [], color="tab:blue", marker="v", ls="", label="durable snapshot"),
    ]
    if gaps:
        handles.append(plt.Rectangle((0, 0), 1, 1, color="tab:gray", alpha=0.15, hatch="//",
                                     label="no metrics (lost in a crash)"))  # fmt: skip
    return handles


GOODPUT_COLOURS = {
    "productive": "tab:green",
    "startup": "tab:gray",
    "restart": "tab:orange",
    "hang": "tab:red",
    "preemption": "tab:purple",
    "lost": "tab:brown",
    "replayed": "tab:pink",
    "incident": "gold",
    "snapshot": "tab:blue",
    "check": "tab:cyan",
    "persist": "tab:olive",
}


def _goodput_bar(ax: Any, led: Ledger) -> None:
    """One bar: the wall time, split by the ledger's kinds."""
    left = 0.0
    for kind, seconds in led.parts.items():
        if seconds <= 0:
            continue
        ax.barh([0], [seconds], left=left, color=GOODPUT_COLOURS[kind], label=kind)
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel(f"wall time (s): goodput {_share(led.goodput)}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.9), ncol=6, fontsize=8, frameon=False)
