"""The healthy step runs no fault code: the modules on its path never mention faults, the
engines' step methods neither, and a Guard whose policy has no faults wraps nothing (a
drill's or a test's faults wrap the components they perturb: orchestrator/faults/)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from inproc import Regression

from orchestrator import Guard, parse_policy
from orchestrator.engines import Engine, FSDP1Engine, FSDP2Engine, TorchEngine

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
# "fault", "faults", "FaultInjector"... but not "default".
FAULT = re.compile(r"(?<!de)fault", re.IGNORECASE)
HOT_MODULES = ("orchestrator/guard.py", "orchestrator/check.py", "orchestrator/keeper.py")
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
