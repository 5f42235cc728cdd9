"""A DCP checkpoint is never silently wrong: every byte a save writes is checksummed,
every load verifies what it reads before the state is used.

:func:`install` (idempotent; the entry points that save or load checkpoints call it,
next to ``safe_metadata.install()``) makes every DCP save and load of the process do this:

- **items** (each tensor chunk and each pickled item DCP writes into a ``__R_F.distcp``
  file): :class:`Xxh3Trailer`, a DCP ``StreamTransformExtension``, hashes the item's
  bytes as they stream to the file, one xxh3_64 digest per MiB, and appends the digests
  and a 20-byte footer (length, block size, magic). ``FileSystemWriter`` uses it unless
  the caller passes its own ``_extensions`` (torchtitan's ``dcp.save(state,
  checkpoint_id=...)`` and ``dcp.async_save`` pass none); ``.metadata`` records it per
  item (``transform_descriptors = ["boost_titan.xxh3/1"]``; ``length`` includes the
  trailer). On load, ``torch.load`` reads each item through the extension's reader,
  which checks every MiB block against its digest as it is read and before the read
  returns (whole blocks straight into torch's buffer, then hashed; the blocks torch
  reads in pieces, the archive's head and tail, read whole once and served from
  memory): no second pass, no extra copy. On every rank, for every layout, resharded
  loads included (a rank reads the whole stored chunks its shards overlap).
- **.metadata**: a sidecar ``.metadata.xxh3`` (JSON: algorithm, digest, bytes) is
  written, atomically, before ``.metadata`` is renamed into place; a load checks it
  before ``.metadata`` is unpickled (in ``safe_metadata``'s allowlisted reader).

A mismatch is one line (:class:`ChecksumMismatch`) naming the step folder, the file,
the item (FQN, chunk offset), the bytes and the expected and found digests;
:func:`mismatch_in` finds it inside DCP's per-rank ``CheckpointException`` (every rank
gets every rank's failure). :func:`load_past_corruption` makes the trainer set a
corrupted newest step aside (``step_N.corrupt``) and resume from the one before;
:func:`check` / ``python -m boost_titan.checkpoint verify PATH`` verify a checkpoint
without loading it.

A checkpoint without any checksum (written before boost_titan checksummed checkpoints,
or by a writer given ``_extensions=()``) loads with one warning that it is unverified.
Half and half (a sidecar but items without checksums, or the reverse) is refused: that
is not something any save writes.

DCP's process-based async save (``async_mode = "async_with_pinned_mem"``) writes in a
spawned process: the writer it pickles there carries the extension, whose unpickling
installs the save side (:func:`install_saving`). Not covered: torchtitan's HF
safetensors checkpoints (``last_save_in_hf``; their own writer, no ``.metadata``: a
trailer does not belong in files other tools read). Cost:
``benchmarks/checkpoint_integrity.py``.

Checkpoints written with checksums need this module to load: plain DCP does not know
the ``boost_titan.xxh3`` extension (``ValueError: Unknown extension``); call
``boost_titan.integrity.install()`` first."""

from __future__ import annotations

import inspect
import io
import json
import logging
import os
import pickle
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from io import UnsupportedOperation
from pathlib import Path
from typing import IO, Any, cast

import xxhash
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.metadata import Metadata

from boost_titan import safe_metadata

logger = logging.getLogger()  # torchtitan's logger (the root logger), as boost_titan.fault

ALGORITHM = "xxh3_64"
NAME = "boost_titan.xxh3"
DESCRIPTOR = f"{NAME}/1"
_MAGIC = b"BTxxh3\x00\x01"  # ends every checksummed item
SIDECAR_SUFFIX = ".xxh3"
_NOT_LOADED = "; not loaded"


class ChecksumMismatch(BaseException):
    """A checkpoint whose bytes are not what its save wrote. One line.

    A BaseException, like safe_metadata's refusal: DCP's loader catches any
    ``Exception`` from ``read_metadata`` and falls back to rank-local metadata files; a
    corrupted checkpoint must end the load, not be worked around."""


def mismatch_in(exc: BaseException) -> ChecksumMismatch | None:
    """The mismatch inside DCP's CheckpointException (DCP gathers every rank's failure,
    so every rank finds the same one), or ``exc`` itself."""
    if isinstance(exc, ChecksumMismatch):
        return exc
    failures = getattr(exc, "failures", None) or {}
    for failure, _trace in failures.values():
        if isinstance(failure, ChecksumMismatch):
            return failure
    return None


def _digest(data) -> bytes:
    return xxhash.xxh3_64_digest(data)


# ---------------------------------------------------------------- items: the trailer
#
# An item's stored bytes: its payload (what torch.save or DCP wrote), then one xxh3_64
# digest (8 bytes, xxhash's canonical order) per BLOCK of payload, then the footer:
# payload length (u64 LE), block size (u32 LE), magic. Per-block digests let a load
# verify exactly the bytes torch.load reads, as it reads them, with no extra pass or copy.

BLOCK = 1 << 20
_FOOTER = struct.Struct("<QI")
FOOTER_BYTES = _FOOTER.size + len(_MAGIC)


def _trailer_bytes(payload: int, block: int = BLOCK) -> int:
    return -(-payload // block) * 8 + FOOTER_BYTES


class _HashingWriter(io.RawIOBase):
    """Passes every write to ``out``, digesting it block by block; ``close`` appends
    the digests and the footer."""

    def __init__(self, out: IO[bytes]):
        super().__init__()
        self.out = out
        self.digests = bytearray()
        self.block = xxhash.xxh3_64()
        self.filled = 0  # bytes of the current block digested so far
        self.total = 0
        self._sealed = False

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = view.nbytes
        self.out.write(b)
        i = 0
        if self.filled:
            i = min(BLOCK - self.filled, n)
            self.block.update(view[:i])
            self.filled += i
            if self.filled == BLOCK:
                self.digests += self.block.digest()
                self.block.reset()
                self.filled = 0
        while n - i >= BLOCK:
            self.digests += _digest(view[i : i + BLOCK])
            i += BLOCK
        if i < n:
            self.block.update(view[i:])
            self.filled = n - i
        self.total += n
        return n

    def flush(self) -> None:
        if not self._sealed:
            self.out.flush()

    def close(self) -> None:
        if not self._sealed:
            self._sealed = True
            if self.filled:
                self.digests += self.block.digest()
            self.out.write(bytes(self.digests) + _FOOTER.pack(self.total, BLOCK) + _MAGIC)
            self.out.close()  # DCP's NoCloseWriter: flushes, leaves the file open
        super().close()


# the item DCP is about to read on this thread (set around the reader's creation)
_reading = threading.local()


@dataclass(frozen=True)
class _Item:
    folder: str
    file: str
    what: str  # "item <fqn>[ (chunk at (..))]"
    offset: int  # in the file
    tail: str = _NOT_LOADED  # the end of its error lines ("" when only verified)


_UNKNOWN = _Item("(unknown folder)", "(unknown file)", "an item", -1)


def _describe(index) -> str:
    fqn = getattr(index, "fqn", None)
    if fqn is None:
        return "an item"
    offset = getattr(index, "offset", None)
    chunk = f" (chunk at {tuple(offset)})" if offset is not None and any(offset) else ""
    return f"item {fqn}{chunk}"


def _mismatch(item: _Item, start: int, end: int, found: bytes, expected: bytes) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"checkpoint {item.folder} is corrupted: {item.file}, {item.what}: {ALGORITHM} of "
        f"its bytes {start}..{end} is {found.hex()} where its save recorded "
        f"{expected.hex()} (the item starts at byte {item.offset} of the file){item.tail}"
    )


def _no_trailer(item: _Item, size: int, why: str) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"checkpoint {item.folder} is corrupted: {item.file}, {item.what}: its {size} bytes "
        f"end without the {ALGORITHM} trailer its .metadata declares ({why}){item.tail}"
    )


def _read_at(raw, pos: int, out: memoryview) -> int:
    """Read into ``out`` from ``pos`` of ``raw`` (DCP's file view, or BytesIO) until it
    is full or the stream ends; the number of bytes read."""
    raw.seek(pos)
    got = 0
    while got < len(out):
        n = raw.readinto(out[got:])
        if not n:
            break
        got += n
    return got


def _parse_trailer(item: _Item, raw, size: int) -> tuple[int, int, bytes]:
    """(payload length, block size, digests) of an item of ``size`` stored bytes."""
    if size < FOOTER_BYTES:
        raise _no_trailer(item, size, "too short")
    footer = bytearray(FOOTER_BYTES)
    if _read_at(raw, size - FOOTER_BYTES, memoryview(footer)) != FOOTER_BYTES:
        raise _no_trailer(item, size, "the file is shorter than its .metadata says")
    if not footer.endswith(_MAGIC):
        raise _no_trailer(item, size, "no trailer magic")
    payload, block = _FOOTER.unpack_from(footer)
    if block <= 0 or payload + _trailer_bytes(payload, block) != size:
        raise _no_trailer(item, size, f"its footer says {payload} bytes in blocks of {block}")
    digests = bytearray(size - FOOTER_BYTES - payload)
    if _read_at(raw, payload, memoryview(digests)) != len(digests):
        raise _no_trailer(item, size, "the file is shorter than its .metadata says")
    return payload, block, bytes(digests)


class _VerifyingReader(io.RawIOBase):
    """An item's payload as a seekable stream whose every byte is checked against its
    block's digest when it is read, before the reader returns it: torch.load reads
    through it with no extra pass or copy (whole blocks straight into its buffer, then
    digested; a block it reads in parts is read whole once, checked, and served from
    memory)."""

    _CHUNK_BLOCKS = 4  # whole blocks per read: digested while still in the CPU's cache
    _CACHED_BLOCKS = 4

    def __init__(self, raw: IO[bytes]):
        super().__init__()
        self.item: _Item = getattr(_reading, "item", None) or _UNKNOWN
        size = getattr(raw, "len", None)  # DCP's _ReaderView knows the item's length
        if not isinstance(size, int):
            data = raw.read()
            raw, size = io.BytesIO(data), len(data)
        self.raw = raw
        self.size, self.block, self.digests = _parse_trailer(self.item, raw, size)
        self.pos = 0
        self._cache: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self.pos = base + offset
        return self.pos

    def _check(self, k: int, data: memoryview) -> None:
        found, expected = _digest(data), self.digests[8 * k : 8 * k + 8]
        if found != expected:
            start = k * self.block
            raise _mismatch(self.item, start, start + len(data), found, expected)

    def _cached_block(self, k: int) -> bytes:
        if k not in self._cache:
            start = k * self.block
            data = bytearray(min(self.block, self.size - start))
            if _read_at(self.raw, start, memoryview(data)) != len(data):
                raise _no_trailer(
                    self.item, self.size, "the file is shorter than its .metadata says"
                )
            self._check(k, memoryview(data))
            if len(self._cache) >= self._CACHED_BLOCKS:
                del self._cache[next(iter(self._cache))]
            self._cache[k] = bytes(data)
        return self._cache[k]

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        done, block = 0, self.block
        while done < n:
            p = self.pos + done
            k, within = divmod(p, block)
            whole = min((n - done) // block, self._CHUNK_BLOCKS) if within == 0 else 0
            if whole == 0 and within == 0 and p + (n - done) == self.size:
                whole = 1  # the last (short) block, read whole
            if whole and k not in self._cache:
                span = min(whole * block, self.size - p)
                dest = out[done : done + span]
                if _read_at(self.raw, p, dest) != span:
                    raise _no_trailer(
                        self.item, self.size, "the file is shorter than its .metadata says"
                    )
                for j in range(0, span, block):
                    self._check(k + j // block, dest[j : j + block])
                done += span
            else:
                data = self._cached_block(k)
                take = min(len(data) - within, n - done)
                out[done : done + take] = data[within : within + take]
                done += take
        self.pos += n
        return n

    def read(self, size: int | None = -1) -> bytes:
        left = self.size - self.pos
        n = left if size is None or size < 0 else min(size, left)
        buf = bytearray(max(n, 0))
        got = self.readinto(buf)
        return bytes(buf[:got])

    def readall(self) -> bytes:
        return self.read(-1)


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


# ---------------------------------------------------------------- the trainer's resume


def _reraise_as_one_line(exc: BaseException) -> None:
    bad = mismatch_in(exc)
    if bad is not None:
        raise bad from None


def _quarantine(path: str) -> str:
    """Rank 0 renames the step folder ``step-N`` to ``step_N.corrupt`` (torchtitan's
    ``step-(\\d+)`` no longer matches it: neither loaded nor counted by
    ``keep_latest_k``); every rank returns the new name once it is done."""
    import torch.distributed as dist

    distributed = dist.is_initialized()
    outcome: list[object] = [None]
    if not distributed or dist.get_rank() == 0:
        parent, name = os.path.split(path)
        target = os.path.join(parent, name.replace("step-", "step_", 1) + ".corrupt")
        if os.path.exists(target):
            target += f".{int(time.time())}"
        try:
            os.rename(path, target)
            outcome[0] = target
        except OSError as e:
            outcome[0] = e
    if distributed:
        dist.broadcast_object_list(outcome, src=0)  # the others wait for the rename
    if isinstance(outcome[0], OSError):
        raise ChecksumMismatch(
            f"checkpoint {path} is corrupted and could not be set aside: {outcome[0]}"
        )
    return cast(str, outcome[0])


def _reset_optimizer_state(checkpointer) -> None:
    """A model-only step (the seed checkpoint, step 0) loads no optimizer state: clear
    what the failed load put there (DCP copies into the state tensors as it reads, and
    ``get_optimizer_state_dict`` creates the state first), so that the optimizer starts
    empty, as it does when a run starts from its seed checkpoint."""
    optimizers = checkpointer.states.get("optimizer")
    for optimizer in [optimizers, *getattr(optimizers, "optimizers", [])]:
        state = getattr(optimizer, "state", None)
        if hasattr(state, "clear"):
            state.clear()


def load_past_corruption(checkpointer, load: Callable[[int], bool], step: int = -1) -> bool:
    """``load(step)`` (torchtitan's ``CheckpointManager.load``) surviving a corrupted
    newest checkpoint when it resumes from its own folder (the folder exists and no
    ``load_step`` is given: torchtitan then ignores ``initial_load_path``): a checksum
    mismatch on any rank (DCP gives every rank every rank's failure) sets that step
    folder aside as ``step_N.corrupt`` and the load is retried from the newest step
    left, with a warning that names the mismatch and the steps lost. With no older
    step, or when the user named the checkpoint (``initial_load_path``,
    ``load_step``), the load fails on the mismatch's one line.

    A failed load has already copied some items into the model and optimizer state
    (DCP loads in place); the retry overwrites all of them: the planner requires every
    key of the state dict from the older step (``allow_partial_load`` is off), and a
    run's steps hold the same keys; a model-only step 0 resets the optimizer state."""
    # (checkpointing off: torchtitan's manager has no folder, and load does nothing)
    resuming = step == -1 and checkpointer.enable and os.path.exists(checkpointer.folder)
    while True:
        newest = checkpointer._find_load_step() if resuming else -1
        try:
            return load(step)
        except BaseException as e:
            bad = mismatch_in(e)
            if not resuming or newest < 0 or bad is None:
                _reraise_as_one_line(e)
                raise
        moved = _quarantine(checkpointer._create_checkpoint_id(newest))
        older = checkpointer._find_load_step()
        if older < 0:
            raise ChecksumMismatch(
                f"{bad}. It was the only checkpoint left in {checkpointer.folder} (moved "
                f"to {moved}): no verified checkpoint to resume from. Restore a copy of "
                "it, or start over with a new --job.dump_folder"
            ) from None
        logger.warning(
            f"{bad}. Moved it to {moved}; resuming from step {older} instead: "
            f"{newest - older} steps ({older + 1}-{newest}) are trained again"
        )
        if older == 0:
            _reset_optimizer_state(checkpointer)


# ---------------------------------------------------------------- standalone verification


@dataclass
class Verification:
    """What :func:`check` found in one step folder."""

    folder: str
    problems: list[str] = field(default_factory=list)  # one line each
    checksummed: bool = True  # False: a checkpoint without checksums (nothing to verify)
    items: int = 0
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _metadata_files(folder: Path) -> list[Path]:
    if (folder / filesystem._metadata_fn).is_file():
        return [folder / filesystem._metadata_fn]
    return sorted(
        (
            p
            for p in folder.glob(f"__*{filesystem._metadata_fn}")
            if re.fullmatch(r"__\d+\.metadata", p.name)
        ),
        key=lambda p: int(p.name[2:].split(".")[0]),
    )


def _verify_file(folder: str, path: Path, items: list[tuple[Any, Any]], out: Verification) -> None:
    """Check every block of each (index, storage info) stored in the file at ``path``:
    one line per bad item (its first bad block)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        out.problems.append(
            f"checkpoint {folder} is incomplete: {path.name} ({len(items)} items) cannot be "
            f"read: {e.strerror or e}"
        )
        return
    buf = memoryview(bytearray(BLOCK))
    with f:
        for index, info in sorted(items, key=lambda it: it[1].offset):
            item = _Item(folder, path.name, _describe(index), info.offset, "")
            view = filesystem._create_file_view(f, info.offset, info.length)
            out.items += 1
            out.nbytes += info.length
            try:
                payload, block, digests = _parse_trailer(item, view, info.length)
                data = buf if block == BLOCK else memoryview(bytearray(block))
                for k, start in enumerate(range(0, payload, block)):
                    n = min(block, payload - start)
                    if _read_at(view, start, data[:n]) != n:
                        raise _no_trailer(item, info.length, "the file is shorter")
                    found = _digest(data[:n])
                    if found != digests[8 * k : 8 * k + 8]:
                        raise _mismatch(item, start, start + n, found, digests[8 * k : 8 * k + 8])
            except ChecksumMismatch as e:
                out.problems.append(str(e))


def check(step_dir: str | os.PathLike) -> Verification:
    """Verify one DCP step folder without loading it and without torch.distributed: the
    .metadata against its sidecar (before it is unpickled, with safe_metadata's
    allowlist), then every stored item's trailer, reading each file once."""
    folder = Path(step_dir)
    out = Verification(str(folder))
    metadata_files = _metadata_files(folder)
    if not metadata_files:
        if (folder / "model.safetensors.index.json").is_file():
            out.checksummed = False  # torchtitan's HF format: not checksummed (module doc)
        else:
            why = "does not exist" if not folder.exists() else "has no .metadata"
            out.problems.append(f"{folder} is not a DCP checkpoint: it {why}")
        return out

    def read(p) -> bytes | None:
        return Path(p).read_bytes() if os.path.isfile(p) else None

    for path in metadata_files:
        data = path.read_bytes()
        try:
            sealed = _check_metadata_bytes(read, path, data, "")
            metadata = safe_metadata.loads(data, str(folder))
        except (ChecksumMismatch, safe_metadata.UntrustedCheckpointError) as e:
            out.problems.append(str(e))
            continue
        if not isinstance(metadata, Metadata):
            out.problems.append(
                f"checkpoint {folder}: its {path.name} holds a {type(metadata).__name__}, "
                "not DCP Metadata"
            )
            continue
        problem = _consistency(str(folder), path.name, metadata, sealed, "")
        if problem == UNVERIFIED:
            out.checksummed = False
            continue
        if problem is not None:
            out.problems.append(problem)
            continue
        per_file: dict[str, list[tuple[Any, Any]]] = {}
        for index, info in metadata.storage_data.items():
            per_file.setdefault(info.relative_path, []).append((index, info))
        for relative, items in sorted(per_file.items()):
            _verify_file(str(folder), folder / relative, items, out)
    return out


def verify(path: str | os.PathLike) -> list[str]:
    """The problems of one step folder, one line each (empty: verified, or a checkpoint
    without checksums: see :func:`check`)."""
    return check(path).problems


_STEP = re.compile(r"step-(\d+)")


def step_folders(folder: str | os.PathLike) -> list[Path]:
    """``step-N`` subfolders of ``folder`` (torchtitan's checkpoint folder), newest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    steps = [
        (int(m[1]), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(steps, reverse=True)]


def newest_verified(folder: str | os.PathLike) -> tuple[str | None, list[str]]:
    """(the newest complete step folder under ``folder`` that verifies, the first
    problem line of each newer one that does not)."""
    bad = []
    for step in step_folders(folder):
        if (
            not (step / filesystem._metadata_fn).is_file()
            and not (step / "model.safetensors.index.json").is_file()
        ):
            continue  # cut off (fault.quarantine_incomplete_checkpoints' case)
        result = check(step)
        if result.ok:
            return str(step), bad
        bad.append(result.problems[0])
    return None, bad


def main(argv: list[str]) -> int:
    """``python -m boost_titan.checkpoint verify PATH [PATH ...]``; returns the exit code."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="python -m boost_titan.checkpoint verify",
        description="Verify DCP checkpoints without loading them: every stored item and "
        ".metadata against the checksums its save recorded. Exit 0 when everything "
        "verifies, 1 with one line per bad item otherwise. A checkpoint written without "
        "checksums (before boost_titan checksummed checkpoints) cannot be verified: it "
        "prints an 'unverified' line and does not change the exit code.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a step folder (<dump_folder>/checkpoint/step-N), or a folder of step-N "
        "folders (each is verified)",
    )
    args = p.parse_args(argv)
    status = 0
    for path in map(Path, args.paths):
        if path.is_dir() and not _metadata_files(path) and step_folders(path):
            steps = sorted(step_folders(path), key=lambda s: int(s.name[5:]))
        else:
            steps = [path]
        for step in steps:
            result = check(step)
            for line in result.problems:
                print(line, file=sys.stderr)
            if result.problems:
                status = 1
            elif not result.checksummed:
                print(f"unverified: {_unverified_line(str(step))}")
            else:
                print(
                    f"ok: {step} ({result.items} items, {result.nbytes / 2**20:.1f} MiB, "
                    f"{ALGORITHM})"
                )
    return status
