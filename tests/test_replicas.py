"""Replica agreement (orchestrator/replicas.py): the digest itself, the pure naming rules, and
end to end on 2 ranks (gloo, CPU): a rank whose parameters drift outside the Guard is a
``divergence`` incident at the next snapshot step, named, rolled back to the snapshot the
replicas agreed on, and the run ends bit for bit equal to a run without the drift."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from conftest import EXAMPLE, assert_bitwise_equal, final_states, free_port, kinds, run, train
from orchestrator import replicas
from orchestrator.errors import EXIT_UNHEALTHY

pytestmark = pytest.mark.timeout(300)


# --- the digest ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_digest_sees_one_flipped_bit_in_any_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # Odd sizes: a tail of bytes that is not a whole int32 word; an empty tensor; a scalar.
    ts = [torch.randn(1001, generator=g).to(dtype), torch.empty(0, dtype=dtype), torch.tensor(3.0)]
    d = replicas.digest(ts)
    assert d is not None and d.dtype == torch.int64 and d.dim() == 0
    assert torch.equal(d, replicas.digest([t.clone() for t in ts]))  # a replica agrees
    for index in (0, 500, 1000):  # first, middle, the last (odd tail) element
        flipped = ts[0].clone()
        flipped.view(torch.uint8)[index * flipped.element_size()] ^= 1  # lowest mantissa bit
        assert not torch.equal(d, replicas.digest([flipped, *ts[1:]])), index


def test_digest_tells_tensors_apart_and_skips_nothing() -> None:
    a, b = torch.arange(6.0), torch.arange(6.0) + 1
    assert not torch.equal(replicas.digest([a, b]), replicas.digest([b, a]))  # order counts
    assert replicas.digest([]) is None
    assert replicas.digest([torch.tensor([True, False, True])]) is not None
    assert replicas.digest([torch.arange(5, dtype=torch.int64)]) is not None
    non_contiguous = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(
        replicas.digest([non_contiguous]), replicas.digest([non_contiguous.contiguous()])
    )


def test_the_majority_names_the_minority_and_a_tie_names_nobody() -> None:
    assert replicas.minority([5, 5, 7, 5]) == [2]
    assert replicas.minority([5, 5, 5]) == []
    assert replicas.minority([5, 7]) is None  # two replicas: the replay decides
    assert replicas.minority([5, 5, 7, 7]) is None
    assert replicas.minority([1, 2, 3]) is None


def test_the_farthest_rank_from_the_replay_is_named_only_when_it_stands_out() -> None:
    assert replicas.farthest([0.01, 2.0]) == [1]
    assert replicas.farthest([3.0, 0.1, 0.2]) == [0]
    assert replicas.farthest([1.0, 1.5]) == []  # no rank stands out
    assert replicas.farthest([0.0, 0.0]) == []
    assert replicas.farthest([0.0, 1e-9]) == [1]  # a rank that held the replayed state


def test_a_rank_named_twice_within_the_window_is_sick() -> None:
    c = replicas.Culprits(sick_after=2, window_steps=100)
    assert c.name(30, [1]) == []
    assert c.name(200, [1]) == []  # the first is out of the window by now
    assert c.name(250, [0, 1]) == [1]


# --- end to end -----------------------------------------------------------------------------
STEPS = ["--steps", "60"]
EXACT = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}}


def test_a_drifted_ddp_replica_is_named_and_rolled_back_bit_for_bit(
    tmp_path: Path, clean_run: Callable[[int], Path]
) -> None:
    d = tmp_path / "run"
    policy = {**EXACT, "faults": [{"kind": "perturb_params", "step": 25, "rank": 1}]}
    r = train(d, 2, *STEPS, policy=policy)
    assert r.returncode == 0, r.stdout[-3000:]

    (inc,) = kinds(d, "incident")
    assert inc["step"] == 30  # the first snapshot step after the drift
    assert inc["details"]["reason"] == "divergence" and inc["details"]["cause"] == "divergence"
    assert inc["details"]["tied"] is True  # two replicas: no majority
    (rb,) = kinds(d, "rollback")
    assert (rb["details"]["from_step"], rb["details"]["to_step"]) == (30, 20)
    assert not kinds(d, "quarantine")  # neither the data nor the LR did it
    (adj,) = kinds(d, "adjust")
    assert adj["details"]["phase"] == "kept"
    # The replay back at step 30 names the rank that drifted.
    (named,) = kinds(d, "divergence_culprit")
    assert named["step"] == 30 and named["details"]["ranks"] == [1]
    assert list(named["details"]["hosts"]) == ["1"]
    # Every replica ends with the same bytes, those of a run that never drifted.
    clean = final_states(clean_run(60))
    got = final_states(d)
    assert_bitwise_equal(got[0]["model"], got[1]["model"], "replicas")
    for a, b in zip(clean, got, strict=True):
        assert_bitwise_equal(a, b, "final")


def test_a_rank_that_drifts_again_is_sick_exit_72(tmp_path: Path) -> None:
    """Under the supervisor, which tolerates no unhealthy attempt here: its exit code tells
    the scheduler to exclude the node."""
    d = tmp_path / "run"
    faults = [{"kind": "perturb_params", "step": s, "rank": 1} for s in (15, 35)]
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        yaml.safe_dump({**EXACT, "supervisor": {"max_unhealthy": 0}, "faults": faults})
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]  # fmt: skip
    r = run([sys.executable, "-m", "launch.cli", "launch", "--policy", str(policy),
             "--run-dir", str(d), "--", *torchrun, str(EXAMPLE), *STEPS])  # fmt: skip
    assert r.returncode == EXIT_UNHEALTHY, r.stdout[-3000:]
    assert [e["details"]["ranks"] for e in kinds(d, "divergence_culprit")] == [[1], [1]]
    (sick,) = kinds(d, "unhealthy")
    assert sick["details"]["reason"] == "divergence" and sick["details"]["ranks"] == [1]
    assert sick["details"]["hosts"]  # the host to exclude
    assert kinds(d, "run_end")[0]["details"]["status"] != "finished"
