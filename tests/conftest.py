"""Shared helpers: real subprocesses (python / torchrun), policies on disk, state comparison."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from orchestrator.journal import ENV_STRICT_EVENTS, load_journal
from orchestrator.protocol import LEDGER_NAME

REPO = Path(__file__).resolve().parents[1]
# A journal write that does not fit its kind's record raises (a writer's bug), in this
# process and in every subprocess (torchrun workers, supervisors) the tests start.
os.environ.setdefault(ENV_STRICT_EVENTS, "1")
EXAMPLE = REPO / "examples" / "train_gpt.py"
DS_EXAMPLE = REPO / "examples" / "train_gpt_deepspeed.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start in a new session (so a timeout can kill the whole group), output captured."""
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        # DeepSpeed compiles a small CPU op on first use: once per machine, not per test.
        "TORCH_EXTENSIONS_DIR": os.environ.get(
            "TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions")
        ),
        **(env or {}),
    }
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def wait(proc: subprocess.Popen[str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Wait for ``proc``; on timeout kill its whole group (torchrun's workers included)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} timed out after {timeout}s; output:\n{out[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run in a new session; on timeout kill the whole group (torchrun's workers included)."""
    return wait(spawn(cmd, env), timeout)


def preempt_at(cmd: list[str], run_dir: Path, step: int) -> tuple[int, str]:
    """Start the supervisor's ``cmd``, SIGTERM it (it alone, as a scheduler would) once a
    rank's heartbeat reaches ``step``; its return code and output."""
    from orchestrator.heartbeat import read_heartbeats

    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # bounded poll: training must reach the step
            if any(b["step"] >= step for b in read_heartbeats(str(run_dir))):
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"training never reached step {step}")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def train(
    run_dir: Path,
    nproc: int,
    *args: str,
    policy: dict[str, Any] | None = None,
    save: bool = True,
    script: Path = EXAMPLE,
) -> subprocess.CompletedProcess[str]:
    """Run an example trainer (python for 1 rank, torchrun for more) into ``run_dir``."""
    return run(*train_cmd(run_dir, nproc, *args, policy=policy, save=save, script=script))


def train_cmd(
    run_dir: Path,
    nproc: int,
    *args: str,
    policy: dict[str, Any] | None = None,
    save: bool = True,
    script: Path = EXAMPLE,
) -> tuple[list[str], dict[str, str]]:
    """The command and environment :func:`train` runs (to start it without waiting)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {"ORCHESTRATOR_RUN_DIR": str(run_dir)}
    if policy is not None:
        path = run_dir.parent / f"{run_dir.name}-policy.yaml"
        path.write_text(yaml.safe_dump(policy))
        env["ORCHESTRATOR_POLICY"] = str(path)
    extra = ["--save-final", str(run_dir / "final")] if save else []
    if nproc == 1:
        cmd = [sys.executable, str(script), *args, *extra]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            str(script),
            *args,
            *extra,
        ]
    return cmd, env


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``clean_run(steps)``: the run directory of an uninterrupted 2-rank run of the example
    (the LR kept on incidents, durable snapshots every 10 steps), what a run with faults
    must equal bit for bit; each length trained once per session."""
    runs: dict[int, Path] = {}

    def get(steps: int) -> Path:
        if steps not in runs:
            d = tmp_path_factory.mktemp(f"clean{steps}") / "run"
            policy = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10}}
            r = train(d, 2, "--steps", str(steps), policy=policy)
            assert r.returncode == 0, r.stdout[-3000:]
            runs[steps] = d
        return runs[steps]

    return get


def journal(run_dir: Path) -> list[dict[str, Any]]:
    """Every node's journal file, merged by time (a torn line fails the test)."""
    events, torn = load_journal(str(run_dir))
    assert not torn, f"torn journal lines in {run_dir}: {torn}"
    return events


def kinds(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in journal(run_dir) if e["kind"] == kind]


def final_states(run_dir: Path) -> list[dict[str, Any]]:
    files = sorted((run_dir / "final").glob("rank*.pt"))
    assert files, f"no final state in {run_dir}"
    return [torch.load(f, weights_only=True) for f in files]


def prequarantined(tmp_path: Path, ids: list[int]) -> Path:
    """A run directory whose ledger holds ``ids`` from the start: the reference a run that
    quarantines them mid-way must equal, bit for bit, after its rollback."""
    d = tmp_path / "prequarantined"
    d.mkdir()
    (d / LEDGER_NAME).write_text("".join(json.dumps({"sample": i}) + "\n" for i in ids))
    return d


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), (
            f"{where}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})"
        )
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {a.keys()} != {b.keys()}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full-matrix",
        action="store_true",
        help="run the full matrix: every engine x architecture cell of tests/test_models.py, "
        "and the older per-engine tests those cells cover (about 13 more minutes on 2 cores)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full-matrix"):
        return
    skip = pytest.mark.skip(reason="full matrix only (pytest --full-matrix)")
    for item in items:
        if "matrix" in item.keywords:
            item.add_marker(skip)


def assert_resharded(one: dict[str, Any], shards: list[dict[str, Any]]) -> None:
    """``one`` (a 1-rank FSDP2 state) is the 2-rank ``shards`` put back together, bit for
    bit: every dim-0 shard of the model and the optimizer state, empty ones included."""
    for name, full in one["model"].items():
        assert_bitwise_equal(full, torch.cat([s["model"][name] for s in shards]), name)
    for index, entries in one["optim"]["state"].items():
        for key, value in entries.items():
            parts = [s["optim"]["state"][index][key] for s in shards]
            want = parts[0] if value.dim() == 0 else torch.cat(parts)
            assert_bitwise_equal(value, want, f"optim {index} {key}")


pytest_plugins = ["s3_server", "netns"]
