"""Per-block digests of a checkpoint's bytes: one xxh3_64 per MiB of an item (or a
file), computed as the bytes stream to disk (:class:`HashingStream`) and checked as a
load reads them (:class:`VerifyingReader`), before the read returns; the one-line
:class:`ChecksumMismatch` every damaged step ends in.

Hashing runs beside the I/O: a write or read of whole blocks hands the blocks to one
helper thread (xxhash releases the GIL) while this thread writes or reads the next
ones, and the call returns only once every block it touched is checked."""

from __future__ import annotations

import io
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO

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


def digest(data) -> bytes:
    return xxhash.xxh3_64_digest(data)


def block_digests(view, block: int = BLOCK) -> bytes:
    """The digests of each ``block`` bytes of ``view`` (the last one may be short)."""
    view = memoryview(view).cast("B")
    return b"".join(digest(view[j : j + block]) for j in range(0, len(view), block))


_PARALLEL_BYTES = 2 * BLOCK  # below this, hashing inline is cheaper than a hand-off
_helper_pool: tuple[int, ThreadPoolExecutor] | None = None
_helper_lock = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    """One hashing thread per process (a forked child makes its own)."""
    global _helper_pool
    with _helper_lock:
        if _helper_pool is None or _helper_pool[0] != os.getpid():
            pool = ThreadPoolExecutor(1, thread_name_prefix="boost_titan-xxh3")
            _helper_pool = (os.getpid(), pool)
        return _helper_pool[1]


# ---------------------------------------------------------------- writing


class HashingStream:
    """Passes every write to ``out`` and digests the bytes, block by block from the first
    byte written through it; :meth:`digests` when done."""

    def __init__(self, out):
        self.out = out
        self._digests = bytearray()
        self._block = xxhash.xxh3_64()
        self._filled = 0  # bytes of the current block digested so far
        self.total = 0

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = view.nbytes
        i = 0
        if self._filled:
            i = min(BLOCK - self._filled, n)
            self._block.update(view[:i])
            self._filled += i
            if self._filled == BLOCK:
                self._digests += self._block.digest()
                self._block.reset()
                self._filled = 0
        whole = (n - i) // BLOCK * BLOCK
        pending: Future | None = None
        if whole >= _PARALLEL_BYTES:  # hashed while the same bytes are written
            pending = _helper().submit(block_digests, view[i : i + whole])
        elif whole:
            self._digests += block_digests(view[i : i + whole])
        try:
            self.out.write(b)
        finally:
            if pending is not None:
                self._digests += pending.result()
        i += whole
        if i < n:
            self._block.update(view[i:])
            self._filled = n - i
        self.total += n
        return n

    def digests(self) -> bytes:
        if self._filled:
            self._digests += self._block.digest()
            self._block.reset()
            self._filled = 0
        return bytes(self._digests)

    def tell(self) -> int:
        return self.out.tell()

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name: str):
        return getattr(self.out, name)


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


def first_bad(item: Item, k: int, data: memoryview, found: bytes, expected: bytes, block: int):
    """The mismatch of the first of the blocks from ``k`` whose digest differs."""
    for j in range(0, len(found), 8):
        if found[j : j + 8] != expected[j : j + 8]:
            start = (k + j // 8) * block
            end = start + min(block, len(data) - (j // 8) * block)
            return mismatch(item, start, end, found[j : j + 8], expected[j : j + 8])
    raise AssertionError("no differing block")


class VerifyingReader(io.RawIOBase):
    """``size`` bytes of ``raw`` as a seekable stream whose every byte is checked against
    its block's digest when it is read, before the reader returns it: torch.load reads
    through it with no extra pass or copy (whole blocks straight into its buffer,
    digested by the helper thread while the next blocks are read; a block it reads in
    parts is read whole once, checked, and served from memory)."""

    _CHUNK_BLOCKS = 4  # whole blocks per read handed to the helper
    _CACHED_BLOCKS = 4

    def __init__(self, raw: IO[bytes], size: int, block: int, digests: bytes, item: Item):
        super().__init__()
        self.raw, self.size, self.block, self.digests, self.item = raw, size, block, digests, item
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

    def _expected(self, k: int, nblocks: int) -> bytes:
        return self.digests[8 * k : 8 * (k + nblocks)]

    def _check(self, k: int, data: memoryview, found: bytes) -> None:
        expected = self._expected(k, len(found) // 8)
        if found != expected:
            raise first_bad(self.item, k, data, found, expected, self.block)

    def _cached_block(self, k: int) -> bytes:
        if k not in self._cache:
            start = k * self.block
            data = bytearray(min(self.block, self.size - start))
            if read_at(self.raw, start, memoryview(data)) != len(data):
                raise cut_short(self.item, self.size)
            self._check(k, memoryview(data), digest(data))
            if len(self._cache) >= self._CACHED_BLOCKS:
                del self._cache[next(iter(self._cache))]
            self._cache[k] = bytes(data)
        return self._cache[k]

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        done, block = 0, self.block
        pending: tuple[Future | bytes, int, memoryview] | None = None

        def settle() -> None:
            nonlocal pending
            if pending is not None:
                found, k, data = pending
                pending = None
                self._check(k, data, found.result() if isinstance(found, Future) else found)

        try:
            while done < n:
                p = self.pos + done
                k, within = divmod(p, block)
                whole = min((n - done) // block, self._CHUNK_BLOCKS) if within == 0 else 0
                if whole == 0 and within == 0 and p + (n - done) == self.size:
                    whole = 1  # the last (short) block, read whole
                if whole and k not in self._cache:
                    span = min(whole * block, self.size - p)
                    dest = out[done : done + span]
                    if read_at(self.raw, p, dest) != span:
                        raise cut_short(self.item, self.size)
                    settle()  # the chunk before, hashed while this one was read
                    found = (  # hashed while the next chunk is read, if there is one
                        _helper().submit(block_digests, dest, block)
                        if n - done - span > 0
                        else block_digests(dest, block)
                    )
                    pending = (found, k, dest)
                    done += span
                else:
                    settle()
                    data = self._cached_block(k)
                    take = min(len(data) - within, n - done)
                    out[done : done + take] = data[within : within + take]
                    done += take
            settle()
        finally:
            if pending is not None and isinstance(pending[0], Future):
                pending[0].result()  # never return while the helper reads the caller's buffer
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
