"""The healthy step runs no fault code: the modules on its path never mention faults, the
engines' step methods neither, and a Guard whose policy has no faults wraps nothing (a
drill's or a test's faults wrap the components they perturb: orchestrator/faults/)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import yaml
from inproc import Regression, events, train

from conftest import assert_bitwise_equal
from orchestrator import Guard, PolicyError, parse_policy
from orchestrator.engines import Engine, FSDP1Engine, FSDP2Engine, TorchEngine
from orchestrator.protocol import ENV_FAULTS

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
# "fault", "faults", "FaultInjector"... but not "default".
FAULT = re.compile(r"(?<!de)fault", re.IGNORECASE)
HOT_MODULES = (
    "orchestrator/guard.py",
    "orchestrator/stepping.py",
    "orchestrator/autotune.py",
    "orchestrator/check.py",
    "orchestrator/keeper.py",
)
# The engine methods a healthy step runs (the template and the hooks behind it).
STEP_METHODS = ("backward", "_backward", "accumulate", "judge", "commit", "_apply", "grads")


@pytest.mark.parametrize("module", HOT_MODULES)
def test_the_hot_path_modules_never_mention_faults(module: str) -> None:
    text = (ROOT / module).read_text(encoding="utf-8")
    found = [line for line in text.splitlines() if FAULT.search(line)]
    assert not found, f"{module} mentions faults: {found}"


def test_the_engines_step_methods_never_mention_faults() -> None:
    from orchestrator.engines.deepspeed import DeepSpeedEngine

    checked = 0
    for cls in (Engine, TorchEngine, FSDP2Engine, FSDP1Engine, DeepSpeedEngine):
        for name in STEP_METHODS:
            method = cls.__dict__.get(name)
            if method is None:
                continue
            source = inspect.getsource(method)
            assert not FAULT.search(source), f"{cls.__name__}.{name} mentions faults"
            assert "poison" not in source.lower(), f"{cls.__name__}.{name} poisons"
            checked += 1
    assert checked >= 10
    # No engine has to implement fault injection.
    assert not any("poison" in name for name in Engine.__abstractmethods__)
    assert not any("poison" in name for name in dir(Engine))


def _guard(tmp_path: Path, faults: list[dict[str, object]]) -> tuple[Guard, Engine]:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = parse_policy({"faults": faults})
    guard = Guard(policy, model=model, optimizer=opt, run_dir=str(tmp_path))
    return guard, guard.engine


def test_a_guard_without_faults_wraps_nothing_and_one_with_faults_wraps(
    tmp_path: Path,
) -> None:
    wrapped = {"guard": {"backward"}, "engine": {"backward", "judge", "commit"}}
    guard, engine = _guard(tmp_path / "clean", [])
    try:
        assert not wrapped["guard"] & set(vars(guard))
        assert not wrapped["engine"] & set(vars(engine))
        assert "open" not in vars(guard.cursor)
        assert "write_part" not in vars(guard.durable.store)
        assert guard.durable.store._hook is None
        # A healthy step, then: it commits through the engine's own methods.
        loader = guard.dataloader(Regression(), batch_size=4)
        for x, y in guard.batches(loader, max_steps=2):
            guard.backward(torch.nn.functional.mse_loss(guard.engine.core(x).squeeze(-1), y))
            assert guard.step() == "commit"
    finally:
        guard.close()
    guard, engine = _guard(tmp_path / "drill", [{"kind": "nan_grad", "step": 1}])
    try:
        assert wrapped["guard"] <= set(vars(guard))
        assert wrapped["engine"] <= set(vars(engine))
        assert "open" in vars(guard.cursor)
    finally:
        guard.close()
    counts = [
        e["details"]["faults"]
        for d in ("clean", "drill")
        for e in events(tmp_path / d, "run_start")
    ]
    assert counts == [0, 1]  # run_start says how many faults were armed


def test_faults_from_their_own_file_act_as_the_policys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drill's way: the policy holds no faults, $ORCHESTRATOR_FAULTS names a file with
    them; the run is the one whose policy held them (incident, journal, final state)."""
    exact = {"adjust": {"lr_factor": 1.0}, "quarantine": {"enabled": False}}
    faults = [{"kind": "inf_loss", "step": 7}, {"kind": "nan_grad", "step": 12}]
    _, in_policy, outcomes = train(tmp_path / "policy", {**exact, "faults": faults}, steps=16)
    path = tmp_path / "faults.yaml"
    path.write_text(yaml.safe_dump(faults))
    monkeypatch.setenv(ENV_FAULTS, str(path))
    _, apart, outcomes_apart = train(tmp_path / "apart", exact, steps=16)
    assert outcomes_apart == outcomes and outcomes.count("incident") == 2
    assert_bitwise_equal(in_policy, apart)
    keys = {"fault": ("key", "fault"), "incident": ("reason", "per_rank"),
            "rollback": ("from_step", "to_step")}  # fmt: skip
    for kind, said in keys.items():
        runs = [
            [(e["step"], [e["details"][k] for k in said]) for e in events(tmp_path / run, kind)]
            for run in ("policy", "apart")
        ]
        assert runs[0] == runs[1] and len(runs[0]) == 2, kind
    # run_start counts the faults armed, wherever they came from (the drill's: the file).
    for run in ("policy", "apart"):
        (start,) = events(tmp_path / run, "run_start")
        assert start["details"]["faults"] == 2, run
    path.write_text("- {kind: nan_grad}\n")  # no step: refused, naming the file
    with pytest.raises(PolicyError, match="ORCHESTRATOR_FAULTS"):
        train(tmp_path / "bad", exact, steps=2)
