"""Metrics and the run report: `orchestrator report` on the demo's run directory (a NaN and
a crash-restart), a journal whose last line was torn by a crash, and the update-to-weight
ratio warning."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from inproc import events, train

from conftest import run

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("demo") / "run"
    r = run([sys.executable, "-m", "launch.cli", "demo", "--run-dir", str(d)], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    return d


def report(run_dir: Path, out: Path) -> str:
    r = run([sys.executable, "-m", "launch.cli", "report", str(run_dir), "--out", str(out)])
    assert r.returncode == 0, r.stdout[-3000:]
    return (out / "report.md").read_text()


def test_report_of_the_demo(demo: Path, tmp_path: Path) -> None:
    md = report(demo, tmp_path)
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    import matplotlib.image

    height, width = matplotlib.image.imread(str(tmp_path / "report.png")).shape[:2]
    assert (width, height) == (1100, 800)  # three panels and the goodput bar
    rows = [line.split(" | ") for line in md.splitlines() if line.startswith("| 20")]
    incident = [r for r in rows if r[2] == "incident"]
    assert len(incident) == 1 and incident[0][1] == "37"
    assert incident[0][4].startswith("rolled back to 30")
    assert [r[2] for r in rows].count("restart") == 1 and "resume" in [r[2] for r in rows]
    assert "| incidents | 1 (0 explained by data, 1 unexplained) |" in md
    assert "| restarts | 1 |" in md
    metrics = [json.loads(line) for line in (demo / "metrics.jsonl").read_text().splitlines()]
    assert {"loss", "grad_norm", "lr", "step"} <= set(metrics[-1])
    assert max(m["step"] for m in metrics) == 119  # the demo's last step (0-based)


def test_report_survives_a_torn_journal_line(demo: Path, tmp_path: Path) -> None:
    torn = tmp_path / "run"
    shutil.copytree(demo, torn)
    (path,) = (torn / "journal").glob("*.jsonl")
    lines = path.read_text().splitlines()
    with open(path, "a") as f:
        f.write('{"time": 1795400000.0, "kind": "incid')  # a crash mid-write
    md = report(torn, tmp_path / "out")
    where = f"journal/{path.name}:{len(lines) + 1}"
    assert f"1 journal line(s) could not be read and were skipped ({where};" in md
    assert any(" | 37 | incident | " in line for line in md.splitlines())  # the rest is there


def test_update_ratio_low_is_journaled(tmp_path: Path) -> None:
    ok = tmp_path / "ok"
    train(ok, {"metrics": {"update_ratio_every": 2}}, steps=20)
    assert events(ok, "update_ratio_low") == []
    ratios = [json.loads(x).get("update_ratio") for x in (ok / "metrics.jsonl").open()]
    measured = [r for r in ratios if r is not None]
    assert len(measured) == 10 and all(1e-3 < r < 1 for r in measured)
    low = tmp_path / "low"  # a threshold above every ratio: the warning fires, once
    policy = {"metrics": {"update_ratio_every": 2, "update_ratio_warn": 1.0}}
    train(low, policy, steps=20)
    (event,) = events(low, "update_ratio_low")
    assert event["step"] == 4 and event["details"]["measurements"] == 3


def test_metrics_lost_in_a_crash_are_a_gap_not_a_line(tmp_path: Path) -> None:
    """Rows a SIGKILL lost leave a gap: the plot breaks its lines there and shades it."""
    from launch.report import metric_gaps, write_report

    assert metric_gaps([0, 1, 2, 3, 10, 11, 12]) == [(3, 10)]
    assert metric_gaps([0, 5, 10, 40, 45, 50]) == [(10, 40)]  # metrics.every_steps: 5
    assert metric_gaps([0, 1, 2, 3, 4]) == []
    d = tmp_path / "run"
    d.mkdir()
    rows = [
        {"step": s, "loss": 2.0 - s / 100, "grad_norm": 1.0} for s in [*range(10), *range(30, 40)]
    ]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "journal").mkdir()
    (d / "journal" / "n0.jsonl").write_text("")
    md_path, png = write_report(str(d))
    assert png is not None and Path(png).read_bytes()[:4] == b"\x89PNG"
    assert (
        "| steps without metrics | 10-29 (lost in a crash; not drawn) |"
        in Path(md_path).read_text()
    )


NO_TORCH = (
    "import sys; sys.modules['torch'] = None  # any `import torch` now raises\n"
    "from launch.cli import main; code = main(sys.argv[1:])\n"
    "assert sys.modules['torch'] is None; sys.exit(code)\n"
)
LAYOUT = (
    "import sys; sys.modules['torch'] = None\n"
    "from orchestrator.layout import SnapshotLayout\n"
    "s = SnapshotLayout(sys.argv[1]); c = [c for c in s.candidates() if c.committed]\n"
    "assert c and [s.check_files(x) for x in c] == [None] * len(c)\n"
    "print('valid', [x.step for x in c]); assert sys.modules['torch'] is None\n"
)


def test_status_and_report_run_where_torch_does_not_import(demo: Path, tmp_path: Path) -> None:
    """`orchestrator status` and `report` on the demo's run directory, in a process where
    importing torch fails, print what they print with torch (the heartbeats' ages aside);
    the durable snapshots are listed (`status`, `snapshots --quick`) and their files validated
    (sizes, sha256) too."""

    def cli(torch: bool, *args: str) -> str:
        head = [sys.executable, "-m", "launch.cli"] if torch else [sys.executable, "-c", NO_TORCH]
        r = run([*head, *args], timeout=120)
        assert r.returncode == 0, r.stdout[-3000:]
        return r.stdout

    def ages(screen: str) -> str:  # the heartbeats' ages and the last event's, which tick
        return re.sub(r"\d+(\.\d+)? s\b", "_ s", screen)

    screen = cli(False, "status", str(demo))
    assert ages(screen) == ages(cli(True, "status", str(demo)))
    assert re.search(r"durable snapshots: \[\d+", screen), screen
    assert "restarts 1" in screen and "incidents 1" in screen
    cli(False, "report", str(demo), "--out", str(tmp_path / "without"))
    cli(True, "report", str(demo), "--out", str(tmp_path / "with"))
    md = (tmp_path / "without" / "report.md").read_text()
    assert md == (tmp_path / "with" / "report.md").read_text()
    assert "| incidents | 1 (0 explained by data, 1 unexplained) |" in md
    assert "committed (not verified: --quick)" in cli(False, "snapshots", str(demo), "--quick")
    r = run([sys.executable, "-c", LAYOUT, str(demo / "snapshots")], timeout=60)
    assert r.returncode == 0 and "valid [" in r.stdout, r.stdout[-3000:]
