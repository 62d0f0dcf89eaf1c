"""Policy loading, validation messages and the `orchestrator validate` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from orchestrator import Policy, PolicyError, load_policy, parse_policy

pytestmark = pytest.mark.timeout(60)


def _validate(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "p.yaml"
    f.write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "validate", str(f)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_default_config_is_valid_and_equals_builtin_defaults() -> None:
    shipped = load_policy(REPO / "configs" / "default.yaml")
    assert shipped == Policy()


def test_default_config_documents_every_field() -> None:
    data = yaml.safe_load((REPO / "configs" / "default.yaml").read_text())

    def keys(model: type, prefix: str = "") -> set[str]:
        out = set()
        for name, field in model.model_fields.items():
            out.add(prefix + name)
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                out |= keys(ann, f"{prefix}{name}.")
        return out

    fields = keys(Policy)

    def present(d: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            # Descend into sections, not into dict-valued fields (diagnose.actions).
            if isinstance(v, dict) and any(f.startswith(f"{prefix}{k}.") for f in fields):
                out |= present(v, f"{prefix}{k}.")
        return out

    assert fields == present(data)


def test_validate_ok(tmp_path: Path) -> None:
    r = _validate(tmp_path, "snapshot:\n  every_steps: 5\n")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("snapshot:\n  evry_steps: 5\n", "snapshot.evry_steps"),
        ("snapshot:\n  every_steps: ten\n", "snapshot.every_steps"),
        ("persist:\n  every_steps: Auto\n", "persist.every_steps"),  # auto, misspelt
        ("snapshot:\n  every_steps: 0\n", "snapshot.every_steps"),
        ("adjust:\n  lr_factor: 1.5\n", "adjust.lr_factor"),
        ("faults:\n  - {kind: nan_grad, rank: 1}\n", "faults[0].step"),
        ("faults:\n  - {kind: nan_grad, step: 3, sample: 1}\n", "faults[0].sample"),
        ("faults:\n  - {kind: meteor, step: 3}\n", "faults[0]"),
        ("snapshot:\n  keep: 2\n  every_steps: 5\n  min_age_steps: 50\n", "snapshot"),
        ("quarantine:\n  scope: window\n", "quarantine"),
        ("snapshot:\n  every_steps: 1\n  seal_after_steps: 2\n", "snapshot"),
        ("persist:\n  every_steps: null\n", "persist"),
        ("faults:\n  - {kind: slow_storage, seconds: 0}\n", "faults[0].seconds"),
        ("snapshot:\n  replicate: buddy\n", "snapshot"),  # without shared_memory
        ("snapshot:\n  replicate: mirror\n", "snapshot.replicate"),
    ],
)
def test_validate_rejects_with_yaml_path(tmp_path: Path, text: str, path: str) -> None:
    r = _validate(tmp_path, text)
    assert r.returncode == 2
    assert f"  {path}:" in r.stderr, r.stderr


def test_error_says_what_is_allowed() -> None:
    with pytest.raises(PolicyError) as e:
        parse_policy({"snapshot": {"every_steps": 0}})
    assert "snapshot.every_steps" in str(e.value) and "greater than or equal to 1" in str(e.value)


def test_not_yaml_and_missing_file(tmp_path: Path) -> None:
    assert _validate(tmp_path, "snapshot: [1,\n").returncode == 2
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "nope.yaml")


def test_env_var_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("snapshot:\n  every_steps: 7\n")
    monkeypatch.setenv("ORCHESTRATOR_POLICY", str(f))
    assert load_policy().snapshot.every_steps == 7
    monkeypatch.delenv("ORCHESTRATOR_POLICY")
    assert load_policy() == Policy()
