"""An open Guard: the user's own stateful objects in every snapshot (rolled back with the
model, resumed after a restart, bit for bit), and engines registered by name."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from inproc import Regression, events
from stateful_worker import EMA, Counter
from stateful_worker import run as train_inproc
from test_supervisor import BASE, launch_cmd

from conftest import REPO, assert_bitwise_equal, free_port, kinds, run, train
from orchestrator import Guard, UsageError, parse_policy
from orchestrator.engines import (
    EngineArgs,
    TorchEngine,
    register_engine,
    registered_engines,
    unregister_engine,
)

pytestmark = pytest.mark.timeout(400)

EXACT = {"adjust": {"lr_factor": 1.0}, "quarantine": {"enabled": False}}
PERSIST = {**EXACT, "persist": {"every_steps": 10}}
WORKER = REPO / "tests" / "stateful_worker.py"


def _run(d: Path, policy: dict[str, Any], steps: int, user: bool = True) -> dict[str, Any]:
    guard, final = train_inproc({"policy": parse_policy(policy), "run_dir": str(d)}, steps, user)
    assert guard.global_step == steps
    return final


def test_user_state_rolls_back_with_the_model_bit_for_bit(tmp_path: Path) -> None:
    """Two NaN gradients roll back to the snapshot of step 20 twice: the EMA and the counter
    (which keeps, and adds in place to, the tensor a restore gives it) end as in a clean
    run, with the model, bit for bit. Without their restore the steps 20-24 would count
    twice; had a restore handed the snapshot's own buffer to the counter, its in-place
    updates would have changed the snapshot the second rollback restores."""
    clean = _run(tmp_path / "clean", EXACT, 40)
    faults = [{"kind": "nan_grad", "step": 23}, {"kind": "nan_grad", "step": 25}]
    faulty = _run(tmp_path / "faulty", {**EXACT, "faults": faults}, 40)
    rollbacks = events(tmp_path / "faulty", "rollback")
    assert [e["details"]["to_step"] for e in rollbacks] == [20, 20]
    assert faulty["commits"] == 40 and faulty["step"] == 40
    assert_bitwise_equal(clean, faulty, "final")


def test_user_state_resumes_after_a_restart(tmp_path: Path) -> None:
    """A run closed at step 30 and started again to 60 in the same run directory resumes
    the objects from the durable snapshot, bit for bit with an uninterrupted run; a
    snapshot written before any object was registered resumes too, leaving them as built."""
    clean = _run(tmp_path / "clean", PERSIST, 60)
    d = tmp_path / "run"
    _run(d, PERSIST, 30)
    resumed = _run(d, PERSIST, 60)
    (resume,) = events(d, "resume")
    assert resume["details"]["snapshot_step"] == 30
    assert_bitwise_equal(clean, resumed, "final")

    old = tmp_path / "old"
    _run(old, PERSIST, 10, user=False)  # its snapshots have no "user" key
    guard, _ = train_inproc({"policy": parse_policy(PERSIST), "run_dir": str(old)}, 20)
    assert events(old, "resume")[0]["details"]["snapshot_step"] == 10 and guard.global_step == 20


@pytest.mark.parametrize(
    "engine,tier",
    [
        ("ddp", "durable"),
        ("ddp", "shm"),
        # The same path (a rank-local snapshot key) through the sharded engines' parts and
        # DeepSpeed's layout; in the full matrix only.
        pytest.param("fsdp2", "durable", marks=pytest.mark.matrix),
        pytest.param("zero2", "durable", marks=pytest.mark.matrix),
    ],
)
def test_user_state_crash_and_resume_on_two_ranks_bit_for_bit(
    tmp_path: Path, engine: str, tier: str
) -> None:
    """2 ranks, snapshots every 10 steps (durable ones, or in the node's shared memory under
    the supervisor), rank 0 crashes at step 25: the next attempt resumes from step 20, rolls
    back from a NaN gradient on rank 1 at step 33 to step 30, and every rank ends with the
    EMA and its own counter (the sum of its own losses: the ranks' differ) bit for bit as
    in a clean run."""
    if engine == "zero2":
        pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs it")
    args = ["--engine", engine, "--steps", "40"]
    policy: dict[str, Any] = PERSIST
    if tier == "shm":
        policy = {
            **BASE,
            "snapshot": {"every_steps": 10, "shared_memory": True},
            "persist": {"every_steps": 100},
        }
    clean, d = tmp_path / "clean", tmp_path / "run"
    crash = {"kind": "crash", "step": 25, "rank": 0, "after_persist": tier == "durable"}
    faults = [crash, {"kind": "nan_grad", "step": 33, "rank": 1}]
    if tier == "shm":
        for run_dir, p in ((clean, policy), (d, {**policy, "faults": faults})):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(WORKER),
                   *args, "--save-final", str(run_dir / "final")]  # fmt: skip
            r = run(launch_cmd(run_dir, p, *cmd), timeout=300)
            assert r.returncode == 0, r.stdout[-3000:]
    else:
        r = train(clean, 2, *args, policy=policy, script=WORKER)
        assert r.returncode == 0, r.stdout[-3000:]
        first = train(d, 2, *args, policy={**policy, "faults": faults}, script=WORKER)
        assert first.returncode != 0 and [e["step"] for e in kinds(d, "fault")] == [25]
        second = train(d, 2, *args, policy={**policy, "faults": faults}, script=WORKER)
        assert second.returncode == 0, second.stdout[-3000:]
    (resume,) = kinds(d, "resume")
    at = 20
    if tier == "durable":
        # The newest snapshot committed before the crash: step 20's, unless step 10's write
        # was still in flight when 20 was sealed (persist_skipped: CI's loaded machine), then
        # step 10's. The final state is bit for bit either way.
        crashed = next(e for e in kinds(d, "fault") if e["details"]["fault"]["kind"] == "crash")
        at = max(e["step"] for e in kinds(d, "persist") if e["time"] < crashed["time"])
        assert at in (10, 20)
    assert resume["details"]["snapshot_step"] == at
    assert resume["details"]["tier"] == ("shm" if tier == "shm" else "remote")
    assert [e["details"]["to_step"] for e in kinds(d, "rollback")] == [30]
    want = [torch.load(clean / "final" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    got = [torch.load(d / "final" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert not torch.equal(want[0]["loss_sum"], want[1]["loss_sum"])  # per-rank state
    for rank, (a, b) in enumerate(zip(want, got, strict=True)):
        assert_bitwise_equal(a, b, f"rank {rank}")


class CountingEngine(TorchEngine):
    """The torch engine, counting the optimizer steps it applies."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied = 0

    def _apply(self, lr_multiplier: float, overflow: bool | None = None) -> None:
        self.applied += 1
        super()._apply(lr_multiplier, overflow)


@pytest.fixture
def counting() -> Iterator[str]:
    register_engine("counting", CountingEngine)
    try:
        yield "counting"
    finally:
        unregister_engine("counting")


def _loop(guard: Guard, model: torch.nn.Module, steps: int) -> None:
    loader = guard.dataloader(Regression(), batch_size=8)
    for x, y in guard.batches(loader, max_steps=steps):
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        guard.backward(loss)
        guard.step(loss)
    guard.close()


def test_a_registered_engine_is_chosen_by_name(tmp_path: Path, counting: str) -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    policy = parse_policy({"faults": [{"kind": "nan_grad", "step": 7}]})
    guard = Guard(policy, engine=counting, model=model, optimizer=opt, run_dir=str(tmp_path))
    assert isinstance(guard.engine, CountingEngine) and guard.engine.micro_steps_per_step == 1
    _loop(guard, model, 12)
    assert guard.rollbacks == 1 and guard.global_step == 12
    # 12 committed steps, 7 of them (0-6) again after the rollback to step 0's snapshot
    # (snapshots every 10): the bad step itself was never applied.
    assert guard.engine.applied == 12 + 7
    assert events(tmp_path, "run_start")  # the run went through the whole Guard


def test_a_registered_engine_is_chosen_by_its_predicate(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 1)
    model.counted = True  # type: ignore[assignment]  # what the predicate looks for
    register_engine(
        "counting-auto",
        lambda args: CountingEngine.from_args(args),
        matches=lambda args: getattr(args.model, "counted", False),
    )
    try:
        guard = Guard(
            parse_policy({}),
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            run_dir=str(tmp_path / "a"),
        )
        _loop(guard, model, 3)
        assert isinstance(guard.engine, CountingEngine) and guard.engine.applied == 3
        other = torch.nn.Linear(8, 1)  # no mark: the built-in torch engine
        plain = Guard(
            parse_policy({}),
            model=other,
            optimizer=torch.optim.SGD(other.parameters(), lr=0.01),
            run_dir=str(tmp_path / "b"),
        )
        assert type(plain.engine) is TorchEngine
        plain.close()
    finally:
        unregister_engine("counting-auto")


def test_builtin_engines_are_registered_and_a_replaced_engine_keeps_its_place() -> None:
    assert registered_engines()[:4] == ["torch", "fsdp2", "fsdp1", "deepspeed"]
    register_engine("first", CountingEngine)
    register_engine("second", CountingEngine)
    try:
        register_engine("first", TorchEngine, replace=True)
        assert registered_engines()[-2:] == ["first", "second"]
    finally:
        unregister_engine("first")
        unregister_engine("second")
    with pytest.raises(UsageError, match=r"'first'.*registered: deepspeed"):
        unregister_engine("first")
    model = torch.nn.Linear(8, 1)
    args = EngineArgs(model, torch.optim.SGD(model.parameters(), lr=0.1), grad_accum_steps=3)
    engine = TorchEngine.from_args(args)
    assert engine.micro_steps_per_step == 3
    engine.release()


class NoLoad:
    def state_dict(self) -> dict[str, Any]:
        return {}


class Opaque:
    def state_dict(self) -> dict[str, Any]:
        return {"when": object()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_misuse_of_the_registries_says_what_to_do(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw: dict[str, Any] = {"model": model, "optimizer": opt, "run_dir": str(tmp_path)}
    with pytest.raises(UsageError, match=r"'ema'.*no load_state_dict"):
        Guard(parse_policy({}), state={"ema": NoLoad()}, **kw)
    with pytest.raises(UsageError, match=r"'step'.*\['when'\] is a object"):
        Guard(parse_policy({}), state={"step": Opaque()}, **kw)
    with pytest.raises(UsageError, match=r"unknown-engine.*registered: deepspeed, fsdp1"):
        Guard(parse_policy({}), engine="unknown-engine", **kw)
    with pytest.raises(UsageError, match="registered already"):
        register_engine("torch", TorchEngine)

    guard = Guard(parse_policy({}), state={"ema": EMA(model)}, **kw)
    try:
        with pytest.raises(UsageError, match=r"'ema'.*taken by a EMA"):
            guard.register_state("ema", Counter())
        batches = guard.batches(guard.dataloader(Regression(), batch_size=4), max_steps=2)
        next(batches)
        with pytest.raises(UsageError, match=r"'late'.*first snapshot was already taken"):
            guard.register_state("late", Counter())
    finally:
        guard.close(persist=False)


def test_the_policy_is_frozen_and_tuned_intervals_live_apart(tmp_path: Path) -> None:
    """A loaded policy refuses changes; every_steps: auto changes the Guard's intervals
    (what the ring and the durable tier follow), never the policy it was given."""
    import pydantic

    policy = parse_policy(
        {
            "snapshot": {"every_steps": "auto"},
            "persist": {"every_steps": "auto"},
            "tune": {"every_steps": 20, "initial_snapshot_steps": 5, "initial_persist_steps": 10,
                     "prior_incident_mtbf_s": 3.0, "prior_restart_mtbf_s": 60.0},
        }
    )  # fmt: skip
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        policy.snapshot.every_steps = 3  # type: ignore[misc]
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(policy, model=model, optimizer=opt, run_dir=str(tmp_path))
    assert (guard.intervals.snapshot_steps, guard.intervals.persist_steps) == (5, 10)
    _loop(guard, model, 100)
    assert (guard.policy.snapshot.every_steps, guard.policy.persist.every_steps) == (5, 10)
    changes = events(tmp_path, "interval")
    assert changes, "no interval was chosen"
    for tier, initial in (("snapshot", 5), ("persist", 10)):
        said = [c["details"]["new"] for c in changes if c["details"]["tier"] == tier]
        assert getattr(guard.intervals, f"{tier}_steps") == (said[-1] if said else initial)


@pytest.mark.timeout(120)
def test_the_user_s_objects_count_in_the_ring_s_host_memory_budget(tmp_path: Path) -> None:
    """An EMA of a big model (32 MiB of tensors) registered with the Guard: the ring's
    host-memory budget counts it with the engine's state, and each slot is made with room
    for both before training. A budget that fits the engine's state alone but not the EMA
    with it fails as the engine's state alone does (PolicyError, at the start); an EMA
    registered after the Guard was built (register_state) fails at the first
    guard.batches, before any snapshot is taken."""
    from orchestrator import PolicyError
    from orchestrator.snapshot import slot_bytes

    ema = EMA(torch.nn.Linear(2048, 4096))
    user_bytes = sum(t.numel() * t.element_size() for t in ema.shadow.values())
    assert user_bytes > 32 * 2**20

    def guard(d: str, policy: dict[str, Any], state: dict[str, Any] | None = None) -> Guard:
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return Guard(parse_policy(policy), model=model, optimizer=opt,
                     run_dir=str(tmp_path / d), state=state)  # fmt: skip

    def first_batch(g: Guard) -> None:
        next(iter(g.batches(g.dataloader(Regression(), batch_size=4), max_steps=2)))

    alone, with_ema = guard("alone", {}), guard("ema", {}, {"ema": ema})
    try:
        keep = with_ema.policy.snapshot.keep
        assert (alone.keeper.budget.user_bytes, with_ema.keeper.budget.user_bytes) == (
            0,
            user_bytes,
        )
        assert with_ema.keeper.budget.need - alone.keeper.budget.need >= keep * user_bytes
        first_batch(with_ema)  # the slots are made at the first snapshot, for both
        room = slot_bytes(with_ema.engine.estimate_state_bytes() + user_bytes)
        assert all(a is not None and a.numel() >= room for a in with_ema.ring._arenas)
    finally:
        alone.close(persist=False)
        with_ema.close(persist=False)
    # In shared memory: each slot's file (this rank's own: the EMA is) made with room too.
    shm = {"snapshot": {"shared_memory": True, "shm_dir": str(tmp_path / "shm")}}
    in_shm = guard("shm", shm, {"ema": ema})
    try:
        first_batch(in_shm)
        assert in_shm.shm is not None and in_shm.keeper.budget.user_bytes == user_bytes
        room = slot_bytes(in_shm.engine.estimate_state_bytes() + user_bytes)
        assert all(f is not None and os.path.getsize(f) >= room for f in in_shm.shm._files)
    finally:
        in_shm.close(persist=False)

    over = r"snapshot.keep=2 needs .* snapshot.max_host_memory_gb"
    tight = {"snapshot": {"keep": 2, "max_host_memory_gb": 0.03}}  # 30 MiB: not 2 x 33
    guard("fits", tight).close(persist=False)  # the engine's state alone: 2 x 1 MiB
    with pytest.raises(PolicyError, match=over):
        guard("over", tight, {"ema": ema})
    late = guard("late", tight)
    try:
        late.register_state("ema", ema)
        with pytest.raises(PolicyError, match=over):
            first_batch(late)
        assert late.ring.snapshots() == [] and late.keeper.budget.user_bytes == user_bytes
    finally:
        late.close(persist=False)
