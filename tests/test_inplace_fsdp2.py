"""Issue 33 with FSDP2 (``fully_shard``, orchestrator/engines/rebind_fsdp.py): rank 1 of the
example GPT sharded over 2 ranks (gloo) dies or hangs at step 27; the survivor re-points its
DeviceMesh and FSDP's shard groups at the re-formed world group and rolls back to its ring
slot, the replacement heals its own shard (its shared-memory slot, else its durable part:
never a peer's, which holds another shard). Rank 0 keeps its process, and every rank's
shards end bit for bit those of an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_inplace import CRASH, POLICY, STEPS, Parent

from conftest import (
    EXAMPLE,
    REPO,
    assert_bitwise_equal,
    final_states,
    free_port,
    kinds,
    run,
    train,
)
from orchestrator.protocol import ENV_SHM_DIR

pytestmark = pytest.mark.timeout(300)

FSDP = ["--fsdp", *STEPS]
DIES_HEALING = Path(__file__).parent / "dies_healing.py"
OWN_GROUP = Path(__file__).parent / "mesh_own_group.py"


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("clean-fsdp2") / "run"
    r = train(d, 2, *FSDP, policy=POLICY)
    assert r.returncode == 0, r.stdout[-3000:]
    return d


def assert_same_state(clean: Path, d: Path) -> None:
    """Every rank's shards bit for bit, and each parameter's whole tensor (its ranks' dim-0
    shards put together) too."""
    ref, got = final_states(clean), final_states(d)
    assert len(ref) == len(got) == 2
    for a, b in zip(ref, got, strict=True):
        assert_bitwise_equal(a, b, "final")
    for name in ref[0]["model"]:
        whole = [torch.cat([s["model"][name] for s in states]) for states in (ref, got)]
        assert_bitwise_equal(whole[0], whole[1], f"whole {name}")


def launch(tmp_path: Path, policy: dict[str, Any], *script: str) -> Path:
    """`orchestrator launch --nproc-per-node 2` (the node agent) of ``script``, to its end."""
    d = tmp_path / "run"
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({**policy, "supervisor": {"backoff_s": 0.2}}))
    cmd = [sys.executable, "-m", "launch.cli", "launch", "--policy", str(path),
           "--run-dir", str(d), "--nproc-per-node", "2",
           *script, str(EXAMPLE), *FSDP, "--save-final", str(d / "final")]  # fmt: skip
    r = run(cmd, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:]
    return d


def fsdp2_parent(d: Path, policy: dict[str, Any], **kwargs: Any) -> Parent:
    """test_inplace's stand-in for the agent, running the example sharded by FSDP2."""
    parent = Parent(d, policy, **kwargs)
    parent.cmd = [sys.executable, str(EXAMPLE), *FSDP, "--save-final", str(d / "final")]
    return parent


def test_sigkill_of_rank1_under_the_agent_heals_its_shard_in_place(
    tmp_path: Path, clean: Path
) -> None:
    """Rank 1 SIGKILLed at step 27: the agent starts it alone, it heals from its own
    shared-memory slot of step 25, rank 0 stays in its first process; one attempt."""
    d = launch(tmp_path, {**POLICY, **CRASH})
    (rep,) = kinds(d, "rank_replaced")
    assert (rep["details"]["rank"], rep["details"]["cause"]) == (1, "signal")
    (rec,) = kinds(d, "inplace_recovery")
    det = rec["details"]
    assert rec["step"] == 25 and det["replaced"] == [1] and det["generation"] == 1, rec
    assert det["sources"]["0"]["source"] == "ring"
    assert det["sources"]["1"]["source"] == "shm", rec  # its own shard, never a peer's
    t = det["times"]
    assert t["fault"] <= t["reform"] <= t["heal"] <= t["first_step"], t
    assert [e["rank"] for e in kinds(d, "run_start")].count(0) == 1  # rank 0: one process
    assert kinds(d, "restart") == [] and len(kinds(d, "attempt_end")) == 1
    assert_same_state(clean, d)


def test_meshes_with_groups_of_their_own_are_formed_again_as_the_replacement_forms_them(
    tmp_path: Path, clean: Path
) -> None:
    """Each fully_shard's default mesh with a group of its own over the world (CUDA under
    gloo does that; tests/mesh_own_group.py on the CPU): the replacement's constructors
    form 3 groups, the survivor forms its 3 again in the same order; in place, bit for
    bit."""
    d = launch(tmp_path, {**POLICY, **CRASH}, str(OWN_GROUP))
    (rec,) = kinds(d, "inplace_recovery")
    assert rec["step"] == 25 and rec["details"]["sources"]["1"]["source"] == "shm", rec
    assert [e["rank"] for e in kinds(d, "run_start")].count(0) == 1
    assert kinds(d, "restart") == [] and kinds(d, "inplace_failed") == []
    assert_same_state(clean, d)


def test_lost_shm_slot_heals_the_shard_from_its_own_durable_part(
    tmp_path: Path, clean: Path
) -> None:
    """Rank 1's shared-memory slots are gone with it, and rank 0's durable part of step 20
    is torn: its replacement loads its own rank's part of step 20, which is all a sharded
    rank reads (a survivor's ring slot holds another shard: no source)."""
    d, shm = tmp_path / "run", tmp_path / "shm"
    lost: list[str] = []

    def lose_rank1_slots_tear_rank0_part() -> None:
        for f in shm.glob("slot*/rank1*"):
            lost.append(f.name)
            f.unlink()
        (part,) = (d / "snapshots" / "step_000000020" / "rank_0").glob("*.distcp")
        raw = bytearray(part.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        part.write_bytes(bytes(raw))

    parent = fsdp2_parent(d, {**POLICY, **CRASH}, on_death=lose_rank1_slots_tear_rank0_part)
    parent.env[ENV_SHM_DIR] = str(shm)
    codes, pid0 = parent.run()
    assert codes == {0: 0, 1: 0}, parent.tail()
    assert any(n.endswith(".json") for n in lost), lost  # rank 1 had sealed slots there
    (rec,) = kinds(d, "inplace_recovery")
    assert rec["step"] == 20 and rec["details"]["sources"]["1"]["source"] == "durable", rec
    assert rec["details"]["sources"]["0"]["source"] == "ring"
    assert pid0 > 0 and [e["rank"] for e in kinds(d, "run_start")].count(0) == 1
    assert_same_state(clean, d)


@pytest.mark.matrix  # the survivor's side is the crash's (above); DDP's hang: test_inplace
def test_hung_rank1_killed_alone_heals_its_shard_in_place(tmp_path: Path, clean: Path) -> None:
    """Rank 1 hangs inside step 27; killed alone (the agent's hang watch, played by the
    parent), the survivor's collective fails and the recovery is the crash's."""
    d = tmp_path / "run"
    parent = fsdp2_parent(d, {**POLICY, "faults": [{"kind": "hang", "step": 27, "rank": 1}]})
    codes, _ = parent.run()
    assert codes == {0: 0, 1: 0}, parent.tail()
    (rec,) = kinds(d, "inplace_recovery")
    assert rec["details"]["cause"] == "hang" and rec["step"] == 20
    assert rec["details"]["sources"]["1"]["source"] == "durable"
    assert [e["rank"] for e in kinds(d, "run_start")].count(0) == 1
    assert_same_state(clean, d)


def test_a_second_death_while_healing_falls_back_to_a_full_restart(
    tmp_path: Path, clean: Path
) -> None:
    """The replacement dies where it would join the agreement: the survivor's agreement
    fails, the agent restarts every rank, and the run still ends bit for bit."""
    d = launch(tmp_path, {**POLICY, **CRASH}, str(DIES_HEALING))
    assert kinds(d, "rank_replaced") == [] and kinds(d, "inplace_recovery") == []
    (failed,) = kinds(d, "inplace_failed")
    assert failed["details"]["ranks"] == [1] and failed["details"]["generation"] == 1
    (restart,) = kinds(d, "restart")
    assert restart["attempt"] == 0
    assert_same_state(clean, d)


def test_no_source_for_the_shard_falls_back_to_a_full_restart(tmp_path: Path, clean: Path) -> None:
    """Rank 1 dies while writing its durable part of step 20, the ring in private memory
    (no shared-memory slot survives it) and 2 slots long: the survivor holds steps 15 and
    20, the replacement's part of neither, and a survivor's slot holds another shard, so
    there is no in-place heal (DDP takes the peer's copy there). The agent restarts every
    rank from step 10."""
    kill = {"kind": "kill_persist", "phase": "part", "step": 20, "rank": 1}
    snapshot = {**POLICY["snapshot"], "keep": 2, "shared_memory": False}
    d = launch(tmp_path, {**POLICY, "snapshot": snapshot, "faults": [kill]})
    assert kinds(d, "inplace_recovery") == [] and kinds(d, "rank_replaced") == []
    (failed,) = kinds(d, "inplace_failed")
    assert failed["details"]["generation"] == 1, failed
    (restart,) = kinds(d, "restart")
    assert restart["attempt"] == 0
    assert [e["step"] for e in kinds(d, "resume")] == [10]
    assert_same_state(clean, d)


REBIND_CHECK = """
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from orchestrator.engines.rebind_fsdp import (
    _mesh_infos, fsdp2_unsupported, own_groups, rebind_fsdp2)

def world(port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

def groups(model):  # the groups FSDP2 issues collectives on, and its mesh's
    infos = [i for i in _mesh_infos(model) if i is not None]
    return {pg for i in infos for pg in (i.shard_process_group, i.mesh.get_group())}

def step(model, opt):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()

def sharded(mesh=None):
    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)),
                        mesh=mesh)
    opt = torch.optim.Adam(model.parameters())
    step(model, opt)
    return model, opt

world(sys.argv[1])
torch.manual_seed(0)
model, opt = sharded()
# a group of its own over the world (new_group), as init_device_mesh makes on CUDA under gloo
other, other_opt = sharded(init_device_mesh("cpu", (1,), backend_override={0: "gloo"}))
print("refused:", [fsdp2_unsupported(m, o) for m, o in ((model, opt), (other, other_opt))])
own = [own_groups(model, opt), own_groups(other, other_opt)]
print("own:", own)
dist.destroy_process_group()
world(sys.argv[2])  # the re-formed world: the same rank and size, new group objects
print("before:", groups(model) == {dist.group.WORLD})
rebind_fsdp2(model, opt, own[0])
rebind_fsdp2(other, other_opt, own[1])
print("after:", groups(model) == {dist.group.WORLD})
(formed,) = groups(other)
print("formed:", formed is not dist.group.WORLD and formed.group_name == own[1][0])
step(model, opt)  # FSDP2's all-gather and reduce-scatter on the new groups
step(other, other_opt)
print("rebound:", fsdp2_unsupported(model, opt))
mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
hsdp = fully_shard(torch.nn.Linear(4, 4), mesh=mesh2)
print("hsdp:", fsdp2_unsupported(hsdp, torch.optim.Adam(hsdp.parameters())))
loss = model(torch.ones(2, 4)).sum()  # a forward whose backward never came: gathered root
print("mid step:", fsdp2_unsupported(model, opt))
"""


def test_rebind_points_fsdp2_at_the_new_groups_and_refuses_what_it_cannot() -> None:
    """In one process: once rebound, every group FSDP2 holds is the re-formed world group,
    or for a mesh that had a group of its own a new one formed in its place (named as the
    replacement's constructors name it), and a step runs on them (with 2 ranks a step on
    the old ones fails: the survivor dies and the agent restarts everyone); a 2-D (HSDP)
    mesh and a step left in the middle are refused with their reason."""
    r = subprocess.run(
        [sys.executable, "-c", REBIND_CHECK, str(free_port()), str(free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert out["refused"] == "[None, None]" and out["own"] == "[[], ['1']]", out
    assert (out["before"], out["after"], out["formed"]) == ("False", "True", "True"), out
    assert out["rebound"] == "None", out
    assert "None" not in (out["hsdp"], out["mid step"]), out
