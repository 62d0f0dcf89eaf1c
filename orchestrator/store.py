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
anywhere before the marker leaves a directory that listing and restore ignore. A retried
write must not change bytes whose hashes rank 0 may already have committed (the first try
may have taken effect, its answer lost): a part whose index of this nonce is stored is kept,
and one written twice comes out the same (DCP's save id is the nonce's).

What each rank writes: on replicated engines (single process, DDP) the model, optimizer,
scheduler, scaler and counters are identical on every rank, so rank 0 writes them once and
every rank writes only its own RNG state. Loading is then possible at any world size.

Loading trusts nothing: the manifest and marker must exist, the manifest must have the
expected shape, every path in it must stay inside the snapshot's directory, every file's
size and sha256 must match before any byte goes to a deserializer, DCP's ``.metadata`` is
unpickled with an allow-list of DCP's own classes, tensors are read by DCP with
``weights_only`` loads, an engine's own files with ``weights_only`` and a few allowed
classes (:mod:`orchestrator.engines.native`), plain values are JSON, and every floating
tensor that was finite when written must be finite.

A checksum tells corruption, not tampering: whoever can rewrite a file can rewrite the
manifest too. With a signing key (``persist.signing_key_file`` or
``$ORCHESTRATOR_SIGNING_KEY``) the manifest carries an HMAC-SHA256 of itself; a snapshot
whose manifest does not verify, or whose files do not match the signed manifest, is refused
as tampered. Without a key the messages say "corrupt", and no more.

``hook(phase, step)``, when given, is called at each phase of a write (``part``: this
rank's tensors written, its index not yet; ``parts``: every part there, no manifest yet;
``manifest``: manifest written, no marker yet; ``prune``: a retired snapshot's marker gone,
its files not yet): the fault drills kill a rank there.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from orchestrator.codec import decode, dtype_of, encode, tensors_of

# DCP's adapted reader and writer are the store's names too, as before they moved.
from orchestrator.dcp_io import dcp_reader, dcp_writer, read_dcp_metadata  # noqa: F401
from orchestrator.errors import PersistError

# The layout's and the manifest's names are the store's too, as before the split.
from orchestrator.layout import Candidate, SnapshotLayout, _is_local, default_url  # noqa: F401
from orchestrator.manifest import (  # noqa: F401
    MANIFEST,
    MARKER,
    manifest_problem,
    safe_rel,
    sign,
    signing_key,
    step_dir,
)
from orchestrator.snapshot import Snapshot

# What reading or writing a snapshot may raise: DCP's CheckpointException (every rank's
# error, wrapped) is a BaseException; KeyboardInterrupt and SystemExit are not caught.
SNAPSHOT_ERRORS = (Exception, CheckpointException)

# Each rank writes and reads its own part with DCP's no_dist mode on purpose; DCP warns
# about that on every call. Only that message, only from DCP.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    module="torch.distributed.checkpoint",
)


class DurableStore(SnapshotLayout):
    """The layout of :class:`orchestrator.layout.SnapshotLayout` with what needs torch:
    writing a part (DCP), committing, loading a part and checking a snapshot whole."""

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
        d = step_dir(snap.step)
        done = self._stored_part(d, rank, nonce)
        if done is not None:
            # A retry whose earlier attempt stored everything, its index last, and only lost
            # the answer (the endpoint died between): rank 0 may already have committed the
            # hashes in that index, so nothing under them may be written again.
            return sum(int(f["size"]) for f in done["files"].values())
        native = {k: v for k, v in (native or {}).items() if k in keys}
        tensors: dict[str, torch.Tensor] = {}
        skeleton: dict[str, Any] = {
            k: encode(snap.skeleton[k], k, tensors, snap.buffers) for k in keys if k not in native
        }
        files = self._write_tensors(d, rank, nonce, tensors, snap.step)
        self._write_native(d, rank, snap, native, skeleton, files)
        self._write_texts(d, rank, texts or {}, files)
        doc = {
            "rank": rank,
            "nonce": nonce,
            "world_size": world_size,
            "step": snap.step,
            "keys": keys,
            "skeleton": skeleton,
            "tensors": {p: [list(t.shape), str(t.dtype)] for p, t in tensors.items()},
            "nonfinite": _nonfinite(tensors),
            "files": files,
        }
        self._write_json(self.path(d, f"rank_{rank}.json"), doc)
        return sum(int(f["size"]) for f in files.values())

    def _write_tensors(
        self, d: str, rank: int, nonce: str, tensors: dict[str, torch.Tensor], step: int
    ) -> dict[str, dict[str, Any]]:
        """Save this rank's ``tensors`` with DCP under ``rank_<rank>/`` of ``d`` (the
        ``part`` phase once saved); return size + sha256 of every file there."""
        part = self.path(d, f"rank_{rank}")
        self.fs.makedirs(part, exist_ok=True)
        if tensors:
            # The save id DCP writes into .metadata is the nonce's, not a fresh one: a part
            # written twice for one nonce (a retry racing a request that landed late) must
            # be the same bytes, whichever copy of its index rank 0 read.
            writer = dcp_writer(self.fs, part, f"{nonce}/rank_{rank}" if nonce else None)
            dcp.save(dict(tensors), storage_writer=writer, no_dist=True)
        self._phase("part", step)
        files: dict[str, dict[str, Any]] = {}
        for info in self.fs.ls(part, detail=True):
            name = info["name"].rsplit("/", 1)[-1]
            files[f"rank_{rank}/{name}"] = {
                "size": int(info["size"]),
                "sha256": self._sha(info["name"]),
            }
        return files

    def _write_native(
        self,
        d: str,
        rank: int,
        snap: Snapshot,
        native: dict[str, str],
        skeleton: dict[str, Any],
        files: dict[str, dict[str, Any]],
    ) -> None:
        """Write the ``native`` keys to the engine's own files (key -> path under ``d``),
        pointing their ``skeleton`` entries at them and adding them to ``files``."""
        from orchestrator.engines.native import save_native  # only engines with such files

        for key, rel in native.items():
            path = self.path(d, rel)
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with self.fs.open(path, "wb") as f:
                save_native(snap.host(key), f)  # host tensors: no device copy to write
            skeleton[key] = {"__native__": rel}
            files[rel] = {"size": self.fs.size(path), "sha256": self._sha(path), "rank": rank}

    def _write_texts(
        self, d: str, rank: int, texts: dict[str, str], files: dict[str, dict[str, Any]]
    ) -> None:
        """Write the small text files ``texts`` (path under ``d`` -> text) as given, adding
        them to ``files``."""
        for rel, text in texts.items():
            path = self.path(d, rel)
            with self.fs.open(path, "w", encoding="utf-8") as f:
                f.write(text)
            files[rel] = {"size": self.fs.size(path), "sha256": self._sha(path), "rank": rank}

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
        parts: dict[int, tuple[dict[str, Any], str]] = {}  # rank -> (its index, its sha256)
        while len(parts) < len(expected):
            self._fresh()
            there = self._names(d)  # one listing a round, not a look per part (docs/scale.md)
            for r in expected:
                path = self.path(d, f"rank_{r}.json")
                if r not in parts and f"rank_{r}.json" in there:
                    found = self._read_json_or_none(path)
                    if found is not None and found[0].get("nonce") == nonce:
                        parts[r] = found
            if len(parts) < len(expected):
                if time.monotonic() > deadline:
                    missing = sorted(set(expected) - set(parts))
                    raise PersistError(
                        f"snapshot {step}: ranks {missing} did not write their part within "
                        f"persist.commit_timeout_s={timeout_s}; it stays uncommitted"
                    )
                time.sleep(0.05)
        files: dict[str, Any] = {}
        for r, (doc, sha) in sorted(parts.items()):
            # The index's hash is taken from the bytes its file list was parsed from: a
            # second read could get another copy than the one whose list is recorded.
            files.update(doc["files"])
            files[f"rank_{r}.json"] = {"size": None, "sha256": sha}
        self._phase("parts", step)
        manifest = {
            "step": step,
            "world_size": world_size,
            "ranks": sorted(parts),
            "time": time.time(),
            "bytes": sum(f["size"] or 0 for f in files.values()),
            "files": files,
            **extra,
        }
        if self.key is not None:
            manifest["signature"] = {"alg": "hmac-sha256", "mac": sign(manifest, self.key)}
        self._write_json(self.path(d, MANIFEST), manifest)
        self._phase("manifest", step)
        with self.fs.open(self.path(d, MARKER), "w") as f:
            f.write(str(step))
        return manifest

    def _names(self, d: str) -> set[str]:
        """The names in the step folder ``d`` (none before the first part makes it): one
        listing, 2 x ranks / 1,000 LIST pages on S3, where asking for each part took a
        HEAD, and a LIST more for each part not there yet, every round."""
        try:
            listed = self.fs.ls(self.path(d), detail=False)
        except FileNotFoundError:
            return set()
        return {str(p).rstrip("/").rsplit("/", 1)[-1] for p in listed}

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

                rel = safe_rel(enc["__native__"], f"snapshot {step}, rank_{rank}.json")
                with self.fs.open(self.path(d, rel), "rb") as f:
                    tree[key] = load_native(f, f"snapshot {step}: {rel}")
                tensors_of(tree[key], key, template)
            else:
                tree[key] = decode(enc, template)
        allowed = set(doc.get("nonfinite", []))  # parts written before the list: none
        for path, t in template.items():
            if not t.is_floating_point() or bool(torch.isfinite(t).all()):
                continue
            if path not in allowed or bool(torch.isnan(t).any()):
                raise PersistError(
                    f"snapshot {step}: tensor {path} of rank {rank} holds "
                    + ("NaN" if bool(torch.isnan(t).any()) else "infinite values")
                    + " that it did not hold when written: corrupt"
                )
        return tree

    def check(self, cand: Candidate) -> str | None:
        """Full validation of one snapshot, every rank's part: None if valid, else why not."""
        why = self.check_files(cand)
        if why is not None or cand.manifest is None:
            return why
        try:
            for r in self.ranks_of(cand.manifest):
                self.load_part(cand.step, r)
        except SNAPSHOT_ERRORS as err:  # whatever a damaged snapshot makes a reader raise
            return str(err)
        return None


def _nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The paths of the floating ``tensors`` that hold infinities and no NaN, sorted. A part's
    index records them: a causal mask's -inf is legitimate, so those may read back infinite,
    never NaN; everything else must read back finite."""
    return sorted(
        p
        for p, t in tensors.items()
        if t.is_floating_point()
        and not bool(torch.isfinite(t).all())
        and not bool(torch.isnan(t).any())
    )
