"""A loss scaler that skips step after step hides a broken model: ``persistent_overflow``
(orchestrator/check.py, ``detect.overflow``). 2 ranks, DDP, gloo, a real GradScaler."""

from __future__ import annotations

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
