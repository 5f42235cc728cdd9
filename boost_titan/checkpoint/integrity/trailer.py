"""The bytes of a checksummed item: its payload, one xxh3_64 digest per MiB, a footer;
written as the payload streams out (:class:`_HashingWriter`), verified as a load reads
it (:class:`_VerifyingReader`); the one-line :class:`ChecksumMismatch`."""

from __future__ import annotations

import io
import logging
import os
import struct
import threading
from dataclasses import dataclass
from typing import IO

import xxhash

logger = logging.getLogger()  # torchtitan's logger (the root logger), as boost_titan.train.fault

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


# its public name, in tracebacks and pickles: boost_titan.checkpoint.integrity.ChecksumMismatch
ChecksumMismatch.__module__ = "boost_titan.checkpoint.integrity"


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
