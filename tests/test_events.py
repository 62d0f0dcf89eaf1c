"""The typed event protocol (orchestrator/events): every reader of the journal skips what
it cannot parse (unknown kinds, damaged lines: torn JSON, ``"details": null``, missing or
wrong-typed fields) and counts it, never a traceback. In-process, milliseconds."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from launch import outcomes
from launch.exporter import RunFollower, _newest_snapshots
from launch.report import load, markdown, timeline, totals
from launch.status import render
from orchestrator import events as E
from orchestrator import journal as journal_module
from orchestrator.audit import expected_snapshots
from orchestrator.goodput import ledger
from orchestrator.journal import (
    ENV_STRICT_EVENTS,
    Decisions,
    EventMisfit,
    Journal,
    load_journal,
    quarantine_share,
    read_events,
)

pytestmark = pytest.mark.timeout(60)


def ev(t: float, kind: str, step: int = 0, rank: int = 0, attempt: int = 0, **details: Any) -> dict:
    return {"time": t, "kind": kind, "step": step, "rank": rank, "attempt": attempt,
            "details": details}  # fmt: skip


# A supervised run: a NaN at step 12 rolled back to 10, a crash, a restart that resumes from
# step 10, a preemption, a quarantine, an unhealthy host and a persisted snapshot.
GOOD = [
    ev(0.0, "attempt_start", rank=-1, node="n0", host="h0", cmd=["x"]),
    ev(0.5, "run_start", world_size=2, quarantined=0, faults=0),
    ev(1.0, "first_step", 1, resumed=False),
    ev(2.0, "snapshot", 10, stall_ms=3, tier="memory", bytes=100, initial=False),
    ev(2.2, "persist", 10, url="U", bytes=100, write_s=0.1),
    ev(3.0, "incident", 12, reason="nonfinite_loss", cause="unexplained", loss=float("inf"),
       grad_norm=1.5, origin_ranks=[1], why="not_reproduced", budget="incidents"),
    ev(3.1, "diagnosis", 12, incident_step=12, classification="transient", actions=[],
       located=[{"module": "fc", "direction": "forward", "rank": 1}]),
    ev(3.2, "quarantine", 12, samples=[4, 5], reason="nonfinite_loss", ledger="L",
       persisted=True, total=2, samples_seen=64),
    ev(3.3, "rollback", 10, from_step=12, to_step=10, min_age_met=True, restore_ms=1.0),
    ev(3.4, "recovered", 10, incident={"step": 12, "started_at": 2.9, "rolled_back_to": 10,
                                       "lr_multiplier": 0.5, "quarantined": [4, 5]}),
    ev(4.0, "unhealthy", 11, reason="preflight", ranks=[1], hosts=["bad-host"], failed={}),
    ev(5.0, "attempt_end", 11, rank=-1, outcome="crash", returncode=1, best_step=11,
       ended_at=5.0, progress_time=4.5, node="n0"),
    ev(5.1, "restart", 11, rank=-1, cause="crash", returncode=1, restart=1, next_attempt=1,
       delay_s=1.0, node="n0"),
    ev(6.0, "attempt_start", rank=-1, attempt=1, node="n0", host="h0"),
    ev(6.5, "resume", 10, attempt=1, snapshot_step=10, tier="durable", url="U"),
    ev(7.0, "first_step", 11, attempt=1, resumed=True),
    ev(8.0, "preempting", 15, attempt=1),
    ev(8.5, "preempted", 15, attempt=1, persisted=False, url="U", durable_step=10, steps_lost=5),
    ev(9.0, "attempt_end", 15, rank=-1, attempt=1, outcome="preempted", best_step=15,
       ended_at=9.0, node="n0"),
    ev(9.1, "supervisor_exit", 15, rank=-1, attempt=1, exit_code=143, reason="stopped", node="n0"),
]  # fmt: skip

# Lines no reader may trace back on: not JSON, not an event, or details that do not fit
# their kind's record.
DAMAGED = [
    '{"time": 7.0, "kind": "rollb',  # torn by a crash mid-write
    "[1, 2]",
    '{"time": 5.0, "kind": "incident", "step": 3, "rank": 0, "attempt": 0, "details": null}',
    json.dumps(ev(3.35, "rollback", 10, from_step=12)),  # to_step missing
    json.dumps(ev(3.36, "rollback", 10, from_step=12, to_step="10")),  # a string
    json.dumps(ev(3.37, "recovered", 10, incident=None)),
    json.dumps(ev(3.38, "quarantine", 12, samples="4,5", total=9, samples_seen=10)),
    json.dumps(ev(3.39, "snapshot", 10, stall_ms="slow")),
    json.dumps(ev(3.40, "diagnosis", 12, classification="transient")),  # incident_step missing
    json.dumps(ev(5.05, "attempt_end", 11, rank=-1, ended_at="later", outcome="ok")),
    json.dumps(ev(6.55, "resume", 10, attempt=1, snapshot_step=None)),
    json.dumps(ev(8.6, "preempted", 15, attempt=1, persisted="yes")),
    json.dumps(ev(9.05, "supervisor_exit", 15, rank=-1, attempt=1, reason="no code")),
    json.dumps(ev(9.06, "unhealthy", 11, hosts=[1, 2])),
    json.dumps(ev(9.07, "stop_requested", 15, rank=-1, signal_time="now")),
    json.dumps({**ev(9.08, "hang", 15, rank=-1), "step": True}),  # a bool is no step
]
UNKNOWN = [json.dumps(ev(4.5, "warp_drive", 11, engaged=True))] * 2


def write(run_dir: Path, lines: list[str]) -> None:
    (run_dir / "journal").mkdir(parents=True, exist_ok=True)
    (run_dir / "journal" / "n0.jsonl").write_text("\n".join(lines) + "\n")


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    """(a run directory with GOOD, the same with the damaged and unknown lines among them)."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    write(good, [json.dumps(e) for e in GOOD])
    write(bad, [json.dumps(e) for e in GOOD[:5]] + DAMAGED + UNKNOWN
          + [json.dumps(e) for e in GOOD[5:]])  # fmt: skip
    return good, bad


def test_the_reader_skips_damaged_and_unknown_lines_with_a_count(runs: tuple[Path, Path]) -> None:
    good, bad = runs
    log = read_events(str(bad))
    assert [e.wire() for e in log.events] == GOOD
    assert log.damaged == [f"journal/n0.jsonl:{n}" for n in range(6, 6 + len(DAMAGED))]
    assert log.unknown == {"warp_drive": 2}
    assert log.skipped == len(DAMAGED) + 2
    (rb,) = log.of(E.Rollback)
    assert (rb.record.to_step, rb.record.from_step, rb.step) == (10, 12, 10)
    assert isinstance(log.of(E.SnapshotTaken)[0].record.stall_ms, float)  # 3 -> 3.0
    # The dict reader keeps events of unknown kinds (it names no fields) and skips the rest.
    events, damaged = load_journal(str(bad))
    assert [e for e in events if e["kind"] != "warp_drive"] == GOOD
    assert len(damaged) == len(DAMAGED)
    clean = read_events(str(good))
    assert clean.skipped == 0 and [e.wire() for e in clean.events] == GOOD


def test_every_kind_written_has_a_record_and_parse_never_raises() -> None:
    assert E.parse(ev(1.0, "persist_prune", deleted_steps=[1, 2])) != E.DAMAGED
    for junk in (
        None,
        1,
        "x",
        [],
        {},
        {"kind": 1},
        {**ev(1.0, "run_start"), "time": "1"},
        {**ev(float("inf"), "run_start")},
        {**ev(1.0, "run_start"), "details": []},
    ):
        assert E.parse(junk) == E.DAMAGED
    assert E.parse_line(b"\xff\xfe binary") == E.DAMAGED
    assert E.parse_line("[" * 100_000) == E.DAMAGED  # deeper than json can recurse
    assert E.parse(ev(1.0, "warp_drive")) == E.UNKNOWN
    for kind, cls in E.RECORDS.items():
        assert cls.KIND == kind and cls.WHO in ("ranks", "supervisor")
    table = E.table()
    assert all(f"| `{k}` |" in table for k in E.RECORDS)


def test_goodput_skips_damaged_events(runs: tuple[Path, Path]) -> None:
    good = [e.wire() for e in read_events(str(runs[0])).events]
    damaged = [json.loads(line) for line in DAMAGED[1:]] + [json.loads(UNKNOWN[0])]
    a = ledger(good, [])
    b = ledger(good + damaged, [])
    assert a.wall_s == b.wall_s == pytest.approx(9.0) and a.parts == b.parts
    assert a.by_attempt == b.by_attempt
    assert quarantine_share(good + damaged) == quarantine_share(good) == (2, 64)


def test_status_and_report_of_a_damaged_journal(runs: tuple[Path, Path]) -> None:
    good, bad = runs
    screen = render(str(bad))
    assert f"journal: {len(DAMAGED)} damaged line(s) skipped" in screen
    assert "events of kinds this version does not know skipped: warp_drive (2)" in screen
    same = screen.replace(str(bad), str(good)).splitlines()[3:]
    assert render(str(good)).splitlines()[1:] == same  # the rest: as without those lines
    assert "restarts 1   hangs 0   incidents 1 (data 0, unexplained 1)   rollbacks 1" in screen
    assert "supervisor exited 143: stopped" in screen
    rec, clean = load(str(bad)), load(str(good))
    assert rec.unknown == {"warp_drive": 2} and len(rec.skipped) == len(DAMAGED)
    assert timeline(rec) == timeline(clean)
    assert totals(rec) == totals(clean)
    t = totals(rec)
    assert (t["incidents"], t["rollbacks"], t["restarts"], t["steps_lost_to_rollback"]) == (
        1, 1, 1, 2)  # fmt: skip
    md = markdown(str(bad), rec, None, None)
    assert "warp_drive (2)" in md and "| 4 | 12 | nonfinite_loss | L |" in md
    (row,) = [r for r in timeline(rec) if r[2] == "incident"]
    assert row[3].endswith("transient in fc (forward, rank 1)")
    assert row[4] == "rolled back to 10; LR x0.5; quarantined [4, 5]"


def test_supervisor_readers_skip_damaged_events(runs: tuple[Path, Path]) -> None:
    good, bad = runs
    for d in (str(good), str(bad)):
        assert outcomes.classify(d, 1, 0) == outcomes.UNHEALTHY
        assert outcomes.classify(d, 1, 1) == outcomes.PREEMPTED
        pre = outcomes.preemption(d, 1)
        assert pre is not None and pre["details"]["steps_lost"] == 5
        assert outcomes.last_journaled_step(d, 1) == 15
        assert outcomes.exclude_hosts(d) == ["bad-host"]
        assert outcomes.next_attempt_number(d, "n0") == 2
        assert outcomes.history(d, "n0") == (15, 0)
        assert outcomes.gave_up_reason(d, 0).startswith("a budget is spent")


def test_audit_and_exporter_skip_damaged_events(runs: tuple[Path, Path]) -> None:
    bad = runs[1]
    events, _ = load_journal(str(bad))
    assert expected_snapshots(events, "U") == expected_snapshots(GOOD, "U") == {10}
    prune = ev(9.5, "persist_prune", 20, deleted_steps=[10])
    assert expected_snapshots([*GOOD, prune, {**prune, "details": None}], "U") == set()
    follower = RunFollower(str(bad))
    follower.update()
    assert follower.skipped == len(DAMAGED) + 2
    assert [e.wire() for e in sorted(follower.events, key=lambda e: e.time)] == GOOD
    assert set(_newest_snapshots(follower.events)) == {"memory", "durable"}


def test_the_journal_writes_what_the_protocol_reads(tmp_path: Path) -> None:
    j = Journal(str(tmp_path), rank=0, attempt=3)
    j.write("rollback", 7, {"from_step": 9, "to_step": 7, "min_age_met": True})
    j.write("snapshot", 7, {"stall_ms": 1, "tier": "shm"})
    j.close()
    log = read_events(str(tmp_path))
    assert log.skipped == 0
    rb, snap = log.events
    assert isinstance(rb.record, E.Rollback) and rb.record.to_step == 7 and rb.attempt == 3
    assert isinstance(snap.record, E.SnapshotTaken) and snap.record.tier == "shm"


def test_a_misfit_write_raises_in_strict_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the tests (``ORCHESTRATOR_STRICT_EVENTS=1``) a write whose kind has no record,
    or whose details do not fit it, is a writer's bug: it raises, naming the kind, the
    field and what the record expects, and nothing is written."""
    monkeypatch.setenv(ENV_STRICT_EVENTS, "1")
    j = Journal(str(tmp_path), rank=0, attempt=0)
    with pytest.raises(EventMisfit, match=r"'rollback'.*'to_step' is missing \(expected int\)"):
        j.write("rollback", 7, {"from_step": 9})
    with pytest.raises(
        TypeError, match=r"'snapshot'.*'stall_ms' is 'slow' \(str\), expected float"
    ):
        j.write("snapshot", 7, {"stall_ms": "slow"})
    with pytest.raises(EventMisfit, match=r"'resume'.*'snapshot_step' is None .*expected int"):
        j.emit(7, E.Resume(snapshot_step=None))  # type: ignore[arg-type]
    with pytest.raises(EventMisfit, match=r"'warp_drive'.*no record"):
        j.write("warp_drive", 7, {"engaged": True})
    with pytest.raises(EventMisfit, match=r"'rollback'.*\['from_step'\] are fields of Rollback"):
        j.emit(7, E.Rollback(to_step=5), from_step=7)
    # What fits as the reader parses it is fine: a tuple is a JSON list, extras are free.
    j.write("persist_prune", 8, {"deleted_steps": (1, 2), "why": "retention"})
    j.close()
    log = read_events(str(tmp_path))
    assert log.skipped == 0 and [(e.kind, e.details) for e in log.events] == [
        ("persist_prune", {"deleted_steps": [1, 2], "why": "retention"})
    ]


def test_a_misfit_write_is_logged_once_and_written_in_production(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Outside the tests a misfit never loses the event nor stops training: the line is
    written (readers skip it as damaged or unknown, with a count) and the error is logged
    once per kind."""
    monkeypatch.delenv(ENV_STRICT_EVENTS, raising=False)
    monkeypatch.setattr(journal_module, "_MISFITS_SAID", set())
    j = Journal(str(tmp_path), rank=0, attempt=0)
    with caplog.at_level(logging.ERROR, logger="orchestrator.journal"):
        j.write("rollback", 7, {"from_step": 9})
        j.write("rollback", 8, {"from_step": 10})
        j.write("warp_drive", 9, {"engaged": True})
        j.write("rollback", 9, {"from_step": 10, "to_step": 7})
    j.close()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 2 and "'rollback'" in said[0] and "'warp_drive'" in said[1]
    lines = [json.loads(line) for line in Path(j.path).read_text().splitlines()]
    assert [(e["kind"], e["step"]) for e in lines] == [
        ("rollback", 7), ("rollback", 8), ("warp_drive", 9), ("rollback", 9)
    ]  # fmt: skip
    log = read_events(str(tmp_path))
    assert (len(log.damaged), log.unknown, len(log.events)) == (2, {"warp_drive": 1}, 1)


def test_a_record_is_written_as_its_fields(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The typed path: ``emit`` writes a record's fields as ``details`` (None ones left out
    with ``skip_none``), then the extras; ``Decisions.emit`` only on the writer."""
    monkeypatch.setenv(ENV_STRICT_EVENTS, "1")
    j = Journal(str(tmp_path), rank=0, attempt=1)
    pre = E.Preempted(persisted=False, url="U", durable_step=None, steps_lost=5)
    j.emit(15, pre)
    Decisions(j, writer=True).emit(
        15,
        E.RunEnd(status="stopped", steps=15, quarantined=[3]),
        skip_none=True,
        attempt_rollbacks=0,
    )
    Decisions(j, writer=False).emit(15, E.GaveUp(why="not the writer"))
    j.close()
    log = read_events(str(tmp_path))
    assert [e.details for e in log.events] == [
        {"persisted": False, "url": "U", "durable_step": None, "steps_lost": 5},
        {"status": "stopped", "steps": 15, "quarantined": [3], "attempt_rollbacks": 0},
    ]
    assert log.events[0].record == pre and log.events[1].record.samples_seen is None


def test_docs_list_every_record() -> None:
    """docs/run-dir.md holds the table the records generate (regenerate it with
    ``python -c "from orchestrator.events import table; print(table())"``)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "run-dir.md").read_text()
    begin, end = "<!-- events-table: begin -->\n", "<!-- events-table: end -->"
    assert doc[doc.index(begin) + len(begin) : doc.index(end)] == E.table() + "\n"


def test_an_old_run_directory_still_reads(tmp_path: Path) -> None:
    """A single journal.jsonl from before per-node files, its events as older versions
    wrote them (supervisor events naming the host only, no progress times, a quarantine
    without the data budget's counts): nothing is skipped, and the readers use it."""
    old = [
        ev(0.0, "attempt_start", rank=-1, host="h0", cmd=["python", "t.py"]),
        ev(1.0, "snapshot", 5, bytes=10),
        ev(2.0, "incident", 7, reason="nonfinite_loss", loss=1.0, grad_norm=2.0,
           origin_ranks=[], per_rank=[]),
        ev(2.1, "quarantine", 7, samples=[3]),
        ev(2.2, "rollback", 5, from_step=7, to_step=5),
        ev(2.3, "recovered", 5, incident={"step": 7}),
        ev(3.0, "attempt_end", 9, rank=-1, returncode=0, outcome="ok", host="h0"),
        ev(3.1, "supervisor_exit", 9, rank=-1, exit_code=0, reason="finished"),
    ]  # fmt: skip
    (tmp_path / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in old))
    log = read_events(str(tmp_path))
    assert log.skipped == 0 and [e.wire() for e in log.events] == old
    t = totals(load(str(tmp_path)))
    assert (t["nodes"], t["incidents"], t["steps_lost_to_rollback"]) == (["h0"], 1, 2)
    assert t["quarantined_samples"] == 1 and t["samples_seen"] is None
    assert ledger(log.events, []).wall_s == pytest.approx(3.0)
    assert "supervisor exited 0: finished" in render(str(tmp_path))
    assert outcomes.history(str(tmp_path), "h0") == (-1, 0)
