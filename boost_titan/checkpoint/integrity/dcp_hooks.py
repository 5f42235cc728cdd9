"""Checksums inside DCP: the ``boost_titan.xxh3`` stream extension on every item, the
``.metadata`` sidecar written before ``.metadata`` is renamed in and checked before it
is unpickled, and :func:`install`, which puts both into this process's DCP."""

from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from io import UnsupportedOperation
from pathlib import Path
from typing import IO, Any, cast

from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.metadata import Metadata

from boost_titan.checkpoint import safe_metadata
from boost_titan.checkpoint.integrity.trailer import (
    _NOT_LOADED,
    ALGORITHM,
    DESCRIPTOR,
    NAME,
    SIDECAR_SUFFIX,
    ChecksumMismatch,
    _describe,
    _digest,
    _HashingWriter,
    _Item,
    _reading,
    _VerifyingReader,
)

logger = logging.getLogger()  # torchtitan's logger (the root logger), as boost_titan.train.fault


class Xxh3Trailer(StreamTransformExtension):
    """DCP stream extension ``boost_titan.xxh3/1``: an xxh3_64 trailer per item."""

    @staticmethod
    def registry_name() -> str:
        return NAME

    @staticmethod
    def from_descriptor(version: str) -> Xxh3Trailer:
        if version != "1":
            raise ValueError(
                f"checkpoint item checksum {NAME}/{version} is not one this boost_titan "
                f"reads ({DESCRIPTOR}): written by a newer version"
            )
        return Xxh3Trailer()

    def get_descriptor(self) -> str:
        return DESCRIPTOR

    def __reduce__(self):
        # DCP's process-based async save pickles the writer into a fresh process:
        # the trailer brings the sidecar with it there (install_saving)
        return (_trailer_in_this_process, ())

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], _HashingWriter(output))

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], _VerifyingReader(input))


def _trailer_in_this_process() -> Xxh3Trailer:
    install_saving()
    return Xxh3Trailer()


# ---------------------------------------------------------------- DCP hooks

_torch_writer_init = filesystem._FileSystemWriter.__init__
_torch_finish = filesystem._FileSystemWriter.finish
_torch_registry_init = ExtensionRegistry.__init__
_torch_transform_load_stream = filesystem._StorageReaderTransforms.transform_load_stream
_WRITER_SIGNATURE = inspect.signature(_torch_writer_init)


def _writer_init(self, *args: Any, **kwargs: Any) -> None:
    """``_FileSystemWriter.__init__`` with ``_extensions`` defaulting to the trailer for
    torch.save items (not safetensors: torchtitan's HF writer writes raw tensor bytes
    that other tools read, where a trailer would not belong)."""
    bound = _WRITER_SIGNATURE.bind(self, *args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    if (
        arguments["_extensions"] is None
        and arguments["serialization_format"] == filesystem.SerializationFormat.TORCH_SAVE
    ):
        arguments["_extensions"] = (Xxh3Trailer(),)
    _torch_writer_init(*bound.args, **bound.kwargs)


def _writes_checksums(writer) -> bool:
    transforms = getattr(writer, "transforms", None)
    return any(isinstance(e, Xxh3Trailer) for e in getattr(transforms, "extensions", ()))


def _sync(stream, sync_files: bool) -> None:
    if sync_files:
        try:
            os.fsync(stream.fileno())
        except (AttributeError, UnsupportedOperation):
            os.sync()


def finish(self, metadata: Metadata, results) -> None:
    """``_FileSystemWriter.finish`` of torch 2.13, line for line, plus the sidecar: the
    metadata is pickled once, its digest written to ``<name>.xxh3`` (tmp + rename)
    before ``<name>`` is renamed into place, so a complete checkpoint always has both."""
    if not _writes_checksums(self):
        return _torch_finish(self, metadata, results)
    metadata.version = filesystem.CURRENT_DCP_VERSION
    storage_md = {}
    for wr_list in results:
        storage_md.update({wr.index: wr.storage_data for wr in wr_list})
    metadata.storage_data = storage_md
    metadata.storage_meta = self.storage_meta()
    data = pickle.dumps(metadata)

    per_rank = not self.use_collectives and self.rank is not None
    name = f"__{self.rank}{filesystem._metadata_fn}" if per_rank else filesystem._metadata_fn
    metadata_path = self._get_metadata_path(self.rank if per_rank else None)
    record = json.dumps({"algorithm": ALGORITHM, "digest": _digest(data).hex(), "bytes": len(data)})
    for final, payload in (
        (self.fs.concat_path(self.path, name + SIDECAR_SUFFIX), record.encode()),
        (metadata_path, data),  # last: its presence marks the checkpoint complete
    ):
        tmp = self.fs.concat_path(self.path, f"{Path(os.fspath(final)).name}.tmp")
        with self.fs.create_stream(tmp, "wb") as f:
            f.write(payload)
            _sync(f, self.sync_files)
        if self.fs.exists(final):  # delete in case other checkpoints were present
            self.fs.rm_file(final)
        self.fs.rename(tmp, final)


def _registry_init(self) -> None:
    _torch_registry_init(self)
    self.register(Xxh3Trailer)


def transform_load_stream(self, read_item, transform_descriptors: Sequence[str], raw_stream):
    """torch's, with the item being read noted for the reader's error line: the folder
    and file from DCP's file view (its ``base_stream`` is the open file)."""
    if DESCRIPTOR in transform_descriptors:
        name = getattr(getattr(raw_stream, "base_stream", None), "name", None)
        path = Path(os.fspath(name)) if isinstance(name, (str, os.PathLike)) else None
        _reading.item = _Item(
            str(path.parent) if path else "(unknown folder)",
            path.name if path else "(unknown file)",
            _describe(getattr(read_item, "storage_index", None)),
            getattr(raw_stream, "offset", -1),
        )
    try:
        return _torch_transform_load_stream(self, read_item, transform_descriptors, raw_stream)
    finally:
        _reading.item = None


# ---------------------------------------------------------------- .metadata


def _sidecar(path) -> str:
    return os.fspath(path) + SIDECAR_SUFFIX


def _folder(path) -> str:
    return os.fspath(Path(os.fspath(path)).parent)


def _check_metadata_bytes(
    read: Callable[[str], bytes | None], path, data: bytes, tail: str = _NOT_LOADED
) -> bool:
    """Raise if ``data`` (the bytes of the .metadata at ``path``) do not match its
    sidecar; return whether there is one. ``read(p)``: p's bytes, or None if absent."""
    folder, name = _folder(path), Path(os.fspath(path)).name
    record = read(_sidecar(path))
    if record is None:
        return False
    try:
        fields = json.loads(record)
        algorithm, expected, nbytes = fields["algorithm"], fields["digest"], int(fields["bytes"])
    except (ValueError, KeyError, TypeError):
        raise ChecksumMismatch(
            f"checkpoint {folder} is corrupted: {name}{SIDECAR_SUFFIX} is not the JSON "
            f"{{algorithm, digest, bytes}} a save writes{tail}"
        ) from None
    if algorithm != ALGORITHM:
        raise ChecksumMismatch(
            f"checkpoint {folder}: {name}{SIDECAR_SUFFIX} records algorithm {algorithm!r}, "
            f"this boost_titan checks {ALGORITHM!r}{tail}"
        )
    found = _digest(data).hex()
    if found != expected or len(data) != nbytes:
        raise ChecksumMismatch(
            f"checkpoint {folder} is corrupted: {name}: {ALGORITHM} {found} ({len(data)} "
            f"bytes) where {name}{SIDECAR_SUFFIX} records {expected} ({nbytes} bytes); not "
            f"unpickled{tail.replace(';', ',')}"
        )
    return True


def _unchecked_items(metadata: Metadata) -> tuple[list[Any], int]:
    """(indexes of stored items without the trailer, number of stored items)."""
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return [], 0
    unchecked = [
        index
        for index, info in storage.items()
        if DESCRIPTOR not in (getattr(info, "transform_descriptors", None) or ())
    ]
    return unchecked, len(storage)


UNVERIFIED = "unverified"


def _consistency(
    folder: str, name: str, metadata: Metadata, sealed: bool, tail: str = _NOT_LOADED
) -> str | None:
    """The problem with a checkpoint whose sidecar and item checksums do not go
    together, :data:`UNVERIFIED` for one with neither, else None."""
    unchecked, total = _unchecked_items(metadata)
    if sealed and unchecked:
        return (
            f"checkpoint {folder} is corrupted: {name}{SIDECAR_SUFFIX} says it was written "
            f"with checksums, but {len(unchecked)} of its {total} items carry none (e.g. "
            f"{_describe(unchecked[0])}): altered or mixed{tail}"
        )
    if not sealed and len(unchecked) < total:
        return (
            f"checkpoint {folder} is corrupted: its items carry checksums but "
            f"{name}{SIDECAR_SUFFIX} (the checksum of {name}) is missing{tail}"
        )
    if not sealed:
        return UNVERIFIED
    return None


_warned_unverified: set[str] = set()


def _unverified_line(folder: str) -> str:
    return (
        f"checkpoint {folder} has no checksums (written before boost_titan checksummed "
        "checkpoints, or by another writer): its bytes cannot be verified"
    )


def _check_loaded_metadata(reader, path, data: bytes, parse: Callable[[], Metadata]) -> Metadata:
    """safe_metadata's hook around each .metadata it reads: the sidecar is checked
    before ``parse()`` unpickles, the items' checksums after."""
    fs = reader.fs

    def read(p) -> bytes | None:
        if not fs.exists(p):
            return None
        with fs.create_stream(p, "rb") as f:
            return f.read()

    sealed = _check_metadata_bytes(read, path, data)
    metadata = parse()
    folder, name = _folder(path), Path(os.fspath(path)).name
    problem = _consistency(folder, name, metadata, sealed)
    if problem == UNVERIFIED:
        if folder not in _warned_unverified:
            _warned_unverified.add(folder)
            logger.warning(_unverified_line(folder) + "; loaded unverified")
    elif problem is not None:
        raise ChecksumMismatch(problem)
    return metadata


def install_saving() -> None:
    """The save side of :func:`install` only (no torchtitan import)."""
    filesystem._FileSystemWriter.__init__ = _writer_init  # type: ignore[method-assign]
    filesystem._FileSystemWriter.finish = finish  # type: ignore[method-assign]


def install() -> None:
    """Checksum every DCP save of this process and verify every load (idempotent).
    Installs ``safe_metadata`` too: the sidecar is checked in its metadata reader."""
    safe_metadata.install()
    safe_metadata.metadata_check = _check_loaded_metadata
    install_saving()
    ExtensionRegistry.__init__ = _registry_init  # type: ignore[method-assign]
    filesystem._StorageReaderTransforms.transform_load_stream = transform_load_stream  # type: ignore[method-assign]


def installed() -> bool:
    return (
        safe_metadata.installed()
        and safe_metadata.metadata_check is _check_loaded_metadata
        and filesystem._FileSystemWriter.__init__ is _writer_init
        and filesystem._FileSystemWriter.finish is finish
        and ExtensionRegistry.__init__ is _registry_init
        and filesystem._StorageReaderTransforms.transform_load_stream is transform_load_stream
    )
