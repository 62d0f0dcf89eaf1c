"""`orchestrator status RUN_DIR`: where a run stands, in one screen."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

from launch.hangs import culprit_words
from launch.nodes import supervisors
from orchestrator.events import (
    Event,
    EventLog,
    Hang,
    Incident,
    Quarantine,
    Restart,
    Rollback,
    SupervisorExit,
    first_each_attempt,
    of,
    quarantine_fraction,
    quarantine_share,
)
from orchestrator.goodput import ledger
from orchestrator.goodput_inplace import summary
from orchestrator.heartbeat import STEP_PHASES, progress_time, read_heartbeats
from orchestrator.journal import read_events, read_metrics
from orchestrator.journal_tail import JournalTail
from orchestrator.layout import SnapshotLayout, default_url
from orchestrator.policy import load_policy
from orchestrator.protocol import POLICY_NAME

# Past this many nodes (ranks) the screen shows a summary and only those that need a look,
# not one line each: 1,024 nodes of 8 ranks would be 9,000 lines (docs/scale.md). ``--all``
# shows every one.
EACH_NODE_UP_TO, EACH_RANK_UP_TO = 16, 64
NEED_A_LOOK = 10  # nodes (ranks) listed under a summary, the most urgent first
QUIET_S = 30.0  # a running supervisor whose file is older than this is listed as quiet


def render(run_dir: str, every: bool = False, log: EventLog | None = None) -> str:
    """The screen: every node's supervisor and every rank's heartbeat when ``every`` or
    when there are few, else a summary of them and the ones that need a look. ``log``:
    the journal's events when the caller has them (read as it grows), else read here."""
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        return f"{run_dir}: no such run directory"
    log = read_events(run_dir) if log is None else log
    events = log.events
    lines = [f"run {run_dir}", *_journal_lines(log), _counts_line(events)]
    lines += _goodput_lines(events, read_metrics(run_dir))
    lines += _last_word(events)
    sups, beats = supervisors(run_dir), read_heartbeats(run_dir)
    few = every or len(sups) <= EACH_NODE_UP_TO
    lines += _supervisor_lines(sups) if few else _supervisor_summary(sups)
    few = every or len(beats) <= EACH_RANK_UP_TO
    lines += _heartbeat_lines(beats) if few else _heartbeat_summary(beats)
    lines.append(_snapshots_line(run_dir))
    lines += _inplace_lines(events)
    shown = ("incident", "restart", "hang", "gave_up", "rank_replaced", "inplace_failed")
    for e in [e for e in events if e.kind in shown][-5:]:
        lines.append(_row(e))
    return "\n".join(lines)


def _journal_lines(log: EventLog) -> list[str]:
    """What reading the journal skipped: damaged lines, kinds this version does not know."""
    lines = []
    damaged = log.damaged
    if damaged:  # a crash or a full disk mid-write, or a line that is no event
        lines.append(
            f"  journal: {len(damaged)} damaged line(s) skipped ({', '.join(damaged[:3])}"
            + (", ..." if len(damaged) > 3 else "") + ")"
        )  # fmt: skip
    if log.unknown:  # kinds of a newer version
        known = ", ".join(f"{k} ({n})" for k, n in sorted(log.unknown.items()))
        lines.append(f"  journal: events of kinds this version does not know skipped: {known}")
    return lines


def _counts_line(events: list[Event[Any]]) -> str:
    """The attempt, the newest step, and how many restarts, hangs, incidents (by cause),
    rollbacks and quarantined samples the run has had."""
    attempt = max((e.attempt for e in events), default=0)
    share, fraction = quarantine_share(events), quarantine_fraction(events)
    if share is not None and fraction is not None:
        quarantined = f"{share[0]} ({fraction:.2%} of {share[1]} samples seen)"
    else:
        quarantined = str(sum(len(e.record.samples) for e in of(events, Quarantine)))
    incidents = of(events, Incident)
    causes = Counter(e.record.cause for e in incidents)
    return (
        f"  attempt {attempt}   newest step {max((e.step for e in events), default=0)}   "
        f"restarts {len(first_each_attempt(events, Restart))}   "
        f"hangs {len(first_each_attempt(events, Hang))}   incidents {len(incidents)} "
        f"(data {causes['data']}, unexplained {causes['unexplained']})   "
        f"rollbacks {len(of(events, Rollback))}   quarantined {quarantined}"
    )


def _goodput_lines(events: list[Event[Any]], rows: list[dict[str, Any]]) -> list[str]:
    """The goodput and the largest losses (none before the run has taken any time)."""
    led = ledger(events, rows)
    if led.wall_s <= 0:
        return []
    lost = sorted(
        ((k, v) for k, v in led.parts.items() if k != "productive" and v >= 0.05),
        key=lambda kv: -kv[1],
    )
    return [
        f"  goodput {led.goodput:.1%}: productive {led.parts['productive']:.0f} s of "
        f"{led.wall_s:.0f} s" + (
            "; " + ", ".join(f"{k} {v:.1f} s" for k, v in lost[:5]) if lost else "")
    ]  # fmt: skip


def _inplace_lines(events: list[Event[Any]]) -> list[str]:
    """The in-place recoveries (issue 33), apart from restarts: their time and the work
    they made the ranks do again."""
    s = summary(events)
    if not s["count"]:
        return []
    return [
        f"  in-place recoveries {s['count']} (ranks {s['replaced']}): {s['seconds']:.1f} s "
        f"fault to next step (longest {s['longest_s']:.1f} s), {s['redone_s']:.1f} s redone"
    ]


def _last_word(events: list[Event[Any]]) -> list[str]:
    """How the supervisor exited, when its last word was its exit; else the last event."""
    last = events[-1] if events else None
    sup = [e for e in events if e.kind in ("attempt_start", "supervisor_exit")]
    exit_event = sup[-1] if sup and isinstance(sup[-1].record, SupervisorExit) else None
    if exit_event is not None and isinstance(exit_event.record, SupervisorExit):
        said = exit_event.record
        return [f"  supervisor exited {said.exit_code}: {said.reason}"]
    if last:
        age = time.time() - last.time
        return [f"  last event {last.kind} at step {last.step}, {age:.0f} s ago"]
    return []


def _supervisor_lines(sups: list[dict[str, Any]]) -> list[str]:
    """A table of every node's supervisor: who, which attempt, running or exited how."""
    if not sups:
        return []
    lines = ["  node        supervisor                      attempt  state"]
    for info in sups:
        state = info.get("state", "?")
        if state == "exited":
            state += f" {info.get('exit_code')}: {info.get('reason', '')}"
        else:
            state += f" (beat {time.time() - float(info.get('time', 0)):.0f} s ago)"
        who = f"pid {info.get('pid', '?')} on {info.get('host', '?')}"
        lines.append(
            f"  {info.get('node', '?'):<10}  {who:<30}  {info.get('attempt', '?'):>7}  {state}"
        )
    return lines


def _supervisor_summary(sups: list[dict[str, Any]]) -> list[str]:
    """Many nodes: how many run and how many exited (by code), then the table's rows of
    those that need a look: exited other than 0, then running but quiet, oldest first."""
    now = time.time()
    running = [s for s in sups if s.get("state") != "exited"]
    quiet = sorted(
        (s for s in running if now - float(s.get("time", 0)) >= QUIET_S),
        key=lambda s: float(s.get("time", 0)),
    )
    codes = Counter(str(s.get("exit_code")) for s in sups if s.get("state") == "exited")
    failed = [s for s in sups if s.get("state") == "exited" and s.get("exit_code") != 0]
    said = f"  nodes {len(sups)}: running {len(running)}"
    if quiet:
        said += f" ({len(quiet)} quiet: no beat for {QUIET_S:.0f} s or more)"
    if codes:
        by_code = ", ".join(f"code {c}: {n}" for c, n in sorted(codes.items()))
        said += f", exited {sum(codes.values())} ({by_code})"
    look = failed + quiet
    return [said, *_supervisor_lines(look[:NEED_A_LOOK]), *_more(len(look), "node")]


def _more(listed: int, what: str) -> list[str]:
    """The line that says how many were left out of a summary's list, and how to see them."""
    left = listed - NEED_A_LOOK
    if left <= 0:
        return []
    return [f"  ... and {left} more (orchestrator status --all: every {what})"]


def _heartbeat_summary(beats: list[dict[str, Any]]) -> list[str]:
    """Many ranks: their attempts, steps and phases counted, then the table's rows of the
    ranks furthest behind (an older attempt, an earlier step or phase: a hang's suspects),
    the oldest progress first among equals."""
    now = time.time()
    steps = [int(b["step"]) for b in beats]
    phases = Counter(str(b.get("phase", "")) for b in beats)
    attempts = Counter(int(b["attempt"]) for b in beats)
    by_age = sorted(beats, key=progress_time)
    behind = sorted(beats, key=lambda b: (int(b["attempt"]), int(b["step"]),
                                          _phase_at(b), progress_time(b)))  # fmt: skip
    lines = [
        f"  ranks {len(beats)}: attempt "
        + ", ".join(f"{a} ({n})" for a, n in sorted(attempts.items()))
        + f"; steps {min(steps)} to {max(steps)}; "
        + ", ".join(f"{p} {n}" for p, n in phases.most_common())
        + f"; progress {now - progress_time(by_age[-1]):.1f} s to "
        f"{now - progress_time(by_age[0]):.1f} s ago; furthest behind:"
    ]
    return lines + _heartbeat_lines(behind[:NEED_A_LOOK]) + _more(len(beats), "rank")


def _phase_at(beat: dict[str, Any]) -> int:
    """Where in the step a rank is (after the step's phases: anything else)."""
    phase = beat.get("phase")
    return STEP_PHASES.index(phase) if phase in STEP_PHASES else len(STEP_PHASES)


def _heartbeat_lines(beats: list[dict[str, Any]]) -> list[str]:
    """A table of each rank's latest heartbeat: attempt, step, phase, age of its progress."""
    if not beats:
        return []
    lines = ["  rank  attempt  step     phase       progress age    node (host)"]
    for b in beats:
        age = time.time() - progress_time(b)
        lines.append(
            f"  {b['rank']:>4}  {b['attempt']:>7}  {b['step']:>6}   {b.get('phase', ''):<10}  "
            f"{age:>10.1f} s   {b.get('node', '')} ({b.get('host', '')})"
        )
    return lines


def _snapshots_line(run_dir: str) -> str:
    """The newest committed durable snapshots, at the URL the run's policy names."""
    try:
        policy_file = os.path.join(run_dir, POLICY_NAME)
        policy = load_policy(policy_file) if os.path.exists(policy_file) else None
        url = (policy.persist.url if policy else None) or default_url(run_dir)
        committed = SnapshotLayout(url).committed_steps()
        return (
            f"  durable snapshots: {committed[:5] if committed else 'none'} (newest first) at {url}"
        )
    except Exception as err:  # status must always print
        return f"  durable snapshots: cannot list ({err})"


def _row(e: Event[Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(e.time))
    where = f" on {e.details['node']}" if "node" in e.details else ""
    return f"  {when} attempt {e.attempt} step {e.step}{where}: {e.kind} {_brief(e)}"


def _brief(e: Event[Any]) -> str:
    details = e.details
    keep = ("reason", "cause", "returncode", "origin_ranks", "stalled_ranks", "suspects", "why")
    said = " ".join(f"{k}={details[k]}" for k in keep if k in details)
    culprits = e.record.culprits if isinstance(e.record, Hang) else None
    for c in culprits or []:  # a hang's, named from the phases or the stacks
        said += f" culprit: {culprit_words(c)}"
    return said


def follow(run_dir: str, interval: float = 2.0, every: bool = False) -> int:
    """Redraw the status in place every ``interval`` seconds until every node's supervisor
    has exited (or Ctrl-C)."""
    tail = JournalTail(os.path.abspath(run_dir))  # each look reads what was appended
    try:
        while True:
            log = tail.update()
            screen = render(run_dir, every, log)
            print("\x1b[H\x1b[2J" + screen, flush=True)  # home, clear: refresh in place
            sups = supervisors(run_dir)
            if sups and all(s.get("state") == "exited" for s in sups):
                return 0  # every node's supervisor has stopped
            if not sups and log.of(SupervisorExit):
                return 0  # a run directory from before the supervisors' files
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
