"""Sealed steps inside DCP: the save digests every item as it streams to its file and
writes the step's manifest before ``.metadata``; the load opens the step through
:func:`~.step.open_step` and checks every item against the manifest as it reads it.
:func:`install` puts both into this process's DCP. The files DCP writes stay plain
DCP: no transform, no trailer, nothing in ``.metadata`` that stock torch does not read."""

from __future__ import annotations

import inspect
import logging
import os
import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.metadata import Metadata

from boost_titan.checkpoint import run_id, safe_metadata
from boost_titan.checkpoint.integrity import in_place, legacy
from boost_titan.checkpoint.integrity import manifest as mf
from boost_titan.checkpoint.integrity.blocks import (
    ChecksumMismatch,
    Item,
    VerifyingReader,
    describe,
    segment_blocks,
    segment_digests,
)
from boost_titan.checkpoint.integrity.step import TRAILERS, UNVERIFIED, open_step
from boost_titan.checkpoint.integrity.writing import Digests, HashingStream

logger = logging.getLogger()  # torchtitan's logger (the root logger), as boost_titan.train.fault

_DIGESTS = "_boost_digests"  # an item's digests, on its _StorageInfo until its rank's part
_PART = "_boost_part"  # a rank's part of the manifest, on its first _StorageInfo


class _SealsWhereUnpickled:
    """Carried by every writer (``writer._boost_seal``): DCP's process-based async save
    (``async_with_pinned_mem``) pickles the writer into a fresh process, where
    unpickling this installs the save side before the writer is used."""

    def __reduce__(self):
        return (_saving_installed_here, ())


def _saving_installed_here() -> _SealsWhereUnpickled:
    install_saving()
    return _SealsWhereUnpickled()


# ---------------------------------------------------------------- saving

_torch_writer_init = filesystem._FileSystemWriter.__init__
_torch_finish = filesystem._FileSystemWriter.finish
_torch_write_data = filesystem._FileSystemWriter.write_data
_torch_prepare_local_plan = filesystem._FileSystemWriter.prepare_local_plan
_torch_write_item = filesystem._write_item
_torch_transform_load_stream = filesystem._StorageReaderTransforms.transform_load_stream


_WRITER_SIGNATURE = inspect.signature(_torch_writer_init)


def _writer_init(self, *args: Any, **kwargs: Any) -> None:
    """torch's, with the writer marked: it seals its step unless the caller passed
    ``_extensions`` (``_extensions=()``: a plain, unsealed DCP save, as torch writes)."""
    _torch_writer_init(self, *args, **kwargs)
    bound = _WRITER_SIGNATURE.bind(self, *args, **kwargs)
    self.transforms._boost_unsealed = bound.arguments.get("_extensions") is not None
    self._boost_seal = _SealsWhereUnpickled()


def _prepare_local_plan(self, plan):
    """torch's, after refusing (every rank, before anything is written; DCP gathers the
    refusal) a step folder that is a symbolic link (a save never writes through a link
    into another step) and a save that could not be sealed: a step is sealed or not
    written, never silently unsealed."""
    path = os.fspath(self.path)
    if isinstance(self.fs, filesystem.FileSystem) and os.path.islink(path.rstrip("/")):
        raise ChecksumMismatch(
            f"checkpoint save refused: {path} is a symbolic link (to {os.readlink(path)}); "
            "a save writes a real step folder, never through a link into another one"
        )
    why = _unsealable(self)
    if why:
        raise ChecksumMismatch(
            f"checkpoint save refused: {path} cannot be sealed: {why}; a plain unsealed "
            "DCP save is dcp.save(..., storage_writer=FileSystemWriter(path, _extensions=()))"
        )
    return _torch_prepare_local_plan(self, plan)


def _unsealable(self) -> str:
    """Why a DCP (torch-save format) writer meant to seal could not: '' when it can.
    Safetensors writers (Hugging Face folders) are sealed by ``folder_seal`` instead."""
    if getattr(self.transforms, "_boost_unsealed", True):
        return ""
    if getattr(self, "serialization_format", None) != filesystem.SerializationFormat.TORCH_SAVE:
        return ""
    if not isinstance(self.fs, filesystem.FileSystem):
        return (
            f"its writer's filesystem is {type(self.fs).__module__}.{type(self.fs).__name__}; "
            "boost_titan seals steps on local and mounted POSIX filesystems (a shared mount "
            "such as Lustre, GPFS or NFS works), not object stores"
        )
    if not getattr(self, "use_collectives", True) and getattr(self, "rank", None) is not None:
        return (
            "each rank finishes its own save (use_collectives=False): the manifest is "
            "joined by the coordinator"
        )
    return ""


def _write_item(transforms, stream, data, write_item, storage_key, serialization_format):
    """torch's ``_write_item`` with the bytes digested as they stream to the file."""
    if serialization_format != filesystem.SerializationFormat.TORCH_SAVE or getattr(
        transforms, "_boost_unsealed", True
    ):
        return _torch_write_item(
            transforms, stream, data, write_item, storage_key, serialization_format
        )
    hashing = HashingStream(stream, keep=data)
    result = _torch_write_item(
        transforms, hashing, data, write_item, storage_key, serialization_format
    )
    # travels with the result to the coordinator (resolved when it is gathered)
    setattr(result.storage_data, _DIGESTS, hashing.finish())
    return result


def _sync(f, sync_files: bool) -> None:
    if sync_files:
        os.fsync(f.fileno())


def _write_data(self, plan, planner):
    """torch's, with this rank's part of the manifest made once its items are written:
    its files' sections encoded and digested (``manifest.sections_part``) and its
    files' ends, carried by its
    first write result to the coordinator, which then only joins the ranks' bytes."""
    written = _torch_write_data(self, plan, planner)
    if getattr(self.transforms, "_boost_unsealed", True):
        return written
    return written.then(lambda done: _with_part(done.value()))


def _with_part(results: list) -> list:
    infos = [wr.storage_data for wr in results]
    recorded = [info.__dict__.pop(_DIGESTS, None) for info in infos]
    if not results or None in recorded:  # (not every item digested: the save is unsealed)
        return results
    entries, ends = [], {}
    for wr, info, digests in zip(results, infos, recorded):
        fqn, chunk = mf.key(wr.index)
        segments, item_digests = digests.resolve() if isinstance(digests, Digests) else digests
        file, offset, length = info.relative_path, info.offset, info.length
        segments = tuple(segments)
        entries.append(mf.ItemEntry(fqn, chunk, file, offset, length, segments, item_digests))
        ends[file] = max(ends.get(file, 0), offset + length)
    entries.sort(key=lambda i: (i.file, i.offset))
    infos[0].__dict__[_PART] = (mf.sections_part(entries), ends, len(entries))
    return results


def finish(self, metadata: Metadata, results) -> None:
    """``_FileSystemWriter.finish`` of torch 2.13 with the manifest: its items are the
    ranks' parts (:func:`_write_data`), joined as bytes (nothing done per item here
    that torch does not do), ``.metadata`` stays what torch writes (plus a
    ``boost_titan.seal/2`` entry in ``storage_meta.modules``), the manifest is written
    (tmp + rename) and only then ``.metadata``, whose presence marks the step
    complete."""
    with mf.gc_paused():  # (torch's storage dict: an entry per item, no cycle)
        return _finish(self, metadata, results)


def _finish(self, metadata: Metadata, results) -> None:
    parts = [wrs[0].storage_data.__dict__.pop(_PART, None) for wrs in results if wrs]
    counts = sum(len(wrs) for wrs in results)
    asked = getattr(self.transforms, "_boost_unsealed", None)  # (None: built before install)
    if asked or (asked is None and not any(parts)):  # a plain DCP save, asked for
        for wrs in results:
            for wr in wrs:
                wr.storage_data.__dict__.pop(_DIGESTS, None)
        return _torch_finish(self, metadata, results)
    why = _unsealable(self)  # (refused before any write: _prepare_local_plan)
    if not why and (None in parts or sum(p[2] for p in parts) != counts):
        why = (
            f"{sum(p is None for p in parts)} of its {len(parts)} writing ranks wrote items "
            f"without digests ({counts} items in all)"
        )
    if why:  # no .metadata: the step is incomplete, set aside when a run starts
        raise ChecksumMismatch(
            f"checkpoint save refused: {os.fspath(self.path)} cannot be sealed: {why}; "
            "its .metadata is not written (the step stays incomplete)"
        )
    metadata.version = filesystem.CURRENT_DCP_VERSION
    storage = {}
    for wrs in results:  # (torch's own loop)
        storage.update({wr.index: wr.storage_data for wr in wrs})
    metadata.storage_data = storage
    meta = self.storage_meta()
    meta.modules = [*meta.modules, mf.SEAL]
    metadata.storage_meta = meta
    data = pickle.dumps(metadata)
    folder = os.fspath(self.path)
    files = {}
    for _part, ends, _count in parts:
        for name, end in ends.items():
            files[name] = mf.FileEntry(max(end, files[name].bytes if name in files else 0), None)
    files[mf.METADATA] = mf.FileEntry(len(data), segment_digests(data))
    seal = mf.Seal(
        "dcp",
        mf.step_of(os.path.basename(os.path.normpath(folder))),
        self.save_id,
        files,
        {},
        run_id=run_id.of_steps_in(folder),  # the checkpoint folder's run (its run.json)
    )
    seal.states = tuple(sorted({k.split(".", 1)[0] for k in metadata.state_dict_metadata}))
    final = os.path.join(folder, mf.METADATA)
    if os.path.lexists(final):  # saved again: incomplete, never half old, half new
        os.remove(final)
    mf.write(folder, seal, self.sync_files, parts=[p[0] for p in parts])
    tmp = final + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        _sync(f, self.sync_files)
    os.replace(tmp, final)


# ---------------------------------------------------------------- loading

_warned: set[str] = set()


def unverified_line(folder: str) -> str:
    return (
        f"checkpoint {folder} has no checksums (written before boost_titan checksummed "
        "checkpoints, or by another writer): its bytes cannot be verified"
    )


def trailers_line(folder: str) -> str:
    return (
        f"checkpoint {folder} was written before boost_titan sealed its steps: each item "
        "is checked against its own checksum, but nothing binds its items to this step"
    )


def _read_verified(reader, folder: str) -> Metadata:
    """safe_metadata's ``read_metadata`` hook: the step opened and checked, the
    verified Metadata returned, its manifest kept for the item reads."""
    step = open_step(folder)  # (the dump folder's steps: chosen without links, resume)
    if step.metadata is None:
        raise ChecksumMismatch(
            f"checkpoint {folder} is a Hugging Face folder, not a DCP step (load it with "
            "[checkpoint] initial_load_in_hf)"
        )
    reader.transforms._boost_step = step
    if step.trust in (UNVERIFIED, TRAILERS) and folder not in _warned:
        _warned.add(folder)
        if step.trust == UNVERIFIED:
            logger.warning(unverified_line(folder) + "; loaded unverified")
        else:
            logger.warning(trailers_line(folder))
    return step.metadata


def transform_load_stream(self, read_item, transform_descriptors, raw_stream):
    """torch's, with every item of a sealed step read through a reader that checks its
    bytes against the manifest (and items of a step with trailers against those)."""
    step = getattr(self, "_boost_step", None)
    base = getattr(raw_stream, "base_stream", None)
    name = getattr(base, "name", None)
    path = Path(os.fspath(name)) if isinstance(name, (str, os.PathLike)) else None
    index = getattr(read_item, "storage_index", None)
    item = Item(
        step.folder if step else str(path.parent) if path else "(unknown folder)",
        path.name if path else "(unknown file)",
        describe(index),
        getattr(raw_stream, "offset", -1),
    )
    if step is not None and step.seal is not None:
        # the manifest's entry (its file's section read first), where .metadata puts it
        relative = os.path.relpath(path, step.folder) if path else "(unknown file)"
        offset, length = getattr(raw_stream, "offset", -1), getattr(raw_stream, "len", -1)
        entry = step.entry(index, relative, offset, length, transform_descriptors)
        blocks = segment_blocks(entry.segments, step.seal.block)
        return VerifyingReader(raw_stream, entry.length, entry.digests, item, blocks)
    if list(transform_descriptors or ()) == [legacy.DESCRIPTOR]:
        return legacy.reader(raw_stream, raw_stream.len, item)
    return _torch_transform_load_stream(self, read_item, transform_descriptors, raw_stream)


def install_saving() -> None:
    """The save side of :func:`install` only (no torchtitan import)."""
    filesystem._FileSystemWriter.__init__ = _writer_init  # type: ignore[method-assign]
    filesystem._FileSystemWriter.finish = finish  # type: ignore[method-assign]
    filesystem._FileSystemWriter.write_data = _write_data  # type: ignore[method-assign]
    filesystem._FileSystemWriter.prepare_local_plan = _prepare_local_plan  # type: ignore[method-assign]
    filesystem._write_item = _write_item


def install() -> None:
    """Seal every DCP save of this process and verify every load (idempotent).
    Installs ``safe_metadata`` too: steps are opened in its metadata reader."""
    safe_metadata.install()
    safe_metadata.metadata_reader = _read_verified
    install_saving()
    filesystem._StorageReaderTransforms.transform_load_stream = transform_load_stream  # type: ignore[method-assign]
    in_place.install()


def installed() -> bool:
    return (
        safe_metadata.installed()
        and safe_metadata.metadata_reader is _read_verified
        and filesystem._FileSystemWriter.__init__ is _writer_init
        and filesystem._FileSystemWriter.finish is finish
        and filesystem._FileSystemWriter.write_data is _write_data
        and filesystem._write_item is _write_item
        and filesystem._StorageReaderTransforms.transform_load_stream is transform_load_stream
        and in_place.installed()
    )
