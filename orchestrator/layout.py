"""The durable store's layout, without torch: where a snapshot's files lie under one
fsspec URL, its manifest and commit marker, and everything that lists, validates (shape,
signature, sizes and sha256 of every file), withdraws and prunes snapshots by those files
alone. :mod:`orchestrator.store` adds what needs torch (writing a part with DCP, loading and
checking its tensors); ``orchestrator status`` lists committed snapshots through this
module alone, so it runs where torch does not import. The layout itself is described in
:mod:`orchestrator.store`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec

from orchestrator.errors import PersistError
from orchestrator.manifest import MANIFEST, MARKER, manifest_problem, sign, step_dir
from orchestrator.protocol import ENV_SIGNING_KEY, SNAPSHOTS_DIR

logger = logging.getLogger(__name__)


@dataclass
class Candidate:
    step: int
    committed: bool
    manifest: dict[str, Any] | None
    problem: str | None = None  # why the manifest cannot be used (None: readable, well formed)


class SnapshotLayout:
    """The layout over one fsspec URL, without torch: listing, validating files, withdrawing
    and pruning. Stateless (``key`` and ``hook`` are fixed at construction); safe to use
    from several threads. :class:`orchestrator.store.DurableStore` adds writing and
    loading."""

    def __init__(
        self,
        url: str,
        key: bytes | None = None,
        hook: Callable[[str, int], None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.key = key
        self._hook = hook

    def _phase(self, phase: str, step: int) -> None:
        if self._hook is not None:
            self._hook(phase, step)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _fresh(self) -> None:
        # Object stores cache listings; other processes write here.
        self.fs.invalidate_cache()

    def remove_part(self, step: int, rank: int) -> None:
        """Best effort: this rank's files of an uncommitted snapshot whose write failed (a
        full disk must not fill up further with parts nobody will commit)."""
        d = step_dir(step)
        try:
            self._fresh()  # an object store's cached listing may predate the commit
            if self.fs.exists(self.path(d, MARKER)):
                return  # committed after all: never touch it
            for path in (self.path(d, f"rank_{rank}.json"), self.path(d, f"rank_{rank}")):
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)
            if _is_local(self.fs) and not os.listdir(self.path(d)):
                os.rmdir(self.path(d))  # the last rank out (another may just be writing: fine)
        except Exception as err:  # the store may be the very thing failing; retention cleans up
            logger.debug("removing rank %d's part of step %d failed: %r", rank, step, err)

    def free_bytes(self) -> int | None:
        """Free space where a local store writes (None for remote stores)."""
        if not _is_local(self.fs):
            return None
        path = self.root
        while path and not os.path.exists(path):
            path = os.path.dirname(path)
        try:
            return shutil.disk_usage(path or "/").free
        except OSError:
            return None

    def _write_json(self, path: str, doc: dict[str, Any]) -> None:
        with self.fs.open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)

    def _read_json_or_none(self, path: str) -> tuple[dict[str, Any], str] | None:
        """The JSON object at ``path`` and the sha256 of the bytes it was parsed from, or
        None if it cannot be read or parsed (another process may be writing it)."""
        try:
            with self.fs.open(path, "rb") as f:
                data = f.read()
            doc = json.loads(data)
        except (OSError, ValueError):
            return None
        if not isinstance(doc, dict):
            return None
        return doc, hashlib.sha256(data).hexdigest()

    def _stored_part(self, d: str, rank: int, nonce: str) -> dict[str, Any] | None:
        """This rank's index in ``d`` if an earlier attempt of this write (``nonce``) stored
        it, else None. Only a missing or torn index is None: any other error is raised (a
        retry that could not look must not rewrite what rank 0 may have committed)."""
        if not nonce:
            return None  # no attempt to tell apart: always written afresh
        self._fresh()
        try:
            with self.fs.open(self.path(d, f"rank_{rank}.json"), "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return None
        except ValueError:  # torn by a writer that died mid-file: nobody can have used it
            return None
        if (
            isinstance(doc, dict)
            and doc.get("nonce") == nonce
            and isinstance(doc.get("files"), dict)
        ):
            return doc
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
            manifest, problem = None, None
            if committed:
                try:
                    doc = self._read_json(self.path(name, MANIFEST))
                    problem = self._manifest_problem(doc, step)
                    manifest = None if problem else doc
                except FileNotFoundError:
                    problem = "manifest.json is missing"
                except (UnicodeDecodeError, ValueError) as err:
                    problem = f"manifest.json is not valid JSON (corrupt or truncated: {err})"
                except Exception as err:  # e.g. a manifest nested deep enough to recurse out
                    problem = f"manifest.json cannot be read ({type(err).__name__}: {err})"
                if problem is not None:
                    problem = f"snapshot {step}: {problem}"
            out.append(Candidate(step, committed, manifest, problem))
        return sorted(out, key=lambda c: c.step, reverse=True)

    def _manifest_problem(self, doc: Any, step: int) -> str | None:
        """Why the manifest ``doc`` found in ``step``'s directory cannot be trusted (None if
        it can): its shape, its step, its signature."""
        shape = manifest_problem(doc)
        if shape:
            return f"manifest.json is malformed ({shape})"
        if doc["step"] != step:  # a snapshot copied or moved under another step's name
            return f"manifest.json is of step {doc['step']}, not of its directory's step {step}"
        if self.key is None:
            return None  # nothing to check it against: corruption is all a checksum tells
        sig = doc.get("signature")
        if not isinstance(sig, dict) or not isinstance(sig.get("mac"), str):
            return (
                "manifest.json is not signed, but a signing key is set: refused (tampered, "
                "or written before the key was set; to read such snapshots unset "
                f"${ENV_SIGNING_KEY} and persist.signing_key_file)"
            )
        # Bytes: compare_digest refuses non-ASCII str, and a tampered mac may hold any text.
        if not hmac.compare_digest(sig["mac"].encode(), sign(doc, self.key).encode()):
            return (
                "manifest.json does not match its signature: tampered, or signed with "
                f"another key (${ENV_SIGNING_KEY} wins over persist.signing_key_file: check "
                "that both hold the key the run was written with)"
            )
        return None

    def committed_steps(self) -> list[int]:
        return [c.step for c in self.candidates() if c.committed]

    def check_files(self, cand: Candidate) -> str | None:
        """Validation of one snapshot as far as it goes without torch (committed, its
        manifest's shape and signature, the size and sha256 of every rank's files): None
        if it passes, else why not. :meth:`orchestrator.store.DurableStore.check` goes on
        to load every part."""
        if not cand.committed:
            return "not committed (being written, or its writer died mid-write)"
        if cand.manifest is None:
            return cand.problem or "manifest.json missing or unreadable"
        try:
            self.validate_files(cand.step, cand.manifest, self.ranks_of(cand.manifest))
        except Exception as err:  # whatever a damaged file or store makes a reader raise
            return str(err)
        return None

    @staticmethod
    def ranks_of(manifest: dict[str, Any]) -> list[int]:
        """The ranks whose parts a manifest holds."""
        return manifest.get("ranks") or list(range(int(manifest["world_size"])))

    # reading ------------------------------------------------------------------------------
    def validate_files(self, step: int, manifest: dict[str, Any], ranks: list[int]) -> None:
        """Sizes and checksums of the files of ``ranks``' parts; raises PersistError."""
        d = step_dir(step)
        problem = self._manifest_problem(manifest, step)
        if problem is not None:
            raise PersistError(f"snapshot {step}: {problem}")
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
            # With a key the manifest is authentic, so a file that differs was changed.
            manifest_, verdict = (
                ("the signed manifest", "tampered") if self.key else ("the manifest", "corrupt")
            )
            size = self.fs.size(path)
            if meta["size"] is not None and size != meta["size"]:
                raise PersistError(
                    f"snapshot {step}: {rel} has {size} bytes, {manifest_} says "
                    f"{meta['size']}: {verdict}" + ("" if self.key else " (truncated?)")
                )
            if self._sha(path) != meta["sha256"]:
                raise PersistError(
                    f"snapshot {step}: {rel} does not match its sha256 in {manifest_}: {verdict}"
                )

    def committed_after(self, step: int) -> list[int]:
        """The committed snapshots newer than ``step`` (what :meth:`uncommit` withdraws)."""
        return [c.step for c in self.candidates() if c.step > step and c.committed]

    def uncommit(self, steps: list[int]) -> None:
        """Withdraw committed snapshots (a rolled-back timeline's).

        Only the marker and manifest go: other ranks may already have written their parts
        of the *new* timeline's snapshot of such a step into the same directory (their
        nonce tells them apart); leftovers are pruned once a newer step is committed."""
        for s in steps:
            marker = self.path(step_dir(s), MARKER)
            if self.fs.exists(marker):
                self.fs.rm(marker)
            manifest = self.path(step_dir(s), MANIFEST)
            if self.fs.exists(manifest):
                self.fs.rm(manifest)

    def _delete(self, step: int, during: int) -> None:
        # The marker goes first: a half-deleted snapshot must never look committed.
        marker = self.path(step_dir(step), MARKER)
        if self.fs.exists(marker):
            self.fs.rm(marker)
        self._phase("prune", during)
        if self.fs.exists(self.path(step_dir(step))):
            self.fs.rm(self.path(step_dir(step)), recursive=True)

    # retention ----------------------------------------------------------------------------
    def retired(self, keep: int, keep_every_steps: int | None) -> list[int]:
        """What retention deletes: committed snapshots beyond the newest ``keep`` (except
        multiples of ``keep_every_steps``) and uncommitted leftovers older than the newest
        committed."""
        cands = self.candidates()
        committed = [c.step for c in cands if c.committed]
        if not committed:
            return []
        keep_set = set(committed[: max(keep, 1)])  # never the newest committed
        if keep_every_steps:
            keep_set |= {s for s in committed if s % keep_every_steps == 0}
        return [
            c.step
            for c in cands
            if c.step not in keep_set and (c.committed or c.step < committed[0])
        ]

    def delete(self, steps: list[int], during: int = -1) -> None:
        """Delete snapshots (retention, after the write of step ``during``)."""
        for s in steps:
            self._delete(s, during)

    def prune(self, keep: int, keep_every_steps: int | None) -> list[int]:
        """Delete what :meth:`retired` names; returns it."""
        doomed = self.retired(keep, keep_every_steps)
        self.delete(doomed)
        return doomed


def _is_local(fs: Any) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def default_url(run_dir: str) -> str:
    return os.path.join(run_dir, SNAPSHOTS_DIR)
