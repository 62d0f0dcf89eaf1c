"""DCP's reader and writer for one rank's part of a durable snapshot, adapted for the
store (:mod:`orchestrator.store`): the writer records a given save id, so that a part saved
twice comes out the same bytes; the reader unpickles ``.metadata`` with an allow-list of
DCP's own classes and keeps the files it names inside the part's directory."""

from __future__ import annotations

import pickle
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp

from orchestrator.layout import _is_local
from orchestrator.manifest import safe_rel

# What a DCP ``.metadata`` pickle may build: DCP's own metadata classes, torch.Size, dtypes,
# layouts and paths. Anything else (a function to call, a class to build) is refused.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED_METADATA = {
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = (module, name) in _ALLOWED_METADATA or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(
                f"DCP metadata refers to {module}.{name}, which a checkpoint's metadata never "
                "holds: refused without loading it (it could run code)"
            )
        return super().find_class(module, name)


def read_dcp_metadata(f: IO[bytes]) -> Any:
    """A DCP ``.metadata`` file, unpickled with the allow-list above."""
    return _MetadataUnpickler(f).load()


class _FixedSaveId:
    """A DCP writer whose ``.metadata`` carries the save id it is given (None: DCP's own,
    a fresh uuid per save), so that saving the same tensors again gives the same bytes."""

    fixed_save_id: str | None = None

    def storage_meta(self) -> Any:
        meta = super().storage_meta()  # type: ignore[misc]
        if meta is not None and self.fixed_save_id is not None:
            meta.save_id = self.fixed_save_id
        return meta


class _FixedFileSystemWriter(_FixedSaveId, dcp.FileSystemWriter):
    pass


def dcp_writer(fs: Any, path: str, save_id: str | None = None) -> dcp.StorageWriter:
    """DCP's writer for ``path`` on ``fs``; ``save_id``: what its ``.metadata`` records as
    the save's id (None: a fresh one, DCP's default)."""
    writer: _FixedSaveId
    if _is_local(fs):
        writer = _FixedFileSystemWriter(path, sync_files=True)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        class _FixedFsspecWriter(_FixedSaveId, FsspecWriter):
            pass

        writer = _FixedFsspecWriter(fs.unstrip_protocol(path), sync_files=False)
    writer.fixed_save_id = save_id
    assert isinstance(writer, dcp.StorageWriter)
    return writer


class _SafeMetadata:
    """A DCP reader whose ``.metadata`` is unpickled with the allow-list (DCP's own
    ``read_metadata`` is a plain ``pickle.load``)."""

    fs: Any
    path: Any
    load_id: Any

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        get_path = getattr(self, "_get_metadata_path", None)
        path = (
            get_path(kwargs.get("rank"))
            if get_path
            else self.fs.concat_path(self.path, ".metadata")
        )
        with self.fs.create_stream(path, "rb") as f:
            metadata = read_dcp_metadata(f)
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            # DCP opens what the metadata names: it must not leave the part's directory.
            safe_rel(getattr(info, "relative_path", None), f"{path}")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafeFileSystemReader(_SafeMetadata, dcp.FileSystemReader):
    pass


def dcp_reader(fs: Any, path: str) -> dcp.StorageReader:
    if _is_local(fs):
        return _SafeFileSystemReader(path)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    class _SafeFsspecReader(_SafeMetadata, FsspecReader):
        pass

    return _SafeFsspecReader(fs.unstrip_protocol(path))
