"""The durable store: snapshots laid out, committed, validated and pruned under one fsspec
URL. It stores; what to persist and when, and what to resume from, is decided in
:mod:`orchestrator.durable`; the background thread that writes is :mod:`orchestrator.writer`.

Layout under ``persist.url`` (any fsspec URL)::

    step_000000050/
      rank_0/            DCP checkpoint (.metadata + *.distcp) of the tensors rank 0 writes
      rank_0.json        rank 0's part: the state's structure and plain values (JSON), the
                         shapes of its tensors, and size + sha256 of every file in rank_0/
      rank_1/ ...
      manifest.json      rank 0, once every rank's part is there: step, world size, files
      COMMITTED          rank 0, last. Nothing without it is ever restored.

Writes happen on a background thread per rank, with no collective: each rank writes its
own part; rank 0 waits for all parts before it writes the manifest and the marker. A crash
anywhere before the marker leaves a directory that listing and restore ignore.

What each rank writes: on replicated engines (single process, DDP) the model, optimizer,
scheduler, scaler and counters are identical on every rank, so rank 0 writes them once and
every rank writes only its own RNG state. Loading is then possible at any world size.

Loading trusts nothing: the manifest and marker must exist, every file's size and sha256
must match before any byte goes to a deserializer (DCP reads ``.metadata`` with pickle, so
the checksum check comes first), tensors are read by DCP with ``weights_only`` loads, plain
values are JSON, and every floating tensor must be finite.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed.checkpoint as dcp

from orchestrator.codec import decode, dtype_of, encode, tensors_of
from orchestrator.errors import PersistError
from orchestrator.protocol import SNAPSHOTS_DIR
from orchestrator.snapshot import Snapshot

# Each rank writes and reads its own part with DCP's no_dist mode on purpose; DCP warns
# about that on every call. Only that message, only from DCP.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    module="torch.distributed.checkpoint",
)

MANIFEST, MARKER = "manifest.json", "COMMITTED"


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


# --- the store ----------------------------------------------------------------------------
@dataclass
class Candidate:
    step: int
    committed: bool
    manifest: dict[str, Any] | None


class DurableStore:
    """The layout above, over one fsspec URL. Stateless; safe to use from several threads."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _fresh(self) -> None:
        # Object stores cache listings; other processes write here.
        self.fs.invalidate_cache()

    # writing ------------------------------------------------------------------------------
    def write_part(
        self,
        snap: Snapshot,
        rank: int,
        world_size: int,
        keys: list[str],
        nonce: str = "",
        native: dict[str, str] | None = None,
        texts: dict[str, str] | None = None,
    ) -> int:
        """Write this rank's part of ``snap`` (the top-level ``keys``); return bytes written.

        ``native`` keys go to the engine's own files at the given paths (an engine's own
        checkpoint layout) instead of DCP; ``texts`` are small files written as given.
        """
        from orchestrator.engines.native import save_native  # only engines with such files

        native = {k: v for k, v in (native or {}).items() if k in keys}
        tensors: dict[str, torch.Tensor] = {}
        skeleton: dict[str, Any] = {
            k: encode(snap.skeleton[k], k, tensors, snap.buffers) for k in keys if k not in native
        }
        d = step_dir(snap.step)
        part = self.path(d, f"rank_{rank}")
        self.fs.makedirs(part, exist_ok=True)
        if tensors:
            writer = dcp_writer(self.fs, part)
            dcp.save(dict(tensors), storage_writer=writer, no_dist=True)
        files: dict[str, dict[str, Any]] = {}
        for info in self.fs.ls(part, detail=True):
            name = info["name"].rsplit("/", 1)[-1]
            files[f"rank_{rank}/{name}"] = {
                "size": int(info["size"]),
                "sha256": self._sha(info["name"]),
            }
        for key, rel in native.items():
            path = self.path(d, rel)
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with self.fs.open(path, "wb") as f:
                save_native(snap.materialize(key, clone=False), f)
            skeleton[key] = {"__native__": rel}
            files[rel] = {"size": self.fs.size(path), "sha256": self._sha(path), "rank": rank}
        for rel, text in (texts or {}).items():
            path = self.path(d, rel)
            with self.fs.open(path, "w", encoding="utf-8") as f:
                f.write(text)
            files[rel] = {"size": self.fs.size(path), "sha256": self._sha(path), "rank": rank}
        doc = {
            "rank": rank,
            "nonce": nonce,
            "world_size": world_size,
            "step": snap.step,
            "keys": keys,
            "skeleton": skeleton,
            "tensors": {p: [list(t.shape), str(t.dtype)] for p, t in tensors.items()},
            "files": files,
        }
        self._write_json(self.path(d, f"rank_{rank}.json"), doc)
        return sum(int(f["size"]) for f in files.values())

    def commit(
        self,
        step: int,
        world_size: int,
        nonce: str,
        extra: dict[str, Any],
        timeout_s: float,
        ranks: list[int] | None = None,
    ) -> dict[str, Any]:
        """Wait for the part of every rank in ``ranks`` (default: all) of this attempt
        (``nonce``), then write the manifest and, last, the marker."""
        expected = list(range(world_size)) if ranks is None else ranks
        d = step_dir(step)
        deadline = time.monotonic() + timeout_s
        parts: dict[int, dict[str, Any]] = {}
        while len(parts) < len(expected):
            self._fresh()
            for r in expected:
                path = self.path(d, f"rank_{r}.json")
                if r not in parts and self.fs.exists(path):
                    doc = self._read_json_or_none(path)
                    if doc is not None and doc.get("nonce") == nonce:
                        parts[r] = doc
            if len(parts) < len(expected):
                if time.monotonic() > deadline:
                    missing = sorted(set(expected) - set(parts))
                    raise PersistError(
                        f"snapshot {step}: ranks {missing} did not write their part within "
                        f"persist.commit_timeout_s={timeout_s}; it stays uncommitted"
                    )
                time.sleep(0.05)
        files: dict[str, Any] = {}
        for r in sorted(parts):
            files.update(parts[r]["files"])
            files[f"rank_{r}.json"] = {
                "size": None,
                "sha256": self._sha(self.path(d, f"rank_{r}.json")),
            }
        manifest = {
            "step": step,
            "world_size": world_size,
            "ranks": sorted(parts),
            "time": time.time(),
            "bytes": sum(f["size"] or 0 for f in files.values()),
            "files": files,
            **extra,
        }
        self._write_json(self.path(d, MANIFEST), manifest)
        with self.fs.open(self.path(d, MARKER), "w") as f:
            f.write(str(step))
        return manifest

    def _write_json(self, path: str, doc: dict[str, Any]) -> None:
        with self.fs.open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)

    def _read_json_or_none(self, path: str) -> dict[str, Any] | None:
        try:  # another process may be writing it right now
            return self._read_json(path)
        except (OSError, ValueError):
            return None

    def _read_json(self, path: str) -> dict[str, Any]:
        with self.fs.open(path, "r", encoding="utf-8") as f:
            doc: dict[str, Any] = json.load(f)
        return doc

    def _sha(self, path: str) -> str:
        h = hashlib.sha256()
        with self.fs.open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        return h.hexdigest()

    # listing ------------------------------------------------------------------------------
    def candidates(self) -> list[Candidate]:
        """Every step directory, newest first, with its manifest if committed."""
        self._fresh()
        if not self.fs.exists(self.root):
            return []
        out = []
        for info in self.fs.ls(self.root, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if not name.startswith("step_"):
                continue
            try:
                step = int(name[len("step_") :])
            except ValueError:
                continue
            committed = self.fs.exists(self.path(name, MARKER))
            manifest = None
            if committed:
                try:
                    manifest = self._read_json(self.path(name, MANIFEST))
                except (OSError, ValueError):
                    manifest = None
            out.append(Candidate(step, committed, manifest))
        return sorted(out, key=lambda c: c.step, reverse=True)

    def committed_steps(self) -> list[int]:
        return [c.step for c in self.candidates() if c.committed]

    # reading ------------------------------------------------------------------------------
    def validate_files(self, step: int, manifest: dict[str, Any], ranks: list[int]) -> None:
        """Sizes and checksums of the files of ``ranks``' parts; raises PersistError."""
        d = step_dir(step)
        for rel, meta in manifest["files"].items():
            owner = (
                f"rank_{meta['rank']}"
                if "rank" in meta
                else rel.split("/", 1)[0].removesuffix(".json")
            )
            if owner not in {f"rank_{r}" for r in ranks}:
                continue
            path = self.path(d, rel)
            if not self.fs.exists(path):
                raise PersistError(f"snapshot {step}: {rel} is missing")
            size = self.fs.size(path)
            if meta["size"] is not None and size != meta["size"]:
                raise PersistError(
                    f"snapshot {step}: {rel} has {size} bytes, the manifest says "
                    f"{meta['size']} (truncated?)"
                )
            if self._sha(path) != meta["sha256"]:
                raise PersistError(
                    f"snapshot {step}: {rel} does not match its sha256 (corrupt or tampered)"
                )

    def load_part(self, step: int, rank: int) -> dict[str, Any]:
        """The state tree of one rank's part (only call after validate_files)."""
        d = step_dir(step)
        doc = self._read_json(self.path(d, f"rank_{rank}.json"))
        template = {
            p: torch.empty(shape, dtype=dtype_of(dt)) for p, (shape, dt) in doc["tensors"].items()
        }
        if template:
            dcp.load(
                template,
                storage_reader=dcp_reader(self.fs, self.path(d, f"rank_{rank}")),
                no_dist=True,
            )
        tree: dict[str, Any] = {}
        for key, enc in doc["skeleton"].items():
            if isinstance(enc, dict) and "__native__" in enc:
                # An engine's own format (its checksum was verified before this).
                from orchestrator.engines.native import load_native

                with self.fs.open(self.path(d, enc["__native__"]), "rb") as f:
                    tree[key] = load_native(f)
                tensors_of(tree[key], key, template)
            else:
                tree[key] = decode(enc, template)
        for path, t in template.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise PersistError(
                    f"snapshot {step}: tensor {path} of rank {rank} holds non-finite values"
                )
        return tree

    def uncommit_after(self, step: int) -> list[int]:
        """Withdraw every committed snapshot newer than ``step`` (a rolled-back timeline).

        Only the marker and manifest go: other ranks may already have written their parts
        of the *new* timeline's snapshot of such a step into the same directory (their
        nonce tells them apart); leftovers are pruned once a newer step is committed."""
        gone = [c.step for c in self.candidates() if c.step > step and c.committed]
        for s in gone:
            self.fs.rm(self.path(step_dir(s), MARKER))
            manifest = self.path(step_dir(s), MANIFEST)
            if self.fs.exists(manifest):
                self.fs.rm(manifest)
        return gone

    def _delete(self, step: int) -> None:
        # The marker goes first: a half-deleted snapshot must never look committed.
        marker = self.path(step_dir(step), MARKER)
        if self.fs.exists(marker):
            self.fs.rm(marker)
        self.fs.rm(self.path(step_dir(step)), recursive=True)

    def check(self, cand: Candidate) -> str | None:
        """Full validation of one snapshot, every rank's part: None if valid, else why not."""
        if not cand.committed:
            return "not committed (being written, or its writer died mid-write)"
        if cand.manifest is None:
            return "manifest.json missing or unreadable"
        ranks = cand.manifest.get("ranks") or list(range(int(cand.manifest["world_size"])))
        try:
            self.validate_files(cand.step, cand.manifest, ranks)
            for r in ranks:
                self.load_part(cand.step, r)
        except (PersistError, OSError, ValueError, KeyError, RuntimeError) as err:
            return str(err)
        return None

    # retention ----------------------------------------------------------------------------
    def prune(self, keep: int, keep_every_steps: int | None) -> list[int]:
        """Delete committed snapshots beyond the newest ``keep`` (except multiples of
        ``keep_every_steps``) and uncommitted leftovers older than the newest committed."""
        cands = self.candidates()
        committed = [c.step for c in cands if c.committed]
        if not committed:
            return []
        keep_set = set(committed[: max(keep, 1)])  # never the newest committed
        if keep_every_steps:
            keep_set |= {s for s in committed if s % keep_every_steps == 0}
        doomed = [
            c.step
            for c in cands
            if c.step not in keep_set and (c.committed or c.step < committed[0])
        ]
        for s in doomed:
            self._delete(s)
        return doomed


def dcp_writer(fs: Any, path: str) -> dcp.StorageWriter:
    if _is_local(fs):
        return dcp.FileSystemWriter(path, sync_files=True)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(fs.unstrip_protocol(path), sync_files=False)


def dcp_reader(fs: Any, path: str) -> dcp.StorageReader:
    if _is_local(fs):
        return dcp.FileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(fs.unstrip_protocol(path))


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def default_url(run_dir: str) -> str:
    return os.path.join(run_dir, SNAPSHOTS_DIR)
