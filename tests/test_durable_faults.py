"""Durable snapshots under the faults nobody had tried: a rank killed in each phase of a
write, a committed snapshot whose manifest is garbage, truncated or of another shape,
manifests and DeepSpeed files tampered with (with and without a signing key), paths that
leave the snapshot's directory. Each ends with nothing committed lost (orchestrator.audit)
and the documented outcome; the kills end bit for bit where an uninterrupted run does."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from inproc import events
from inproc import train as train_inproc

from conftest import DS_EXAMPLE, assert_bitwise_equal, final_states, kinds, train
from orchestrator.audit import audit
from orchestrator.protocol import ENV_SIGNING_KEY
from orchestrator.store import MANIFEST, DurableStore, signing_key, step_dir

pytestmark = pytest.mark.timeout(300)

STEPS = ["--steps", "40"]
PERSIST = {"adjust": {"lr_factor": 1.0}, "persist": {"every_steps": 10, "keep": 2}}


@pytest.fixture(scope="module")
def uninterrupted(clean_run: Callable[[int], Path]) -> Path:
    return clean_run(40)


@pytest.mark.parametrize(
    ("phase", "step", "rank", "resumed"),
    [
        ("part", 20, 1, 10),  # rank 1's tensors written, its index not: 20 never commits
        ("parts", 20, 0, 10),  # every part there, no manifest
        ("manifest", 20, 0, 10),  # the manifest there, no COMMITTED marker
        ("prune", 30, 0, 30),  # 30 committed, retention deleting 10 when the kill comes
    ],
)
def test_a_rank_killed_in_each_phase_of_a_write_loses_nothing_committed(
    tmp_path: Path, uninterrupted: Path, phase: str, step: int, rank: int, resumed: int
) -> None:
    d = tmp_path / "run"
    fault = {"kind": "kill_persist", "phase": phase, "step": step, "rank": rank}
    policy = {**PERSIST, "faults": [fault]}
    first = train(d, 2, *STEPS, policy=policy)
    assert first.returncode != 0
    (fired,) = kinds(d, "fault")
    assert (fired["rank"], fired["step"], fired["details"]["fault"]["phase"]) == (rank, step, phase)
    assert audit(str(d)) == []  # nothing committed before the kill is lost
    # A surviving rank 0 ends by itself: the launcher's SIGTERM stops its commit's wait for
    # the dead rank's part (else torchrun SIGKILLs it 30 s later, with no run_end).
    ends = [(e["rank"], e["details"]["status"]) for e in kinds(d, "run_end")]
    assert ends == ([(0, "not_closed")] if rank != 0 else [])
    second = train(d, 2, *STEPS, policy=policy)  # the same command again
    assert second.returncode == 0, second.stdout[-3000:]
    (resume,) = kinds(d, "resume")
    assert resume["details"]["snapshot_step"] == resumed
    assert not kinds(d, "snapshot_invalid")  # the half-written step was never a candidate
    assert audit(str(d)) == []
    store = DurableStore(str(d / "snapshots"))
    assert all(c.committed for c in store.candidates()), "a half-written step was left"
    for a, b in zip(final_states(uninterrupted), final_states(d), strict=True):
        assert_bitwise_equal(a, b, "final")


@pytest.mark.parametrize("how", ["garbage", "truncate", "shape"])
def test_a_damaged_manifest_is_refused_and_the_older_snapshot_used(
    tmp_path: Path, how: str
) -> None:
    """manifest.json of the committed step 20 is damaged (its COMMITTED marker stays): the
    resume refuses it with the reason and takes step 10; the snapshots tool says the same
    instead of a traceback."""
    policy = {
        "persist": {"every_steps": 10, "keep": 3},
        "faults": [{"kind": "corrupt_manifest", "step": 20, "how": how}],
    }
    train_inproc(tmp_path, policy, steps=20)
    store = DurableStore(str(tmp_path / "snapshots"))
    (cand,) = [c for c in store.candidates() if c.step == 20]
    assert cand.committed and cand.manifest is None and "manifest.json" in str(cand.problem)
    assert store.check(cand) == cand.problem
    guard, _, _ = train_inproc(tmp_path, policy, steps=25)
    (bad,) = events(tmp_path, "snapshot_invalid")
    assert bad["details"]["snapshot_step"] == 20 and "manifest.json" in bad["details"]["reasons"][0]
    assert events(tmp_path, "resume")[0]["details"]["snapshot_step"] == 10
    assert guard.global_step == 25
    assert audit(str(tmp_path)) == []  # 20 was damaged on purpose; 10 and 25 are whole


def test_paths_outside_the_snapshot_are_refused(tmp_path: Path) -> None:
    """A manifest (or a part's index) naming a file outside its snapshot's directory is
    refused before anything is read from there."""
    from orchestrator.errors import PersistError
    from orchestrator.store import manifest_problem, safe_rel

    train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=10)
    store = DurableStore(str(tmp_path / "snapshots"))
    path = tmp_path / "snapshots" / step_dir(10) / MANIFEST
    good = json.loads(path.read_text())
    for rel in ("../../../etc/passwd", "/etc/passwd", "rank_0/../../x", "a//b", "a\\..\\b", ""):
        doc = {**good, "files": {rel: {"size": 1, "sha256": "0" * 64}}}
        assert "leaves the snapshot" in str(manifest_problem(doc)), rel
        with pytest.raises(PersistError, match="leaves the snapshot"):
            safe_rel(rel, "test")
    path.write_text(json.dumps({**good, "files": {"../outside": {"size": 1, "sha256": "x"}}}))
    (cand,) = store.candidates()
    assert "leaves the snapshot" in str(store.check(cand))


def test_a_signed_manifest_tells_tampered_from_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a signing key every manifest carries its HMAC: a changed manifest or file is
    refused as tampered, an unsigned one too. Without the key the same damage reads as
    corrupt, and nothing claims more."""
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    policy = {"persist": {"every_steps": 10, "signing_key_file": str(key_file)}}
    run = tmp_path / "run"
    train_inproc(run, policy, steps=20)
    url = str(run / "snapshots")
    signed, unsigned = DurableStore(url, key=b"s3cret"), DurableStore(url)
    assert all(signed.check(c) is None for c in signed.candidates())
    manifest = run / "snapshots" / step_dir(20) / MANIFEST
    doc = json.loads(manifest.read_text())
    assert doc["signature"]["alg"] == "hmac-sha256"
    # A file changed (the manifest kept): tampered with the key, corrupt without.
    part = next((run / "snapshots" / step_dir(20) / "rank_0").glob("*.distcp"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    assert "tampered" in str(signed.check(signed.candidates()[0]))
    said = str(unsigned.check(unsigned.candidates()[0]))
    assert "corrupt" in said and "tamper" not in said
    # The manifest rewritten to match (what a tamperer does): only the signature can tell.
    _match_manifest(manifest.parent, f"rank_0/{part.name}")
    assert "does not match its signature: tampered" in str(signed.candidates()[0].problem)
    # A mac that is not even ASCII is refused the same way (compare_digest would raise).
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "signature": {"alg": "hmac-sha256", "mac": "é"}}))
    assert "does not match its signature" in str(signed.candidates()[0].problem)
    # Unsigned snapshots are refused once a key is set: the Guard's resume (the key from
    # the policy's file) says why and takes the older, signed step 10.
    del doc["signature"]
    manifest.write_text(json.dumps(doc))
    assert "not signed" in str(signed.candidates()[0].problem)
    train_inproc(run, policy, steps=25)
    (bad,) = events(run, "snapshot_invalid")
    assert bad["details"]["snapshot_step"] == 20 and "not signed" in bad["details"]["reasons"][0]
    assert events(run, "resume")[0]["details"]["snapshot_step"] == 10
    # The variable wins over the file (and is stripped as the file is); every snapshot
    # signed with the file's key then reads as tampered or signed with another key.
    monkeypatch.setenv(ENV_SIGNING_KEY, "another key\n")
    assert signing_key(str(key_file)) == b"another key"
    other = DurableStore(url, key=signing_key(str(key_file)))
    assert all("another key" in str(c.problem) for c in other.candidates() if c.committed)


def test_a_snapshot_moved_under_another_step_is_refused(tmp_path: Path) -> None:
    """A committed, signed step 10 copied into step 30's directory (an old snapshot passed
    off as a newer one): its manifest names step 10, so the copy is refused, key or not."""
    train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=20)
    snaps = tmp_path / "snapshots"
    shutil.copytree(snaps / step_dir(10), snaps / step_dir(30))
    store = DurableStore(str(snaps))
    (moved,) = [c for c in store.candidates() if c.step == 30]
    assert moved.manifest is None and "not of its directory's step 30" in str(moved.problem)
    guard, _, _ = train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=25)
    assert events(tmp_path, "resume")[0]["details"]["snapshot_step"] == 20
    assert guard.global_step == 25


def test_dcp_metadata_naming_files_outside_the_part_is_refused(tmp_path: Path) -> None:
    """A .metadata (checksum made to match) whose entries point outside the part's
    directory: refused before DCP opens anything there."""
    from torch.distributed.checkpoint import FileSystemReader

    train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=10)
    snap = tmp_path / "snapshots" / step_dir(10)
    metadata = FileSystemReader(str(snap / "rank_0")).read_metadata()
    (info, *_) = metadata.storage_data.values()
    info.relative_path = "../../../outside.distcp"
    (snap / "rank_0" / ".metadata").write_bytes(pickle.dumps(metadata))
    _match_manifest(snap, "rank_0/.metadata")
    store = DurableStore(str(tmp_path / "snapshots"))
    assert "leaves the snapshot's directory" in str(store.check(store.candidates()[0]))


def test_a_nan_where_an_infinity_was_written_is_refused(tmp_path: Path) -> None:
    """A part may record tensors that legitimately held infinities (a causal mask): those
    may read back infinite, never NaN."""
    train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=10)
    snap = tmp_path / "snapshots" / step_dir(10)
    index = snap / "rank_0.json"
    doc = json.loads(index.read_text())
    name = next(p for p, (shape, dt) in doc["tensors"].items() if "float" in dt and shape)
    store = DurableStore(str(tmp_path / "snapshots"))
    tree = store.load_part(10, 0)  # intact
    assert tree
    doc["nonfinite"] = [name]  # as if it had held an infinity when written
    index.write_text(json.dumps(doc))
    _match_manifest(snap, "rank_0.json")
    assert store.check(store.candidates()[0]) is None  # finite is still fine
    reader = snap / "rank_0"
    from torch.distributed.checkpoint import FileSystemReader

    template = {p: torch.empty(s, dtype=getattr(torch, dt.split(".")[-1]))
                for p, (s, dt) in doc["tensors"].items()}  # fmt: skip
    import torch.distributed.checkpoint as dcp

    dcp.load(template, storage_reader=FileSystemReader(str(reader)), no_dist=True)
    template[name].view(-1)[0] = float("nan")
    shutil.rmtree(reader)
    dcp.save(template, storage_writer=dcp.FileSystemWriter(str(reader)), no_dist=True)
    for f in reader.iterdir():
        _match_manifest(snap, f"rank_0/{f.name}")
    said = str(store.check(store.candidates()[0]))
    assert f"tensor {name} of rank 0 holds NaN" in said


class _Evil:
    """A pickle that runs a command when loaded (what a tampered checkpoint carries)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _poison(path: Path, marker: Path) -> None:
    """Replace a DeepSpeed file with a torch.save of a payload that would run code."""
    torch.save({"optimizer_state_dict": _Evil(marker)}, path)


def _match_manifest(snap_dir: Path, rel: str) -> None:
    """Rewrite the manifest's size and sha256 of ``rel`` to the file's (a tamperer with
    write access to the storage does this; only a signature can tell)."""
    import hashlib

    manifest = snap_dir / MANIFEST
    doc = json.loads(manifest.read_text())
    data = (snap_dir / rel).read_bytes()
    doc["files"][rel].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest.write_text(json.dumps(doc))


def test_a_tampered_deepspeed_file_is_refused_without_running_it(tmp_path: Path) -> None:
    """A real ZeRO-2 run writes DeepSpeed's own files, signed. Its optimizer file of step 10
    is replaced by a pickle that would run a command: refused with the key (the signed
    manifest no longer matches, or its signature fails once the manifest is rewritten) and
    without it (weights_only refuses the payload; the message says corrupt, not tampered).
    The Guard's own resume falls back to step 5; the command never runs."""
    pytest.importorskip("deepspeed", reason="pip install -e '.[dev]' installs it")
    key_file = tmp_path / "key"
    key_file.write_text("k3y")
    d = tmp_path / "run"
    policy = {
        "snapshot": {"every_steps": 5},
        "persist": {"every_steps": 5, "keep": 3, "signing_key_file": str(key_file)},
    }
    r = train(d, 2, "--steps", "10", "--zero-stage", "2", policy=policy, script=DS_EXAMPLE)
    assert r.returncode == 0, r.stdout[-3000:]
    snap = d / "snapshots" / step_dir(10)
    optim = sorted(snap.glob("global_step10/*optim_states.pt"))[0]
    rel = str(optim.relative_to(snap))
    marker = tmp_path / "pwned"
    pristine = tmp_path / "pristine"
    shutil.copytree(d / "snapshots", pristine)

    signed = DurableStore(str(d / "snapshots"), key=b"k3y")
    unsigned = DurableStore(str(d / "snapshots"))
    _poison(optim, marker)  # the file only: the manifest still holds the real one's sha256
    said = str(signed.check(signed.candidates()[0]))
    assert "signed manifest" in said and said.endswith("tampered")
    said = str(unsigned.check(unsigned.candidates()[0]))
    assert "corrupt" in said and "tamper" not in said
    _match_manifest(snap, rel)  # and the manifest rewritten to match
    assert "signature: tampered" in str(signed.candidates()[0].problem)
    said = str(unsigned.check(unsigned.candidates()[0]))
    assert "refused without loading it" in said and "tamper" not in said
    assert "posix.system" in said  # the global it would have called, named
    assert not marker.exists()

    # The Guard resumes past it, unsigned (the key unset: the payload reaches load_native).
    (d / "snapshots").rename(tmp_path / "tampered")
    shutil.copytree(pristine, d / "snapshots")
    _poison(d / "snapshots" / step_dir(10) / rel, marker)
    _match_manifest(d / "snapshots" / step_dir(10), rel)
    plain = {"snapshot": {"every_steps": 5}, "persist": {"every_steps": 5, "keep": 3}}
    r = train(d, 2, "--steps", "12", "--zero-stage", "2", policy=plain, script=DS_EXAMPLE)
    assert r.returncode == 0, r.stdout[-3000:]
    (bad,) = kinds(d, "snapshot_invalid")
    assert bad["details"]["snapshot_step"] == 10
    assert any("refused without loading it" in why for why in bad["details"]["reasons"])
    assert kinds(d, "resume")[0]["details"]["snapshot_step"] == 5
    assert not marker.exists()


def test_dcp_metadata_that_would_run_code_is_refused_even_with_a_matching_checksum(
    tmp_path: Path,
) -> None:
    """DCP's own reader unpickles .metadata with plain pickle; ours allows DCP's metadata
    classes only. A payload whose checksum was made to match is still refused."""
    train_inproc(tmp_path, {"persist": {"every_steps": 10}}, steps=10)
    snap = tmp_path / "snapshots" / step_dir(10)
    marker = tmp_path / "pwned"
    (snap / "rank_0" / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    _match_manifest(snap, "rank_0/.metadata")
    store = DurableStore(str(tmp_path / "snapshots"))
    assert "refused without loading it" in str(store.check(store.candidates()[0]))
    assert not marker.exists()


def test_a_class_outside_the_allow_list_is_named_and_can_be_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine file holding a class nobody allowed (a new engine release's, say) is
    refused naming the class and the way to allow it; allowed by name, it loads."""
    import datetime
    import io

    from orchestrator.engines.native import load_native
    from orchestrator.errors import PersistError
    from orchestrator.protocol import ENV_ALLOW_GLOBALS

    data = io.BytesIO()
    torch.save({"kept": datetime.timedelta(days=1)}, data)
    with pytest.raises(PersistError, match=f"holds datetime.timedelta.*{ENV_ALLOW_GLOBALS}"):
        load_native(io.BytesIO(data.getvalue()), "optim.pt")
    monkeypatch.setenv(ENV_ALLOW_GLOBALS, "datetime.timedelta")
    assert load_native(io.BytesIO(data.getvalue()), "optim.pt") == {
        "kept": datetime.timedelta(days=1)
    }


def test_ledger_entries_a_storage_failure_held_back_are_written_at_the_next_start(
    tmp_path: Path,
) -> None:
    """The ledger cannot be written (its folder is a file): the quarantine holds in memory,
    the journal says so (persisted: false, ledger_failed), and the run ends with the entry
    unwritten. The next start, the storage fixed, writes it from the journal (no entry
    lost; ledger_written) and keeps skipping those samples."""
    from inproc import Regression

    from orchestrator.data import GuardBatchSampler
    from orchestrator.quarantine import Ledger

    bad = GuardBatchSampler(256, 8, rank=0, world_size=1, seed=1).batch_at(0, 25 * 8)[0]
    blocker = tmp_path / "ledger"
    blocker.write_text("a file where the ledger's folder should be")
    policy = {
        "detect": {"spike": {"enabled": True, "window": 16, "min_history": 8, "zscore": 8.0}},
        "quarantine": {"ledger_url": str(blocker / "quarantine.jsonl")},
    }
    run = tmp_path / "run"
    train_inproc(run, policy, steps=30, dataset=Regression(spike=bad[3]))
    (q,) = events(run, "quarantine")
    assert q["details"]["samples"] == [bad[3]] and q["details"]["persisted"] is False
    assert events(run, "ledger_failed") and not events(run, "ledger_written")
    blocker.unlink()
    blocker.mkdir()
    guard, _, _ = train_inproc(run, policy, steps=35, dataset=Regression(spike=bad[3]))
    (written,) = events(run, "ledger_written")
    assert written["details"]["samples"] == [bad[3]]
    assert Ledger(str(blocker / "quarantine.jsonl")).load() == {bad[3]}
    assert bad[3] in guard.cursor.quarantined and len(events(run, "incident")) == 1
    assert audit(str(run), ledger_url=str(blocker / "quarantine.jsonl")) == []
