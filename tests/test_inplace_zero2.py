"""Issue 33 with DeepSpeed ZeRO-2 (the real library, CPU, gloo): under `orchestrator launch
--nproc-per-node 2` rank 1 is SIGKILLed at step 27 and replaced alone; rank 0 keeps its
process, rebinds DeepSpeed to the re-formed world (orchestrator/engines/
rebind_deepspeed.py) and rolls back to its ring slot; the replacement heals from its own
partition (ZeRO-2's optimizer state is partitioned: a survivor's copy is no source). The
final state (fp32 master weights, ZeRO partitions, bit16 module) is bit for bit that of an
uninterrupted run, on every rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_inplace import CRASH, POLICY

from conftest import DS_EXAMPLE, REPO, assert_bitwise_equal, final_states, kinds, run, train

pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs it")

pytestmark = pytest.mark.timeout(300)

WORKER = REPO / "tests" / "zero2_worker.py"
ARGS = ["--steps", "40"]


class CleanRuns(dict[int, Path]):
    """Fault-free runs by ZeRO stage, each made the first time a test needs it."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, stage: int) -> Path:
        d = self.base / f"zero{stage}" / "run"
        r = train(d, 2, "--zero-stage", str(stage), *ARGS, policy=POLICY, script=DS_EXAMPLE)
        assert r.returncode == 0, r.stdout[-3000:]
        self[stage] = d
        return d


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> CleanRuns:
    return CleanRuns(tmp_path_factory.mktemp("zero-clean"))


def test_rebind_internals_exist_in_this_deepspeed() -> None:
    """A DeepSpeed upgrade that drops what the rebind uses fails here, by name (a run falls
    back to the full restart, with the same names in the survivor's log)."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils import groups

    from orchestrator.engines.rebind_deepspeed import GROUPS_REBIND_ATTRS

    methods = ["_clear_previous_reduced_grads", "_release_ipg_buffers", "zero_grad",
               "reset_partition_gradient_structures"]  # fmt: skip
    missing = [m for m in methods if not callable(getattr(DeepSpeedZeroOptimizer, m, None))]
    missing += [f"groups.{n}" for n in GROUPS_REBIND_ATTRS if not hasattr(groups, n)]
    assert not missing, f"update orchestrator/engines/rebind_deepspeed.py: {missing}"


def launch(tmp_path: Path, *worker_args: str, stage: int = 2, crash: bool = True) -> Path:
    """The worker under the node agent at ZeRO ``stage``, rank 1 crashing at step 27 (the
    policy's fault, unless ``crash`` is False); its run directory."""
    d = tmp_path / "run"
    path = tmp_path / "policy.yaml"
    policy = {**POLICY, **(CRASH if crash else {}), "supervisor": {"backoff_s": 0.2}}
    path.write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
           "--run-dir", str(d), "--nproc-per-node", "2", str(WORKER), *worker_args,
           "--zero-stage", str(stage), *ARGS,
           "--save-final", str(d / "final")]  # fmt: skip
    r = run(cmd, timeout=240)
    if r.returncode != 0:
        (tmp_path / "output.log").write_text(r.stdout)
    assert r.returncode == 0, r.stdout[-4000:]
    return d


def pids(d: Path) -> dict[str, int]:
    return {f.stem: json.loads(f.read_text())["pid"] for f in (d / "pids").glob("*.json")}


def assert_in_place(d: Path, clean: Path, source: str) -> dict[str, Any]:
    """Rank 1 replaced alone, rank 0 in its first process, one attempt, bit for bit."""
    (rep,) = kinds(d, "rank_replaced")
    assert (rep["details"]["rank"], rep["details"]["cause"]) == (1, "signal")
    (rec,) = kinds(d, "inplace_recovery")
    det = rec["details"]
    assert det["replaced"] == [1] and det["generation"] == 1, rec
    assert det["sources"]["0"]["source"] == "ring", rec
    assert det["sources"]["1"]["source"] == source, rec
    t = det["times"]
    assert t["fault"] <= t["reform"] <= t["heal"] <= t["first_step"], t
    p = pids(d)
    # rank 0: one process from start to end; rank 1: a second one, started in generation 1
    assert p["rank0-attempt0-gen0-start"] == p["rank0-attempt0-gen0-end"], p
    assert "rank0-attempt0-gen1-start" not in p and "rank1-attempt0-gen0-end" not in p, p
    assert p["rank1-attempt0-gen1-start"] == p["rank1-attempt0-gen1-end"], p
    assert [e["rank"] for e in kinds(d, "run_start")].count(0) == 1
    assert kinds(d, "restart") == [] and len(kinds(d, "attempt_end")) == 1
    for a, b in zip(final_states(clean), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
    return rec


def test_zero2_rank1_replaced_alone_heals_from_its_shm_slot(
    tmp_path: Path, clean: CleanRuns
) -> None:
    """The replacement's first source: its own shared-memory slot of step 25 (its
    partition of the optimizer state, its RNG and data position)."""
    rec = assert_in_place(launch(tmp_path), clean[2], "shm")
    assert rec["step"] == 25, rec


def test_zero2_lost_shm_slot_heals_from_the_durable_part(tmp_path: Path, clean: CleanRuns) -> None:
    """Rank 1's shared-memory slots are gone: its replacement loads its rank's part of the
    durable snapshot of step 20 instead (the survivors' ring holds it too)."""
    rec = assert_in_place(launch(tmp_path, "--lose-shm"), clean[2], "durable")
    assert rec["step"] == 20, rec


def test_zero2_second_death_during_heal_falls_back_bit_for_bit(
    tmp_path: Path, clean: CleanRuns
) -> None:
    """The replacement dies again as it joins the agreement (the survivor rebound DeepSpeed
    and waits in it): no in-place recovery; the agent falls back to a full restart, which
    resumes bit for bit."""
    d = launch(tmp_path, "--die-in-heal")
    assert not kinds(d, "inplace_recovery")
    assert len(kinds(d, "restart")) == 1 and len(kinds(d, "attempt_end")) == 2
    p = pids(d)
    assert p["rank0-attempt0-gen0-start"] != p["rank0-attempt1-gen0-start"], p
    for a, b in zip(final_states(clean[2]), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


@pytest.mark.matrix
def test_zero2_death_inside_deepspeeds_step_heals_bit_for_bit(
    tmp_path: Path, clean: CleanRuns
) -> None:
    """Rank 1 dies inside engine.step() of step 27, after its torch optimizer stepped: the
    survivor's error comes from DeepSpeed's weight all-gather, its own partition already
    updated; the rollback to its ring slot undoes that, bit for bit."""
    d = launch(tmp_path, "--die-in-step", "27", crash=False)
    rec = assert_in_place(d, clean[2], "shm")
    assert rec["step"] == 25, rec


@pytest.mark.matrix
def test_zero1_rank1_replaced_alone_bit_for_bit(tmp_path: Path, clean: CleanRuns) -> None:
    """ZeRO-1 is the same optimizer class as ZeRO-2: it recovers in place alike."""
    rec = assert_in_place(launch(tmp_path, stage=1), clean[1], "shm")
    assert rec["step"] == 25, rec


@pytest.mark.matrix
def test_zero3_falls_back_to_a_full_restart_bit_for_bit(tmp_path: Path, clean: CleanRuns) -> None:
    """ZeRO-3 is refused in place (rebind_deepspeed.deepspeed_unsupported): the survivor
    raises the collective's error, the agent falls back, the restart resumes bit for bit."""
    d = launch(tmp_path, stage=3)
    assert not kinds(d, "inplace_recovery") and len(kinds(d, "inplace_failed")) == 1
    assert len(kinds(d, "restart")) == 1
    for a, b in zip(final_states(clean[3]), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")
