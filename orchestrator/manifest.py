"""A durable snapshot's manifest and marker, without torch: their names, the shape a
manifest must have, the paths in it (they must stay inside the snapshot's directory), and
its signature (HMAC-SHA256 with the signing key). :mod:`orchestrator.layout` lists and
validates snapshots with them; :mod:`orchestrator.store` writes them."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import posixpath
from typing import Any

from orchestrator.errors import PersistError
from orchestrator.protocol import ENV_SIGNING_KEY

MANIFEST, MARKER = "manifest.json", "COMMITTED"


def step_dir(step: int) -> str:
    return f"step_{step:09d}"


def signing_key(key_file: str | None) -> bytes | None:
    """The manifest signing key: ``$ORCHESTRATOR_SIGNING_KEY``, else the contents of
    ``key_file`` (persist.signing_key_file), else None.

    Raises:
        PersistError: ``key_file`` cannot be read, or is empty.
    """
    env = os.environ.get(ENV_SIGNING_KEY, "").strip()  # as the file's: no trailing newline
    if env:
        return env.encode()
    if key_file is None:
        return None
    try:
        with open(key_file, "rb") as f:
            key = f.read().strip()
    except OSError as err:
        raise PersistError(
            f"persist.signing_key_file: cannot read {key_file} ({err.strerror}); fix the "
            f"path or its permissions, or set ${ENV_SIGNING_KEY}"
        ) from err
    if not key:
        raise PersistError(f"persist.signing_key_file: {key_file} is empty")
    return key


def safe_rel(rel: Any, where: str) -> str:
    """``rel`` if it is a relative path that stays inside the snapshot's directory.

    Raises:
        PersistError: absolute, escaping (``..``), not normalized, or not a string.
    """
    if (
        not isinstance(rel, str)
        or not rel
        or "\\" in rel
        or "\0" in rel
        or rel.startswith("/")
        or posixpath.normpath(rel) != rel
        or rel == ".."
        or rel.startswith("../")
    ):
        raise PersistError(f"{where}: the path {rel!r} leaves the snapshot's directory")
    return rel


def manifest_problem(doc: Any) -> str | None:
    """Why ``doc`` is not a manifest of ours (None if it is): a manifest that parses as
    JSON but has another shape must be refused, not crash the reader."""
    if not isinstance(doc, dict):
        return "not a JSON object"
    for key in ("step", "world_size"):
        if type(doc.get(key)) is not int or doc[key] < 0:
            return f"{key!r} is missing or not a non-negative integer"
    files, ranks = doc.get("files"), doc.get("ranks")
    if not isinstance(files, dict):
        return "'files' is missing or not an object"
    for rel, meta in files.items():
        try:
            safe_rel(rel, "manifest.json")
        except PersistError as err:
            return str(err)
        if not (
            isinstance(meta, dict)
            and isinstance(meta.get("sha256"), str)
            and (meta.get("size") is None or type(meta.get("size")) is int)
            and ("rank" not in meta or type(meta["rank"]) is int)
        ):
            return f"the entry of {rel!r} is malformed"
    if ranks is not None and not (
        isinstance(ranks, list)
        and all(type(r) is int and 0 <= r < doc["world_size"] for r in ranks)
    ):
        return "'ranks' is not a list of ranks below world_size"
    return None


def _canonical(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(manifest: dict[str, Any], key: bytes) -> str:
    return hmac.new(key, _canonical(manifest), hashlib.sha256).hexdigest()


# What a DCP ``.metadata`` pickle may build: DCP's own metadata classes, torch.Size, dtypes,
# --- the store ----------------------------------------------------------------------------
