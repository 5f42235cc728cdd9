"""Per-block digests of a checkpoint's bytes: one xxh3_64 per MiB of an item (or a
file), computed as the bytes stream to disk (``writing.HashingStream``) and checked as a
load reads them (:class:`VerifyingReader`), before the read returns; the one-line
:class:`ChecksumMismatch` every damaged step ends in.

Hashing calls xxhash's C function through ctypes, which releases the GIL (xxhash's
Python functions hold it). A save hands the blocks of a write to one helper thread
that hashes them beside the write; a load hashes each block in the page cache just
before copying it out (:class:`VerifyingReader`), so the bytes cross memory once."""

from __future__ import annotations

import bisect
import ctypes
import io
import mmap
import os
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import IO

import numpy as np
import xxhash

ALGORITHM = "xxh3_64"
BLOCK = 1 << 20
NOT_LOADED = "; not loaded"


class ChecksumMismatch(BaseException):
    """A checkpoint step that is not what its save wrote: a byte that differs from its
    digest, a file missing, cut short, of the wrong kind or from another step, a
    manifest or ``.metadata`` that does not verify. One line.

    A BaseException, like safe_metadata's refusal: DCP's loader catches any
    ``Exception`` from ``read_metadata`` and falls back to rank-local metadata files; a
    damaged checkpoint must end the load, not be worked around."""


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


def _gil_free_xxh3():
    """xxhash's own C ``XXH3_64bits_dispatch`` (AVX2/AVX-512 where the CPU has them),
    called through ctypes, which releases the GIL for the call: xxhash's Python
    functions hold it while they hash, so a helper thread hashing a chunk would stall
    the thread that reads the next one (measured: the helper then hid nothing). The
    same function as ``xxhash.xxh3_64_intdigest``, checked here on a probe; None where
    the extension does not expose it (a build with hidden symbols), and the digests
    are then xxhash's Python ones: the same values, only not beside the I/O."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        fn = lib.XXH3_64bits_dispatch
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint64, (ctypes.c_void_p, ctypes.c_size_t)
    probe = bytes(range(256)) * 9
    if fn(probe, len(probe)) != xxhash.xxh3_64_intdigest(probe):
        return None
    return fn


_xxh3 = _gil_free_xxh3()
GIL_FREE = _xxh3 is not None


def _address(view: memoryview) -> int:
    """Where ``view``'s bytes (contiguous, read-only ones too) start in memory."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def _digest_at(address: int, n: int) -> bytes:
    """The digest of the ``n`` bytes at ``address`` (GIL released)."""
    return _xxh3(address, n).to_bytes(8, "big")


def digest(data) -> bytes:
    if _xxh3 is None:
        return xxhash.xxh3_64_digest(data)
    view = memoryview(data).cast("B")
    return _digest_at(_address(view), len(view))


def block_digests(view, block: int = BLOCK) -> bytes:
    """The digests of each ``block`` bytes of ``view`` (the last one may be short)."""
    view = memoryview(view).cast("B")
    return digests_of(view, uniform_blocks(len(view), block))


TAIL = 64 * 1024  # the last bytes of a segment longer than a block: a block of their own


def uniform_blocks(size: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """(start, length) of ``size`` bytes cut into ``block``-byte blocks from the start."""
    return [(j, min(block, size - j)) for j in range(0, size, block)]


def segment_blocks(segments, block: int = BLOCK) -> list[tuple[int, int]]:
    """(start, length) of every block of an item made of ``segments`` (their lengths, in
    order): each segment is cut into ``block``-byte blocks from its own start, and its
    last ``TAIL`` bytes, when it is longer than a block, are a block of their own, so
    that the reads torch makes of an archive (its header, a probe of its last 4 KiB,
    then the tensor's data in one read) meet whole blocks or small ones."""
    out, start = [], 0
    for length in segments:
        body = length - TAIL if length > block else length
        out += [(start + s, n) for s, n in uniform_blocks(body, block)]
        if body < length:
            out.append((start + body, length - body))
        start += length
    return out


def block_count(segments, block: int = BLOCK) -> int:
    """``len(segment_blocks(segments, block))``, counted without building the list: a
    manifest's lengths are checked against the digests it holds before any list of
    blocks is made (a forged length of 2**61 would otherwise make 2**41 of them)."""
    count = 0
    for length in segments:
        body = length - TAIL if length > block else length
        count += -(-max(body, 0) // block) + (body < length)
    return count


def digests_of(view, blocks: list[tuple[int, int]], base: int = 0) -> bytes:
    """The digests of ``blocks`` (absolute (start, length)) of an item whose bytes from
    ``base`` on are in ``view``."""
    view = memoryview(view).cast("B")
    for s, n in blocks:  # (addresses are only safe inside the view; a slice past it, short)
        if s < base or s - base + n > len(view):
            raise ValueError(f"block {s}..{s + n} is outside the {len(view)} bytes from {base}")
    if _xxh3 is None:
        return b"".join(digest(view[s - base : s - base + n]) for s, n in blocks)
    at = _address(view) - base
    return b"".join(_digest_at(at + s, n) for s, n in blocks)


def segment_digests(view, block: int = BLOCK) -> bytes:
    """The digests of one segment (a write, a file, ``.metadata``), laid out as
    :func:`segment_blocks` cuts it."""
    return digests_of(view, segment_blocks([len(memoryview(view).cast("B"))], block))


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class Item:
    """What is being read, for the error line."""

    folder: str
    file: str
    what: str  # "item <fqn>[ (chunk at (..))]"
    offset: int  # in the file
    tail: str = NOT_LOADED  # the end of its error lines ("" when only verified)


def describe(index) -> str:
    fqn = getattr(index, "fqn", None)
    if fqn is None:
        return "an item"
    offset = getattr(index, "offset", None)
    chunk = f" (chunk at {tuple(offset)})" if offset is not None and any(offset) else ""
    return f"item {fqn}{chunk}"


def mismatch(item: Item, start: int, end: int, found: bytes, expected: bytes) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"checkpoint {item.folder} is corrupted: {item.file}, {item.what}: {ALGORITHM} of "
        f"its bytes {start}..{end} is {found.hex()} where its save recorded "
        f"{expected.hex()} (the item starts at byte {item.offset} of the file){item.tail}"
    )


def cut_short(item: Item, size: int) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"checkpoint {item.folder} is corrupted: {item.file}, {item.what}: the file ends "
        f"before the item's {size} bytes do{item.tail}"
    )


def read_at(raw, pos: int, out: memoryview) -> int:
    """Read into ``out`` from ``pos`` of ``raw`` until it is full or the stream ends;
    the number of bytes read."""
    raw.seek(pos)
    got = 0
    while got < len(out):
        n = raw.readinto(out[got:])
        if not n:
            break
        got += n
    return got


# Linux 5.14+: map the pages of a region in one call instead of a fault per few pages
_MADV_POPULATE_READ = 22 if sys.platform == "linux" else None


def _local_file(raw) -> tuple[int, int] | None:
    """(descriptor, offset of the stream's first byte) where ``raw`` is DCP's view of a
    local regular file (``_ReaderView``) or such a file itself; None otherwise."""
    base, offset = getattr(raw, "base_stream", raw), getattr(raw, "offset", 0)
    try:
        fd = base.fileno()
    except (AttributeError, OSError, ValueError):
        return None
    if not isinstance(offset, int) or not stat.S_ISREG(os.fstat(fd).st_mode):
        return None
    return fd, offset


# the most of a file mapped at once: a mapped page counts in the process' RSS until it
# is unmapped, so mapping a whole 1 GiB embedding doubled a load's peak RSS (the pages
# and the tensor they are copied into: an export of Llama-3.2-1B's width peaked 1 GiB
# higher)
_MAP_WINDOW = 64 * 2**20


def _windows(blocks: list[tuple[int, int]], k: int, j: int) -> Iterator[tuple[int, int]]:
    """Blocks ``k .. j-1`` in runs ``[a, b)`` of at most ``_MAP_WINDOW`` bytes (a block
    larger than that alone)."""
    a = k
    while a < j:
        b, size = a, 0
        while b < j and (b == a or size + blocks[b][1] <= _MAP_WINDOW):
            size += blocks[b][1]
            b += 1
        yield a, b
        a = b


@contextmanager
def _mapped(fd: int, start: int, n: int):
    """The address of bytes ``start .. start + n`` of file ``fd``, mapped read-only
    while the context lasts."""
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    region = mmap.mmap(fd, start + n - aligned, access=mmap.ACCESS_READ, offset=aligned)
    try:
        if _MADV_POPULATE_READ is not None:
            with suppress(OSError):  # older kernels: the pages fault in as they are read
                region.madvise(_MADV_POPULATE_READ)
        pages = np.frombuffer(region, dtype=np.uint8)
        try:
            yield pages.ctypes.data + (start - aligned)
        finally:
            del pages  # the mapping closes only once nothing exports it
    finally:
        region.close()


class VerifyingReader(io.RawIOBase):
    """``size`` bytes of ``raw`` as a seekable stream whose every byte is checked against
    its block's digest when it is read, before the reader returns it. A tensor's data
    is read in one call (into the tensor it loads into: ``in_place``; or into
    torch.load's buffer): those whole blocks are hashed in the page cache, through a
    mapping of the file, each just before it is copied out, so that the copy finds the
    block in the CPU's cache and the bytes cross memory once, as in a plain read
    (hashing what a read had already copied out costs a second pass: 2.4x the
    hashing's time here; the copy's source is the byte that was checked: a file
    rewritten while it is loaded is no case this guards). A stream
    that is no local file is read, then hashed. A block torch reads in parts (an
    archive's header) is read whole once, checked, and served from memory.
    ``blocks``: (start, length) of each block ``digests`` covers, in order
    (:func:`segment_blocks`, :func:`uniform_blocks`)."""

    _CACHED_BLOCKS = 4

    def __init__(
        self,
        raw: IO[bytes],
        size: int,
        digests: bytes,
        item: Item,
        blocks: list[tuple[int, int]],
    ):
        super().__init__()
        self.raw, self.size, self.digests, self.item = raw, size, digests, item
        self.blocks = blocks
        self.starts = [start for start, _ in blocks]
        self.pos = 0
        self._cache: dict[int, bytes] = {}
        self._file = _local_file(raw) if _xxh3 is not None else None

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

    def _check(self, k: int, nblocks: int, found: bytes) -> None:
        expected = self.digests[8 * k : 8 * (k + nblocks)]
        if found != expected:
            for j in range(nblocks):
                if found[8 * j : 8 * j + 8] != expected[8 * j : 8 * j + 8]:
                    start, n = self.blocks[k + j]
                    raise mismatch(
                        self.item,
                        start,
                        start + n,
                        found[8 * j : 8 * j + 8],
                        expected[8 * j : 8 * j + 8],
                    )

    def _cached_block(self, k: int) -> bytes:
        if k not in self._cache:
            start, n = self.blocks[k]
            data = bytearray(n)
            if read_at(self.raw, start, memoryview(data)) != n:
                raise cut_short(self.item, self.size)
            self._check(k, 1, digest(data))
            if len(self._cache) >= self._CACHED_BLOCKS:
                del self._cache[next(iter(self._cache))]
            self._cache[k] = bytes(data)
        return self._cache[k]

    _digest_at = staticmethod(_digest_at)  # (the benchmark's unhashed load replaces it)

    def _read_blocks(self, dest: memoryview, k: int, j: int) -> None:
        """Blocks ``k .. j-1`` into ``dest``, every one checked."""
        start = self.blocks[k][0]
        if self._file is None:
            if read_at(self.raw, start, dest) != len(dest):
                raise cut_short(self.item, self.size)
            self._check(k, j - k, digests_of(dest, self.blocks[k:j], start))
            return
        fd, offset = self._file
        if os.fstat(fd).st_size < offset + start + len(dest):  # a map past the end: SIGBUS
            raise cut_short(self.item, self.size)
        to, found = _address(dest) - start, []
        for a, b in _windows(self.blocks, k, j):
            first, end = self.blocks[a][0], self.blocks[b - 1][0] + self.blocks[b - 1][1]
            with _mapped(fd, offset + first, end - first) as at:
                at -= first
                for s, n in self.blocks[a:b]:
                    found.append(self._digest_at(at + s, n))
                    ctypes.memmove(to + s, at + s, n)
        self._check(k, j - k, b"".join(found))

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        done = 0
        while done < n:
            p = self.pos + done
            k = bisect.bisect_right(self.starts, p) - 1
            start, length = self.blocks[k]
            if p == start and length <= n - done and k not in self._cache:
                # whole blocks from here: straight into the caller's buffer
                j, span = k, 0
                while j < len(self.blocks) and span + self.blocks[j][1] <= n - done:
                    span += self.blocks[j][1]
                    j += 1
                self._read_blocks(out[done : done + span], k, j)
                done += span
            else:
                data = self._cached_block(k)
                take = min(length - (p - start), n - done)
                out[done : done + take] = data[p - start : p - start + take]
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
