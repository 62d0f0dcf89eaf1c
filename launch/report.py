"""`orchestrator report RUN_DIR`: one picture and one page on a run.

report.png: loss and grad norm against the step, the LR on a second axis, incidents as
vertical lines coloured by classification, rolled-back steps shaded, restarts and durable
snapshots marked, and the wall time split by the goodput ledger (needs matplotlib:
``pip install -e '.[report]'``). report.md: the totals, the goodput split, the timeline
(time, step, event, evidence, action), and the quarantine list with where each sample id
came from. Both from the journal (every node's, merged by time) and
RUN_DIR/metrics.jsonl only: the report works on a finished, crashed or running run alike.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from launch.hangs import culprit_words
from orchestrator.events import (
    AttemptStart,
    Diagnosis,
    Event,
    Incident,
    Persist,
    Quarantine,
    Recovered,
    Restart,
    Resume,
    Rollback,
    first_each_attempt,
    of,
    quarantine_share,
)
from orchestrator.events.base import R
from orchestrator.goodput import KINDS, Ledger, ledger
from orchestrator.journal import read_events, read_metrics

COLOURS = {
    "transient": "tab:orange",
    "deterministic": "tab:red",
    "precision": "tab:purple",
    "data_or_model": "tab:brown",
    None: "tab:red",
}


@dataclass
class RunRecord:
    events: list[Event[Any]]
    skipped: list[str] = field(default_factory=list)  # file:line of journal lines not parsed
    metrics: list[dict[str, Any]] = field(default_factory=list)
    unknown: dict[str, int] = field(default_factory=dict)  # kinds of a newer version: lines

    def of(self, cls: type[R]) -> list[Event[R]]:
        return of(self.events, cls)

    @functools.cached_property
    def goodput(self) -> Ledger:
        """The goodput ledger (computed once: the page and the picture both show it)."""
        return ledger(self.events, self.metrics)


def load(run_dir: str) -> RunRecord:
    log = read_events(run_dir)  # every node's, merged by time
    return RunRecord(log.events, log.damaged, read_metrics(run_dir), log.unknown)


# --- the page -----------------------------------------------------------------------------------
#: Other events worth a timeline row: details -> (evidence, action).
OTHER = {
    "unhealthy": lambda d: (f"ranks {d.get('ranks')} on {d.get('hosts')}", "stopped, exit 72"),
    "gave_up": lambda d: (str(d.get("why")), "stopped, exit 71"),
    "preempted": lambda d: (
        f"snapshot written: {d.get('persisted')}",
        "stopped, exit 73"
        if d.get("persisted")
        else f"stopped, exit 143: {d.get('steps_lost', '?')} step(s) lost",
    ),
    "update_ratio_low": lambda d: (f"update/weight {d.get('ratio', 0):.2g}", "warning"),
    "persist_failed": lambda d: (str(d.get("error"))[:80], "training went on"),
    "hang": lambda d: (hang_evidence(d), f"attempt killed; stacks in {d.get('stacks')}"),
}


def hang_evidence(d: dict[str, Any]) -> str:
    """Who stalled, and the culprits (rank, host, phase, frame), for a person."""
    said = f"ranks {sorted(d.get('stalled_ranks') or {})} stalled"
    for c in d.get("culprits") or []:
        said += f"; culprit {culprit_words(c)}"
    return said


def timeline(rec: RunRecord) -> list[tuple[str, Any, str, str, str]]:
    """(time, step, event, evidence, action) rows, oldest first."""
    rows = []
    recovered = {e.record.incident_step: e.record.incident for e in rec.of(Recovered)}
    diagnoses = {e.record.incident_step: e.record for e in rec.of(Diagnosis)}
    for e in rec.events:
        r, d = e.record, e.details
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time))
        if isinstance(r, Incident):
            evidence = _incident_evidence(r, diagnoses.get(e.step))
            action = _incident_action(recovered.get(e.step))
            rows.append((when, e.step, "incident", evidence, action))
        elif isinstance(r, Restart):
            rows.append(
                (
                    when,
                    e.step,
                    "restart",
                    f"attempt ended: {r.cause} (exit {r.returncode})"
                    + (f" on {r.node}" if "node" in d else ""),
                    f"attempt {r.next_attempt} after {r.delay_s} s",
                )
            )
        elif isinstance(r, Resume):
            rows.append(
                (
                    when,
                    e.step,
                    "resume",
                    f"{r.tier} snapshot at step {r.snapshot_step}",
                    f"training resumed (attempt {e.attempt})",
                )
            )
        elif e.kind in OTHER:
            evidence, action = OTHER[e.kind](d)
            rows.append((when, e.step, e.kind, evidence, action))
    return rows


def _incident_evidence(r: Incident, diag: Diagnosis | None) -> str:
    said = (
        f"{r.reason}; loss {_g(r.loss, '.4g')}, grad norm {_g(r.grad_norm, '.4g')}; "
        f"origin ranks {r.origin_ranks or 'all'}"
    )
    if diag is not None:
        said += f"; {diag.classification}"
        if diag.located:
            loc = diag.located[0]
            said += f" in {loc.get('module')} ({loc.get('direction')}, rank {loc.get('rank')})"
    return said


def _incident_action(inc: dict[str, Any] | None) -> str:
    if inc is None:
        return "isolating"
    said = f"rolled back to {inc.get('rolled_back_to')}; LR x{_g(inc.get('lr_multiplier'))}"
    return said + (f"; quarantined {inc['quarantined']}" if inc.get("quarantined") else "")


def _g(x: Any, spec: str = "g") -> str:
    """A number as ``spec`` formats it; anything else (a field left out) as it is."""
    return format(x, spec) if isinstance(x, int | float) else str(x)


def totals(rec: RunRecord) -> dict[str, Any]:
    rollbacks = rec.of(Rollback)
    lost_steps = sum(
        r.record.from_step - r.record.to_step for r in rollbacks if r.record.from_step is not None
    )
    restarts = first_each_attempt(rec.events, Restart)  # each node journals the job's restart
    quarantined = sorted({i for q in rec.of(Quarantine) for i in q.record.samples})
    share = quarantine_share(rec.events)
    causes = [e.record.cause for e in rec.of(Incident)]
    return {
        "incidents": len(causes),
        "incidents_explained_by_data": causes.count("data"),
        "incidents_unexplained": causes.count("unexplained"),
        "samples_seen": share[1] if share else None,
        "quarantined_fraction": share[0] / max(share[1], 1) if share else None,
        "rollbacks": len(rollbacks),
        "restarts": len(restarts),
        "nodes": sorted(  # the supervisors' (older journals name the host)
            {
                str(e.record.node if "node" in e.details else e.record.host)
                for e in rec.of(AttemptStart)
            }
        ),
        "steps_lost_to_rollback": lost_steps,
        "goodput": rec.goodput,
        "quarantined_samples": len(quarantined),
    }


def markdown(run_dir: str, rec: RunRecord, png: str | None, why_no_png: str | None) -> str:
    t = totals(rec)
    out = [f"# Run report: {os.path.abspath(run_dir)}", ""]
    if rec.skipped:
        out += [
            f"> Note: {len(rec.skipped)} journal line(s) could not be read and were skipped "
            f"({', '.join(rec.skipped)}; a crash mid-write leaves a torn "
            "last line). Everything before them is reported.",
            "",
        ]
    if rec.unknown:  # written by a newer version
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted(rec.unknown.items()))
        out += [f"> Note: journal events of kinds this version does not know were skipped: "
                f"{kinds}.", ""]  # fmt: skip
    if png:
        out += [f"![loss, grad norm and LR with incidents]({os.path.basename(png)})", ""]
    elif why_no_png:
        out += [f"> No plot: {why_no_png}", ""]
    out += ["## Totals", "", "| | |", "|---|---|"]
    out += [
        f"| incidents | {t['incidents']} ({t['incidents_explained_by_data']} explained by "
        f"data, {t['incidents_unexplained']} unexplained) |",
        f"| rollbacks | {t['rollbacks']} |",
        f"| restarts | {t['restarts']} |",
        f"| steps lost to rollback | {t['steps_lost_to_rollback']} |",
        f"| goodput | {_share(t['goodput'].goodput)} of {t['goodput'].wall_s:.1f} s of wall time "
        "(see Goodput) |",
        f"| quarantined samples | {t['quarantined_samples']}"
        + (
            f" ({t['quarantined_fraction']:.2%} of {t['samples_seen']} distinct samples seen)"
            if t["samples_seen"]
            else ""
        )
        + " |",
    ]
    if t["nodes"]:  # under the supervisor
        out += [f"| nodes | {len(t['nodes'])}: {', '.join(t['nodes'])} |"]
    gaps = metric_gaps(sorted({int(m["step"]) for m in rec.metrics}))
    if gaps:  # rows lost when a process died with them buffered: the plot breaks there
        spans = ", ".join(f"{a + 1}-{b - 1}" for a, b in gaps)
        out += [f"| steps without metrics | {spans} (lost in a crash; not drawn) |"]
    out += ["", "## Goodput", "", *goodput_table(t["goodput"])]
    out += [
        "",
        "## Timeline",
        "",
        "| time | step | event | evidence | action |",
        "|---|---|---|---|---|",
    ]
    out += [f"| {a} | {b} | {c} | {d} | {e} |" for a, b, c, d, e in timeline(rec)]
    out += ["", "## Quarantine", "", *_quarantine_table(rec)]
    return "\n".join(out) + "\n"


def _quarantine_table(rec: RunRecord) -> list[str]:
    quarantines = rec.of(Quarantine)
    if not quarantines:
        return ["No sample was quarantined."]
    out = ["| sample | quarantined at step | why | ledger |", "|---|---|---|---|"]
    incidents = {e.step: e.record.reason for e in rec.of(Incident)}
    for q in quarantines:
        why = incidents.get(q.step, "incident")
        for i in q.record.samples:
            out.append(f"| {i} | {q.step} | {why} | {q.details.get('ledger', '')} |")
    return out


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def goodput_table(led: Ledger) -> list[str]:
    """The ledger's split of the wall time (orchestrator/goodput.py), largest first."""
    if led.wall_s <= 0:
        return ["No attempt has run yet."]
    rows = ["| where the time went | seconds | share | what |", "|---|---|---|---|"]
    for kind, seconds in sorted(led.parts.items(), key=lambda kv: -kv[1]):
        if seconds > 0 or kind == "productive":
            rows.append(f"| {kind} | {seconds:.2f} | {seconds / led.wall_s:.1%} | {KINDS[kind]} |")
    rows.append(f"| **wall** | {led.wall_s:.2f} | goodput {_share(led.goodput)} | |")
    return rows


def metric_gaps(steps: list[int]) -> list[tuple[int, int]]:
    """(last step before, first step after) of each stretch with no metrics rows: rows lost
    when a process died with them buffered. A gap is a step more than twice the usual
    spacing (metrics.every_steps) past the row before it."""
    if len(steps) < 3:
        return []
    spacing = statistics.median(b - a for a, b in itertools.pairwise(steps))
    return [(a, b) for a, b in itertools.pairwise(steps) if b - a > 2 * max(spacing, 1)]


# --- the picture --------------------------------------------------------------------------------
def plot(rec: RunRecord, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    final: dict[float, dict[str, Any]] = {}
    for m in rec.metrics:  # a replayed step's last record wins: the timeline kept
        final[int(m["step"])] = m
    gaps = metric_gaps(sorted(int(s) for s in final))
    for a, _ in gaps:  # a NaN point in each gap breaks the lines: nothing drawn through it
        final[a + 0.5] = {}
    steps = sorted(final)
    fig = plt.figure(figsize=(11, 8))
    grid = fig.add_gridspec(3, 1, height_ratios=[3, 2, 0.7])
    ax_loss = fig.add_subplot(grid[0])
    ax_gn = fig.add_subplot(grid[1], sharex=ax_loss)
    _goodput_bar(fig.add_subplot(grid[2]), rec.goodput)
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
    gn = [final[s].get("grad_norm", math.nan) for s in steps]
    ax_gn.plot(steps, gn, lw=1, color="tab:gray", label="grad norm")
    if any(v is not None and v > 0 for v in gn):
        ax_gn.set_yscale("log")
    ax_gn.set_ylabel("grad norm")
    ax_gn.set_xlabel("step")
    classes = {e.record.incident_step: e.record.classification for e in rec.of(Diagnosis)}
    for ax in (ax_loss, ax_gn):
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
    handles = [
        plt.Line2D([], [], color="tab:red", lw=1.5, label="incident"),
        plt.Rectangle((0, 0), 1, 1, color="tab:red", alpha=0.12, label="rolled back"),
        plt.Line2D([], [], color="black", ls="--", label="restart (resumed step)"),
        plt.Line2D([], [], color="tab:blue", marker="v", ls="", label="durable snapshot"),
    ]
    if gaps:
        handles.append(plt.Rectangle((0, 0), 1, 1, color="tab:gray", alpha=0.15, hatch="//",
                                     label="no metrics (lost in a crash)"))  # fmt: skip
    ax_loss.legend(handles=handles, loc="upper right", fontsize=8)
    t = totals(rec)
    fig.suptitle(
        f"{t['incidents']} incident(s), {t['rollbacks']} rollback(s), {t['restarts']} "
        f"restart(s), {t['quarantined_samples']} quarantined sample(s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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


def write_report(run_dir: str, out_dir: str | None = None) -> tuple[str, str | None]:
    """Write report.md (always) and report.png (with matplotlib); return their paths."""
    rec = load(run_dir)
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    png: str | None = os.path.join(out_dir, "report.png")
    why = None
    try:
        if not rec.metrics:
            raise RuntimeError(f"no {os.path.join(run_dir, 'metrics.jsonl')} (metrics off?)")
        plot(rec, png)  # type: ignore[arg-type]
    except ImportError:
        png, why = None, "matplotlib is not installed: pip install -e '.[report]'"
    except RuntimeError as err:
        png, why = None, str(err)
    md = os.path.join(out_dir, "report.md")
    with open(md, "w", encoding="utf-8") as f:
        f.write(markdown(run_dir, rec, png, why))
    return md, png
