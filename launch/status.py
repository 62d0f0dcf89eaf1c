"""`orchestrator status RUN_DIR`: where a run stands, in one screen."""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any

from launch.hangs import culprit_words
from launch.nodes import supervisors
from orchestrator.goodput import ledger
from orchestrator.heartbeat import progress_time, read_heartbeats
from orchestrator.journal import (
    load_journal,
    per_attempt,
    quarantine_share,
    read_journal,
    read_metrics,
)
from orchestrator.policy import load_policy
from orchestrator.protocol import POLICY_NAME
from orchestrator.store import DurableStore, default_url


def render(run_dir: str) -> str:
    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        return f"{run_dir}: no such run directory"
    events, damaged = load_journal(run_dir)
    kinds = Counter(e["kind"] for e in events)
    attempt = max((int(e.get("attempt", 0)) for e in events), default=0)
    steps = [int(e["step"]) for e in events if isinstance(e.get("step"), int)]
    last = events[-1] if events else None
    sup = [e for e in events if e["kind"] in ("attempt_start", "supervisor_exit")]
    exit_event = sup[-1] if sup and sup[-1]["kind"] == "supervisor_exit" else None
    share = quarantine_share(events)
    if share is not None:
        quarantined = f"{share[0]} ({share[0] / max(share[1], 1):.2%} of {share[1]} samples seen)"
    else:
        n = sum(len(e["details"].get("samples", [])) for e in events if e["kind"] == "quarantine")
        quarantined = str(n)
    causes = Counter(e["details"].get("cause") for e in events if e["kind"] == "incident")
    lines = [f"run {run_dir}"]
    if damaged:  # a crash or a full disk mid-write, or a line that is no event
        lines.append(
            f"  journal: {len(damaged)} damaged line(s) skipped ({', '.join(damaged[:3])}"
            + (", ..." if len(damaged) > 3 else "") + ")"
        )  # fmt: skip
    lines.append(
        f"  attempt {attempt}   newest step {max(steps, default=0)}   "
        f"restarts {len(per_attempt(events, 'restart'))}   "
        f"hangs {len(per_attempt(events, 'hang'))}   incidents {kinds['incident']} "
        f"(data {causes['data']}, unexplained {causes['unexplained']})   "
        f"rollbacks {kinds['rollback']}   quarantined {quarantined}"
    )
    led = ledger(events, read_metrics(run_dir))
    if led.wall_s > 0:
        lost = sorted(
            ((k, v) for k, v in led.parts.items() if k != "productive" and v >= 0.05),
            key=lambda kv: -kv[1],
        )
        lines.append(
            f"  goodput {led.goodput:.1%}: productive {led.parts['productive']:.0f} s of "
            f"{led.wall_s:.0f} s" + (
                "; " + ", ".join(f"{k} {v:.1f} s" for k, v in lost[:5]) if lost else "")
        )  # fmt: skip
    if exit_event:
        d = exit_event["details"]
        lines.append(f"  supervisor exited {d['exit_code']}: {d['reason']}")
    elif last:
        age = time.time() - float(last["time"])
        lines.append(f"  last event {last['kind']} at step {last['step']}, {age:.0f} s ago")
    sups = supervisors(run_dir)
    if sups:
        lines.append("  node        supervisor                      attempt  state")
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
    beats = read_heartbeats(run_dir)
    if beats:
        lines.append("  rank  attempt  step     phase       progress age    node (host)")
        for b in beats:
            age = time.time() - progress_time(b)
            lines.append(
                f"  {b['rank']:>4}  {b['attempt']:>7}  {b['step']:>6}   {b.get('phase', ''):<10}  "
                f"{age:>10.1f} s   {b.get('node', '')} ({b.get('host', '')})"
            )
    try:
        policy_file = os.path.join(run_dir, POLICY_NAME)
        policy = load_policy(policy_file) if os.path.exists(policy_file) else None
        url = (policy.persist.url if policy else None) or default_url(run_dir)
        committed = DurableStore(url).committed_steps()
        lines.append(
            f"  durable snapshots: {committed[:5] if committed else 'none'} (newest first) at {url}"
        )
    except Exception as err:  # status must always print
        lines.append(f"  durable snapshots: cannot list ({err})")
    for e in [e for e in events if e["kind"] in ("incident", "restart", "hang", "gave_up")][-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(float(e["time"])))
        where = f" on {e['details']['node']}" if "node" in e["details"] else ""
        lines.append(f"  {when} attempt {e['attempt']} step {e['step']}{where}: {e['kind']} "
                     f"{_brief(e['details'])}")  # fmt: skip
    return "\n".join(lines)


def _brief(details: dict[str, Any]) -> str:
    keep = ("reason", "cause", "returncode", "origin_ranks", "stalled_ranks", "suspects", "why")
    said = " ".join(f"{k}={details[k]}" for k in keep if k in details)
    for c in details.get("culprits") or []:  # a hang's, named from the phases or the stacks
        said += f" culprit: {culprit_words(c)}"
    return said


def follow(run_dir: str, interval: float = 2.0) -> int:
    """Redraw the status in place every ``interval`` seconds until every node's supervisor
    has exited (or Ctrl-C)."""
    try:
        while True:
            screen = render(run_dir)
            print("\x1b[H\x1b[2J" + screen, flush=True)  # home, clear: refresh in place
            sups = supervisors(run_dir)
            if sups and all(s.get("state") == "exited" for s in sups):
                return 0  # every node's supervisor has stopped
            if not sups and any(e["kind"] == "supervisor_exit" for e in read_journal(run_dir)):
                return 0  # a run directory from before the supervisors' files
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
