"""DCP metadata read with an allowlist: a checkpoint's ``.metadata`` cannot run code.

torch's ``FileSystemReader.read_metadata`` reads a step folder's ``.metadata`` with a
plain ``pickle.load``, so a crafted folder (a colleague's run, a shared or downloaded
checkpoint) runs any code it likes the moment it is loaded. The tensor items are
already safe (torch reads each with ``torch.load(weights_only=True)``). Not covered
here: DCP's non-tensor items (``DefaultLoadPlanner.load_bytes``: ``torch.load(
weights_only=False)``) and torchtitan's data loader state (``pickle.loads``); see the
README's "Loading checkpoints you did not write". :func:`install` replaces
``FileSystemReader.read_metadata`` with :func:`read_metadata`, whose unpickler
resolves only the globals DCP metadata is made of (:data:`ALLOWED`) and refuses any
other global by name before anything is built from it. When a newer torch adds a
class to its metadata, the refusal names it: extend :data:`ALLOWED` on purpose, never
bypass the check.

Why a patch of the method and not a reader of our own: torchtitan's CheckpointManager
calls ``dcp.load(state, checkpoint_id=...)`` and DCP builds its ``FileSystemReader``
itself (``_storage_utils._storage_setup``); replacing the one method covers that,
``boost_titan.checkpoint`` and every other ``dcp.load`` / ``_load_state_dict_from_keys``
of the process (subclasses such as fsspec's reader inherit it) without copying
torchtitan's loading code. It is applied by the entry points that load checkpoints
(``boost_titan.train``, which the fork server preloads, and ``boost_titan.checkpoint``),
not on ``import boost_titan``, which must stay light."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) of every global a DCP .metadata pickle refers to (torch 2.13, every
# layout boost_titan saves: tests/test_safe_metadata.py and the checkpoint tests check
# real checkpoints against this). Each one only builds inert data when called.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [
        *(
            (_DCP_METADATA, n)
            for n in (
                "Metadata",
                "StorageMeta",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",  # an Enum: TensorProperties' memory format
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # file, offset, length
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a dict lookup: "torch.strided" -> layout
        # StorageMeta.checkpoint_id: the writer's folder, a Path (a POSIX one here)
        ("pathlib", "PosixPath"),
        # dtypes pickle as a global of the torch module (torch.float32, ...)
        *(("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)),
    ]
)


class UntrustedCheckpointError(BaseException):
    """A ``.metadata`` that refers to a global outside :data:`ALLOWED`.

    A BaseException, like DCP's own CheckpointException: DCP's loader catches any
    ``Exception`` from ``read_metadata`` and falls back to rank-local ``__N.metadata``
    files; a refusal must end the load, not be logged and worked around."""


def _refusal(where: str, what: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"checkpoint {where} was not loaded: {what}; it is not a DCP checkpoint "
        "boost_titan wrote or trusts (allowed: boost_titan.safe_metadata.ALLOWED)"
    )


def refusal_in(exc: BaseException) -> UntrustedCheckpointError | None:
    """The refusal inside DCP's CheckpointException (it wraps each rank's failure),
    so that a run ends on the refusal's line rather than on DCP's per-rank report."""
    failures = getattr(exc, "failures", None) or {}
    for failure, _trace in failures.values():
        if isinstance(failure, UntrustedCheckpointError):
            return failure
    return None


class _Unpickler(pickle.Unpickler):
    """The C unpickler (as fast as ``pickle.load``) with globals restricted.

    ``find_class`` runs when the pickle names a global, before anything can call it;
    without a ``persistent_load`` any persistent id is refused by pickle itself."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise _refusal(
                self.where,
                f"its .metadata refers to {module}.{name}, which DCP metadata is not made of",
            )
        return super().find_class(module, name)


def load(file, where: str) -> Any:
    """Unpickle DCP metadata from a binary file object. ``where`` (the step folder)
    starts the error message."""
    return _Unpickler(file, where).load()


def loads(data: bytes, where: str) -> Any:
    return load(io.BytesIO(data), where)


def read_metadata(self: filesystem.FileSystemReader, *args: Any, **kwargs: Any) -> Metadata:
    """``FileSystemReader.read_metadata`` of torch 2.13 with :func:`load` in place of
    ``pickle.load``; the rest is torch's, line for line."""
    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as metadata_file:
        metadata = load(metadata_file, os.fspath(Path(os.fspath(path)).parent))
    if not isinstance(metadata, Metadata):
        raise _refusal(
            os.fspath(Path(os.fspath(path)).parent),
            f"its .metadata holds a {type(metadata).__name__}, not DCP Metadata",
        )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def install() -> None:
    """Route every DCP metadata read of this process through :func:`read_metadata`
    (idempotent)."""
    filesystem.FileSystemReader.read_metadata = read_metadata  # type: ignore[method-assign]


def installed() -> bool:
    return filesystem.FileSystemReader.read_metadata is read_metadata
