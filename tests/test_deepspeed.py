"""DeepSpeed (the real library, CPU, gloo) on 2 ranks: ZeRO stages 1, 2 and 3 under the
Guard. Final states (fp32 master partitions, optimizer state, bit16 weights, counters) are
compared bit for bit; durable snapshots are read back with DeepSpeed's own loader and
``zero_to_fp32``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    DS_EXAMPLE,
    assert_bitwise_equal,
    final_states,
    free_port,
    kinds,
    run,
    train,
)
from orchestrator.data import GuardBatchSampler

deepspeed = pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs it")

pytestmark = pytest.mark.timeout(400)

STEPS = ["--steps", "40"]
EXACT = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}}
NO_Q = {**EXACT, "quarantine": {"enabled": False}}


def ds_train(run_dir: Path, *args: str, policy: dict[str, Any]) -> None:
    r = train(run_dir, 2, *STEPS, *args, policy=policy, script=DS_EXAMPLE)
    if r.returncode != 0:
        (run_dir / "output.log").write_text(r.stdout)  # the whole of it, for the post-mortem
    assert r.returncode == 0, r.stdout[-4000:]


class CleanRuns(dict[str, Path]):
    """Fault-free runs, one per configuration, each made the first time a test needs it
    and shared by the tests after."""

    def __init__(self, base: Path) -> None:
        super().__init__()
        self.base = base

    def __missing__(self, name: str) -> Path:
        ds_train(self.base / name, *CONFIGS[name], policy=NO_Q)
        self[name] = self.base / name
        return self[name]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> CleanRuns:
    return CleanRuns(tmp_path_factory.mktemp("ds-clean"))


CONFIGS = {
    "zero1": ["--zero-stage", "1"],
    "zero2": ["--zero-stage", "2"],
    "zero3": ["--zero-stage", "3"],
    "zero2-gas2": ["--zero-stage", "2", "--gas", "2"],
}


def test_internal_methods_exist_in_this_deepspeed() -> None:
    """Fails on a DeepSpeed upgrade that drops a method the adapter uses (the attributes
    are checked on live engines by check_internals, at every Guard start below)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from orchestrator.engines.deepspeed import _INTERNAL_METHODS

    classes = {
        "engine": DeepSpeedEngine,
        "zero12": DeepSpeedZeroOptimizer,
        "zero3": DeepSpeedZeroOptimizer_Stage3,
    }
    missing = [
        f"{classes[owner].__name__}.{name}"
        for owner, names in _INTERNAL_METHODS.items()
        for name in names
        if not callable(getattr(classes[owner], name, None))
    ]
    assert not missing, (
        f"DeepSpeed {deepspeed.__version__} lacks {missing}: update "
        "orchestrator/engines/deepspeed.py"
    )


@pytest.mark.parametrize(
    ("config", "step"),
    [
        # ZeRO 1/2/3 rolling back mid-run are cells of tests/test_models.py (real models,
        # uneven shapes); here in the full matrix only.
        *(pytest.param(c, 17, marks=pytest.mark.matrix) for c in ("zero1", "zero2", "zero3")),
        ("zero2-gas2", 17),
        ("zero3", 3),  # step 3: back to before any optimizer state
    ],
)
def test_nan_grad_rolls_back_bit_for_bit(
    tmp_path: Path, clean: dict[str, Path], config: str, step: int
) -> None:
    d = tmp_path / "run"
    fault = {"kind": "nan_grad", "step": step, "rank": 1}
    ds_train(d, *CONFIGS[config], policy={**NO_Q, "faults": [fault]})
    (inc,) = kinds(d, "incident")
    assert inc["step"] == step and inc["details"]["reason"] == "nonfinite_grads"
    (rb,) = kinds(d, "rollback")
    assert rb["details"]["from_step"] == step and rb["details"]["to_step"] == step // 10 * 10
    for a, b in zip(final_states(clean[config]), final_states(d), strict=True):
        assert_bitwise_equal(a, b, f"{config} final")


def test_zero2_replica_drift_is_named_and_rolled_back_bit_for_bit(
    tmp_path: Path, clean: dict[str, Path]
) -> None:
    """ZeRO-2's bit16 weights are replicated (each step all-gathers them from the fp32
    partitions), so they are compared at each snapshot step. They drift only between a
    step's all-gather and the next step, so the drift lands right before a snapshot."""
    d = tmp_path / "run"
    fault = {"kind": "perturb_params", "step": 30, "rank": 1}
    ds_train(d, *CONFIGS["zero2"], policy={**NO_Q, "faults": [fault]})
    (inc,) = kinds(d, "incident")
    assert inc["step"] == 30 and inc["details"]["reason"] == "divergence"
    (rb,) = kinds(d, "rollback")
    assert (rb["details"]["from_step"], rb["details"]["to_step"]) == (30, 20)
    # Rank 0 held what the exact replay reached again: rank 1 is named by its digest.
    (named,) = kinds(d, "divergence_culprit")
    assert named["details"]["ranks"] == [1] and named["details"]["by"] == "replay"
    for a, b in zip(final_states(clean["zero2"]), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "zero2 final")


def test_fp16_incident_lowers_the_loss_scale(tmp_path: Path) -> None:
    """fp16 on this CPU runs on torch's emulated kernels (DeepSpeed refuses fp16 on a CPU
    without native support; the example lifts that check, saying so)."""
    d = tmp_path / "run"
    policy = {
        **NO_Q,
        "adjust": {"lr_factor": 1.0, "loss_scale_factor": 0.25},
        "faults": [
            {"kind": "inf_loss", "step": 20, "rank": 0},  # an incident
            {"kind": "nan_grad", "step": 30, "rank": 1},  # an overflow DeepSpeed skips
        ],
    }
    ds_train(d, "--fp16", policy=policy)
    (inc,) = kinds(d, "incident")
    assert inc["step"] == 20 and inc["details"]["reason"] == "nonfinite_loss"
    (rb,) = kinds(d, "rollback")
    # The initial scale is 2^12 with a 1000-step growth window: it only moves on events.
    assert rb["details"]["loss_scale_at_incident"] == 4096.0
    assert rb["details"]["loss_scale"] == 4096.0 * 0.25
    (adj,) = [e for e in kinds(d, "adjust") if e["details"]["phase"] == "cut"]
    assert adj["details"]["loss_scale_factor"] == 0.25
    # Then DeepSpeed's own overflow handling at step 30 halves it once more.
    for state in final_states(d):
        assert state["loss_scale"] == 4096.0 * 0.25 * 0.5
        assert state["ds_skipped_steps"] == 1 and state["step"] == 40


def test_poison_sample_quarantined_bit_for_bit(tmp_path: Path) -> None:
    sampler = GuardBatchSampler(1024, 8, rank=0, world_size=2, seed=7)
    bad = sampler.global_batch_at(0, 25 * 16)[13]  # a sample of step 25's global batch
    faulty = tmp_path / "faulty"
    zero2 = CONFIGS["zero2"]
    ds_train(faulty, *zero2, policy={**EXACT, "faults": [{"kind": "poison_sample", "sample": bad}]})
    (q,) = kinds(faulty, "quarantine")
    assert q["details"]["samples"] == [bad]
    pre = tmp_path / "pre"
    pre.mkdir()
    (pre / "quarantine.jsonl").write_text(json.dumps({"sample": bad}) + "\n")
    ds_train(pre, *zero2, policy=EXACT)
    assert kinds(pre, "incident") == []
    for a, b in zip(final_states(pre), final_states(faulty), strict=True):
        assert_bitwise_equal(a, b, "final")


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_durable_snapshot_is_a_deepspeed_checkpoint(
    tmp_path: Path, clean: dict[str, Path], config: str
) -> None:
    """The final durable snapshot (step 40) loads with engine.load_checkpoint in a fresh
    pair of processes, and zero_to_fp32 rebuilds the live model's fp32 weights."""
    snap = clean[config] / "snapshots" / "step_000000040"
    assert (snap / "COMMITTED").exists() and (snap / "latest").read_text() == "global_step40"
    d = tmp_path / "reload"
    ds_train(
        d,
        *CONFIGS[config],
        "--load-checkpoint",
        str(snap),
        "--steps",
        "0",
        policy={"persist": {"enabled": False}},
    )
    live, loaded = final_states(clean[config]), final_states(d)
    for a, b in zip(live, loaded, strict=True):
        assert b["ds_global_steps"] == a["ds_global_steps"] == 40
        for key in ("zero", "fp32_full", "loss_scale"):
            assert_bitwise_equal(a[key], b[key], f"{config} {key}")
        if config != "zero3":  # ZeRO-3's module holds only partitioned placeholders
            assert_bitwise_equal(a["module"], b["module"], f"{config} module")

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(snap))
    expected = live[0]["fp32_full"]
    assert set(expected) <= set(fp32)
    for name, tensor in expected.items():
        assert_bitwise_equal(tensor, fp32[name].float(), f"zero_to_fp32 {name}")


def test_crash_under_launch_with_deepspeed_launcher_resumes_bit_for_bit(
    tmp_path: Path, clean: dict[str, Path]
) -> None:
    """`orchestrator launch -- deepspeed --num_gpus 2 ...` on one node (the deepspeed
    launcher runs on CPU here): a crash at step 30 restarts and resumes bit for bit."""
    d = tmp_path / "run"
    policy = {
        **NO_Q,
        "supervisor": {"backoff_s": 0.2, "backoff_max_s": 1.0, "heartbeat_interval_s": 0.5},
        "faults": [{"kind": "crash", "step": 30, "rank": 0}],
    }
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(policy))
    cmd = [
        sys.executable, "-m", "launch.cli", "launch", "--policy", str(path), "--run-dir", str(d),
        "--", "deepspeed", "--num_gpus", "2", "--master_port", str(free_port()),
        str(DS_EXAMPLE), *CONFIGS["zero2"], *STEPS, "--save-final", str(d / "final"),
    ]  # fmt: skip
    deepspeed_bin = Path(sys.executable).parent / "deepspeed"
    cmd[cmd.index("deepspeed")] = str(deepspeed_bin)
    r = run(cmd, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:]
    (restart,) = kinds(d, "restart")
    assert restart["details"]["cause"] == "crash"
    (resume,) = kinds(d, "resume")
    assert resume["attempt"] == 1 and resume["details"]["snapshot_step"] in (20, 30)
    for a, b in zip(final_states(clean["zero2"]), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


LR_CHECK = """
import os, torch, deepspeed
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ["PORT"])
deepspeed.init_distributed(dist_backend="gloo")
from orchestrator.engines.deepspeed import DeepSpeedEngine

def step(lr, multiplier):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "torch_adam": True}},
           "zero_optimization": {"stage": 2}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    adapter = DeepSpeedEngine(engine)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    adapter.backward(engine(x).float().pow(2).mean())
    adapter.judge(multiplier)  # DeepSpeed applies the step, then it is judged
    fp32 = engine.optimizer.state_dict()["single_partition_of_fp32_groups"][0].clone()
    return fp32, engine.optimizer.param_groups[0]["lr"]

a, lr_a = step(0.001, 1.0)
b, lr_b = step(0.002, 0.5)
assert torch.equal(a, b), "the LR multiplier did not reach DeepSpeed's optimizer step"
assert (lr_a, lr_b) == (0.001, 0.002), f"the LR was not restored after the step: {lr_b}"
print("LR_OK")
from orchestrator import exit_process
exit_process(0)  # not the interpreter teardown, where gloo can abort (see exit_process)
"""


def test_lr_multiplier_reaches_the_deepspeed_step() -> None:
    """bf16 incidents cut the LR: the multiplier applies inside DeepSpeed's step, to that
    step only. A step at LR 0.002 x 0.5 must equal one at LR 0.001, bit for bit."""
    r = run([sys.executable, "-c", LR_CHECK], env={"PORT": str(free_port())}, timeout=120)
    assert r.returncode == 0 and "LR_OK" in r.stdout, r.stdout[-3000:]
