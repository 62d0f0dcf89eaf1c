"""A loss scaler that skips step after step hides a broken model: ``persistent_overflow``
(orchestrator/check.py, ``detect.overflow``). 2 ranks, DDP, gloo, a real GradScaler."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from conftest import free_port, kinds, run

pytestmark = pytest.mark.timeout(300)

SCRIPT = Path(__file__).parent / "scaler_model.py"


def test_a_scaler_skipping_every_step_of_a_broken_model_never_ends_0(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"persist": {"enabled": False}}))  # the defaults else
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
           "--broken-from", "20"]  # fmt: skip
    r = run(cmd, env={"RUN_DIR": str(d), "ORCHESTRATOR_POLICY": str(policy)})
    assert r.returncode != 0, r.stdout[-3000:]

    incidents = kinds(d, "incident")
    assert incidents and {e["details"]["reason"] for e in incidents} == {"persistent_overflow"}
    first = incidents[0]
    assert first["step"] == 27  # 8 skips in a row (detect.overflow.max_skips): steps 20-27
    assert first["details"]["origin_ranks"] == [0, 1]  # both ranks' gradients non-finite
    assert not kinds(d, "quarantine")  # not the samples' doing
    rollbacks = kinds(d, "rollback")
    assert rollbacks and all(e["details"]["to_step"] <= 20 for e in rollbacks)  # before the skips
    assert all(e["details"]["phase"] == "cut" for e in kinds(d, "adjust") if e["step"] <= 20)
    (gave_up,) = kinds(d, "gave_up")  # the model stays broken: the incident budget runs out
    assert gave_up["details"]["budget"] == "incidents"
    end = kinds(d, "run_end")[-1]["details"]
    assert end["status"] != "finished"


FSDP_SCRIPT = Path(__file__).parent / "fsdp_scaler_model.py"


def _fsdp_scaler_run(tmp_path: Path, fsdp: str, policy: dict[str, object]) -> tuple[Path, int]:
    import subprocess

    d = tmp_path / "run"
    d.mkdir()
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(FSDP_SCRIPT),
           "--fsdp", fsdp]  # fmt: skip
    r: subprocess.CompletedProcess[str] = run(
        cmd, env={"RUN_DIR": str(d), "ORCHESTRATOR_POLICY": str(path), "OUT": str(tmp_path)}
    )
    return d, r.returncode


@pytest.mark.parametrize("fsdp", ["fsdp1", "fsdp2"])
def test_a_plain_grad_scaler_under_fsdp_skips_on_every_rank_alike(
    tmp_path: Path, fsdp: str
) -> None:
    """Only rank 1's gradient shard overflows at step 4. A plain GradScaler judges each
    rank's own shard (FSDP1's flat shards are plain tensors): rank 0 would step and keep its
    scale while rank 1 skips and halves it. The Guard gates the scaler with the step's
    all-reduced flag: both ranks skip, both scales halve, no shard moves."""
    policy = {"persist": {"enabled": False}, "faults": [{"kind": "nan_grad", "step": 4, "rank": 1}]}
    d, rc = _fsdp_scaler_run(tmp_path, fsdp, policy)
    assert rc == 0
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for rows in (r0, r1):
        by_step = {row["step"]: row for row in rows}
        assert by_step[4]["outcome"] == "overflow_skip"
        assert all(by_step[s]["outcome"] == "commit" for s in by_step if s != 4)
        assert by_step[4]["params"] == by_step[3]["params"]  # the skipped step moved nothing
        assert by_step[4]["scale"] == by_step[3]["scale"] / 2
        assert by_step[5]["params"] != by_step[4]["params"]  # and training goes on
    assert [row["scale"] for row in r0] == [row["scale"] for row in r1]
    assert not kinds(d, "incident")


def test_fsdp1_plain_grad_scaler_without_the_gradient_check_is_refused(tmp_path: Path) -> None:
    """Without gradients in the check there is no global flag to gate the scaler with."""
    policy = {"persist": {"enabled": False}, "detect": {"check_grads": False}}
    _, rc = _fsdp_scaler_run(tmp_path, "fsdp1", policy)
    assert rc != 0
    assert not (tmp_path / "rank0.json").exists()
