"""`orchestrator report RUN_DIR`: one picture and one page on a run.

report.png: loss and grad norm against the step, the LR on a second axis, incidents as
vertical lines coloured by classification, rolled-back steps shaded, restarts and durable
snapshots marked, and the wall time split by the goodput ledger (drawn by
:mod:`launch.report_plot`; needs matplotlib: ``pip install -e '.[report]'``). report.md: the
totals, the goodput split, the timeline (time, step, event, evidence, action), and the
quarantine list with where each sample id came from. Both from the journal (every node's,
merged by time) and RUN_DIR/metrics.jsonl only: the report works on a finished, crashed or
running run alike.
"""

from __future__ import annotations

import functools
import itertools
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from launch.hangs import culprit_words
from orchestrator.events import (
    AttemptStart,
    Diagnosis,
    Event,
    Incident,
    Quarantine,
    Recovered,
    Restart,
    Resume,
    Rollback,
    first_each_attempt,
    of,
    quarantine_fraction,
    quarantine_share,
)
from orchestrator.events.base import R
from orchestrator.goodput import KINDS, Ledger, ledger
from orchestrator.goodput_inplace import summary
from orchestrator.journal import read_events, read_metrics


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


# Every node's supervisor journals the job's restart: past this many nodes in one attempt, a
# restart is one row per cause (the first node to say it, and how many others did), and the
# totals name the first nodes only. 1,024 nodes would otherwise be 1,024 rows (docs/scale.md).
EACH_NODE_UP_TO = 16


def timeline(rec: RunRecord) -> list[tuple[str, Any, str, str, str]]:
    """(time, step, event, evidence, action) rows, oldest first."""
    rows = []
    per_attempt = Counter(e.attempt for e in rec.of(Restart))
    per_cause = Counter((e.attempt, e.record.cause, e.record.returncode) for e in rec.of(Restart))
    said: set[tuple[int, str | None, int | None]] = set()
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
            cause = (e.attempt, r.cause, r.returncode)
            many = per_attempt[e.attempt] > EACH_NODE_UP_TO
            if many and cause in said:
                continue  # said once, with how many nodes said it
            said.add(cause)
            where = f" on {r.node}" if "node" in d else ""
            if many and per_cause[cause] > 1:
                where += f" and {per_cause[cause] - 1} other nodes"
            rows.append(
                (
                    when,
                    e.step,
                    "restart",
                    f"attempt ended: {r.cause} (exit {r.returncode}){where}",
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
        "quarantined_fraction": quarantine_fraction(rec.events) if share else None,
        "rollbacks": len(rollbacks),
        "restarts": len(restarts),
        # dead ranks replaced alone (issue 33): not restarts, counted apart with their time
        "inplace": summary(rec.events),
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
        f"| in-place recoveries | {t['inplace']['count']} ({t['inplace']['seconds']:.1f} s fault "
        f"to next step, {t['inplace']['redone_s']:.1f} s of steps redone) |",
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
        names = t["nodes"]
        if len(names) > EACH_NODE_UP_TO:
            names = [*names[: EACH_NODE_UP_TO // 2], "...", names[-1]]
        out += [f"| nodes | {len(t['nodes'])}: {', '.join(names)} |"]
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


# --- both (the picture is launch/report_plot.py's) ----------------------------------------------
def write_report(run_dir: str, out_dir: str | None = None) -> tuple[str, str | None]:
    """Write report.md (always) and report.png (with matplotlib); return their paths."""
    rec = load(run_dir)
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    png: str | None = os.path.join(out_dir, "report.png")
    why = None
    try:
        from launch.report_plot import plot  # the figure's module imports this one

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
