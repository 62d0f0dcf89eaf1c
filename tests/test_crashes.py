"""Samples that kill the process (orchestrator/crashes.py): the markers a dead attempt
leaves, what the next attempt makes of them (pure), and end to end under the supervisor: a
token id past the vocabulary raises IndexError in the forward of a real nn.Embedding at
the same step of every attempt; within 3 attempts it is quarantined and the run ends 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from conftest import free_port, kinds, run
from orchestrator.crashes import (
    IDLE,
    IN_BODY,
    IN_GUARD,
    Mark,
    StepMarker,
    collective_failure,
    read_marks,
    suspicion,
)
from orchestrator.data import GuardBatchSampler

pytestmark = pytest.mark.timeout(300)


def test_a_marker_outlives_its_process_and_is_written_only_from_the_first_batch(
    tmp_path: Path,
) -> None:
    m = StepMarker(str(tmp_path), rank=1, attempt=4)
    m.set(23, 1, 420, IN_BODY)  # then the process dies: nothing is flushed or closed
    del m
    assert read_marks(str(tmp_path)) == [Mark(1, 4, 23, 1, 420, IN_BODY)]
    # The next attempt opens its marker without writing: if it dies in its start, the
    # marker still says where attempt 4 died.
    again = StepMarker(str(tmp_path), rank=1, attempt=5)
    assert read_marks(str(tmp_path)) == [Mark(1, 4, 23, 1, 420, IN_BODY)]
    again.close()  # a clean end
    assert read_marks(str(tmp_path))[0].state == IDLE


def test_a_peer_s_death_is_told_from_a_sample_s() -> None:
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]")
    assert collective_failure(gloo)
    assert not collective_failure(IndexError("index out of range in self"))
    assert not collective_failure(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))


def test_what_the_next_attempt_makes_of_a_death() -> None:
    body = [Mark(0, 2, 23, 0, -1, IN_GUARD), Mark(1, 2, 23, 0, -1, IN_BODY)]
    s = suspicion(body, 3, [])
    assert s is not None and (s.step, s.micro, s.ranks, s.culprits) == (23, 0, [1], [])
    # Died in a probe: that sample.
    probe = [Mark(0, 3, 23, 0, 297, IN_BODY), Mark(1, 3, 23, 0, 420, IN_BODY)]
    s = suspicion(probe, 4, [])
    assert s is not None and s.culprits == [297] and s.why == "died_in_probe"
    # FSDP: every rank is in a probe (the forward's collectives); the rank whose probe
    # failed of its peer's death is not the culprit's.
    peer = [{"kind": "loop_error", "attempt": 3, "rank": 0, "step": 23,
             "details": {"collective": True}}]  # fmt: skip
    s = suspicion(probe, 4, peer)
    assert s is not None and s.culprits == [420] and s.ranks == [1]
    # Every sample passed alone, the batch killed again: all of them, together.
    clean = [{"kind": "crash_probes_clean", "step": 23, "rank": 1,
              "details": {"micro": 0, "samples": [5, 9]}}]  # fmt: skip
    s = suspicion(body, 3, clean)
    assert s is not None and s.culprits == [5, 9] and s.why == "died_together"
    # Not in a loop body (the check, an optimizer step, a clean end): nothing to suspect.
    assert suspicion([Mark(0, 2, 23, 0, -1, IN_GUARD)], 3, []) is None
    assert suspicion([Mark(0, 2, 23, 0, -1, IDLE)], 3, []) is None
    assert suspicion([], 3, []) is None
    # The attempt after the death died in its start (no marker): the death still counts.
    assert suspicion(body, 4, []) is not None


SCRIPT = Path(__file__).parent / "crash_model.py"


def test_a_sample_that_raises_in_the_loop_body_is_quarantined_within_3_attempts(
    tmp_path: Path,
) -> None:
    sampler = GuardBatchSampler(512, 8, rank=0, world_size=2, seed=3)
    bad = sampler.global_batch_at(0, 23 * 16)[11]  # step 23, rank 1
    d = tmp_path / "run"
    policy = tmp_path / "policy.yaml"
    fast = {"backoff_s": 0.2, "backoff_max_s": 0.5}  # restarts at once: a test, not a cluster
    policy.write_text(yaml.safe_dump({"persist": {"every_steps": 10}, "supervisor": fast}))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]  # fmt: skip
    r = run([sys.executable, "-m", "launch.cli", "launch", "--policy", str(policy),
             "--run-dir", str(d), "--", *torchrun, str(SCRIPT), "--bad", str(bad)])  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:]

    ledger = [json.loads(x) for x in (d / "quarantine.jsonl").read_text().splitlines()]
    assert [(e["sample"], e["reason"]) for e in ledger] == [(bad, "crash")]
    # The first death names the step and the samples of the rank that raised.
    errors = [e for e in kinds(d, "loop_error") if e["attempt"] == 0 and e["rank"] == 1]
    assert errors and errors[0]["step"] == 23 and bad in errors[0]["details"]["samples"]
    assert "IndexError" in errors[0]["details"]["error"]
    (inc,) = kinds(d, "incident")
    assert inc["details"]["reason"] == "crash" and inc["details"]["cause"] == "data"
    assert inc["details"]["samples"] == [bad] and inc["attempt"] <= 2
    end = kinds(d, "run_end")[-1]
    assert end["details"]["status"] == "finished" and end["details"]["steps"] == 40
