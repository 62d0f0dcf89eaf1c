"""`orchestrator drill --quick` as a user runs it: DDP, seven faults, each cell under the
supervisor in its own run directory, judged against a clean run; every cell must pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import assert_bitwise_equal, final_states, kinds, run
from launch.drill import BEGIN, END, QUICK, update_readme

pytestmark = pytest.mark.timeout(900)


def test_the_quick_drill_passes(tmp_path: Path) -> None:
    out = tmp_path / "drill"
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}\nold table\n{END}\n\nafter\n")
    cmd = [sys.executable, "-m", "launch.cli", "drill", "--quick", "--out", str(out),
           "--readme", str(readme)]  # fmt: skip
    r = run(cmd, timeout=840)
    assert r.returncode == 0, r.stdout[-4000:]
    doc = json.loads((out / "drill.json").read_text())
    cells = {c["fault"]: c for c in doc["cells"]}
    assert list(cells) == list(QUICK) and {c["engine"] for c in doc["cells"]} == {"ddp"}
    clean = final_states(out / "ddp" / "_clean")
    for name, c in cells.items():
        assert c["passed"] and c["data_lost"] == [], (name, c)
        assert c["bitwise"] == "yes", (name, c)  # every quick fault promises it
        for a, b in zip(clean, final_states(Path(c["run_dir"])), strict=True):
            assert_bitwise_equal(a, b, name)  # checked here too, not only by the drill
        assert c["steps_lost"] is not None and c["recovery_s"] is not None, (name, c)
    assert cells["preempt"]["exit_codes"] == [73, 0] and cells["preempt"]["steps_lost"] == 0
    # The crash at 27 resumes from the ring in shared memory (the default where /dev/shm
    # has room): from step 25, its newest sealed snapshot, not the durable tier's 20.
    assert cells["nan"]["steps_lost"] == 3 and cells["crash"]["steps_lost"] == 2
    # Under the node agent the dead rank alone is replaced, from its own shared-memory slot.
    assert cells["crash_inplace"]["in_place"] == "yes: rank 1 from shm", cells["crash_inplace"]
    assert cells["crash_inplace"]["steps_lost"] == 2 and cells["crash"]["in_place"] == "-"
    # The crash as the supervisor saw it: the crash's own step (not the last heartbeat's,
    # an interval older), and each attempt's output kept.
    crash = Path(cells["crash"]["run_dir"])
    (restart,) = kinds(crash, "restart")
    assert (restart["details"]["cause"], restart["attempt"], restart["step"]) == ("crash", 0, 27)
    (end,) = [e for e in kinds(crash, "attempt_end") if e["attempt"] == 0]
    assert end["details"]["best_step"] == 27
    assert all((crash / "attempts" / a / "output.log").exists() for a in ("0", "1"))
    md = (out / "drill.md").read_text()
    text = readme.read_text()
    assert "old table" not in text and md.strip() in text and text.endswith("after\n")


def test_a_readme_without_the_markers_is_refused(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="drill:begin"):
        update_readme(readme, "| table |")
    assert readme.read_text() == "no markers\n"


def test_the_drills_bit_for_bit_check_sees_one_flipped_bit(tmp_path: Path) -> None:
    """The drill's verdict compares whole tensors as bytes: a flipped bit, -0.0 for 0.0 (equal
    as numbers), another NaN payload, another dtype or a missing rank's file are all a
    difference; the same state saved twice is not."""
    import torch

    from launch.drill import _same_final

    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(), "step": 7,
             "opt": [torch.zeros(3), {"lr": 0.1}]}  # fmt: skip

    def save(name: str, tree: dict, ranks: int = 2) -> Path:
        d = tmp_path / name
        d.mkdir()
        for r in range(ranks):
            torch.save(tree, d / f"rank{r}.pt")
        return d

    ref = save("ref", state)
    assert _same_final(ref, save("same", state))
    flipped = state["w"].clone()
    flipped.view(torch.int32)[0, 0] ^= 1
    neg_zero = [torch.tensor([-0.0, 0.0, 0.0]), {"lr": 0.1}]
    nan_a = torch.tensor([float("nan")])
    nan_b = nan_a.clone()
    nan_b.view(torch.int32)[0] ^= 1  # still a NaN, other bits
    for name, tree in [
        ("flipped", {**state, "w": flipped}),
        ("negzero", {**state, "opt": neg_zero}),
        ("dtype", {**state, "w": state["w"].double()}),
        ("step", {**state, "step": 8}),
    ]:
        assert not _same_final(ref, save(name, tree)), name
    assert not _same_final(save("nan_a", {"x": nan_a}), save("nan_b", {"x": nan_b}))
    assert not _same_final(ref, save("one_rank", state, ranks=1))
