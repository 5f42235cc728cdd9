"""Per-block digests of a checkpoint's bytes: one xxh3_64 per MiB of an item (or a
file), computed as the bytes stream to disk (:class:`HashingStream`) and checked as a
load reads them (:class:`VerifyingReader`), before the read returns; the one-line
:class:`ChecksumMismatch` every damaged step ends in.

Hashing runs beside the I/O: a write or read of whole blocks hands the blocks to one
helper thread (xxhash releases the GIL) while this thread writes or reads the next
ones, and the call returns only once every block it touched is checked."""

from __future__ import annotations

import bisect
import io
import os
import threading
from collections import deque
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


SEGMENT_BYTES = 64 * 1024  # a write this long (a tensor's data) is a segment of its own
_PARALLEL_BYTES = 2 * BLOCK  # below this, hashing inline is cheaper than a hand-off
_BACKLOG_BYTES = 256 << 20  # bytes written but not yet hashed, at most
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


def digests_of(view, blocks: list[tuple[int, int]], base: int = 0) -> bytes:
    """The digests of ``blocks`` (absolute (start, length)) of an item whose bytes from
    ``base`` on are in ``view``."""
    view = memoryview(view).cast("B")
    return b"".join(digest(view[s - base : s - base + n]) for s, n in blocks)


def segment_digests(view, block: int = BLOCK) -> bytes:
    """The digests of one segment (a write, a file, ``.metadata``), laid out as
    :func:`segment_blocks` cuts it."""
    return digests_of(view, segment_blocks([len(memoryview(view).cast("B"))], block))


# ---------------------------------------------------------------- writing


class _Backlog:
    """Hashes running in the helper thread after their write returned (a tensor's bytes,
    kept alive until hashed), at most ``_BACKLOG_BYTES`` of them at once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running: deque[tuple[Future, int]] = deque()
        self.bytes = 0

    def submit(self, view: memoryview, keep) -> Future:
        holder = [keep]  # the bytes' owner, released once they are hashed
        future = _helper().submit(segment_digests, view)
        future.add_done_callback(lambda _f: holder.clear())
        with self.lock:
            self.running.append((future, len(view)))
            self.bytes += len(view)
            while self.running and (self.running[0][0].done() or self.bytes > _BACKLOG_BYTES):
                oldest, n = self.running.popleft()
                self.bytes -= n
                self.lock.release()
                try:
                    oldest.result()
                finally:
                    self.lock.acquire()
        return future


_backlog = _Backlog()


def _owned(view: memoryview, keep) -> bool:
    """Whether ``view``'s bytes stay what they are after the write returns, as long as
    ``keep`` lives: a view of a BytesIO's buffer (DCP's pickled items), or of a CPU
    tensor's storage (torch.save writes a storage from its memory)."""
    if isinstance(keep, io.BytesIO):
        return view.obj is keep or getattr(view.obj, "obj", None) is keep
    storage = getattr(keep, "untyped_storage", None)
    if storage is None or getattr(keep, "device", None) is None or keep.device.type != "cpu":
        return False
    import numpy as np

    start = storage().data_ptr()
    at = np.frombuffer(view, dtype=np.uint8).ctypes.data
    return start <= at and at + len(view) <= start + storage().nbytes()


class Digests:
    """An item's digests as its write left them: its segments' lengths and, in order,
    digests or the helper's futures of them (:meth:`resolve` waits for the latter)."""

    def __init__(self, segments: list[int], parts: list):
        self.segments, self.parts = segments, parts

    def resolve(self) -> tuple[list[int], bytes]:
        return self.segments, b"".join(
            p.result() if isinstance(p, Future) else p for p in self.parts
        )

    def __reduce__(self):
        # DCP gathers every rank's write results on the coordinator (after the files are
        # written and synced): they travel resolved
        return (tuple, (self.resolve(),))


class HashingStream:
    """Passes every write to ``out`` and digests the bytes: a write of at least
    ``SEGMENT_BYTES`` (a tensor's data) is a segment of its own, hashed by the helper
    thread while it is written and after (its owner ``keep`` held until then); a run of
    smaller writes between (an archive's header or tail) is a segment, hashed when it
    ends. :func:`segment_blocks` lays the blocks over the segments, so a reader of the
    tensor's data meets whole blocks. :meth:`finish` gives the :class:`Digests`."""

    def __init__(self, out, keep=None):
        self.out, self.keep = out, keep
        self.segments: list[int] = []
        self.parts: list = []
        self._run = bytearray()  # the current run of small writes

    def _close_run(self) -> None:
        if self._run:
            self.parts.append(segment_digests(self._run))
            self.segments.append(len(self._run))
            self._run = bytearray()

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = view.nbytes
        if n < SEGMENT_BYTES:
            self._run += view
            self.out.write(b)
            return n
        self._close_run()
        self.segments.append(n)
        if n < _PARALLEL_BYTES:
            self.parts.append(segment_digests(view))
        elif _owned(view, self.keep):  # hashed beside this write and the ones after
            self.parts.append(_backlog.submit(view, self.keep))
        else:  # hashed beside this write, done before it returns
            future = _helper().submit(segment_digests, view)
            try:
                self.out.write(b)
            finally:
                self.parts.append(future.result())
            return n
        self.out.write(b)
        return n

    def finish(self) -> Digests:
        self._close_run()
        return Digests(self.segments, self.parts)

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


class VerifyingReader(io.RawIOBase):
    """``size`` bytes of ``raw`` as a seekable stream whose every byte is checked against
    its block's digest when it is read, before the reader returns it: torch.load reads
    through it with no extra pass or copy (whole blocks straight into its buffer,
    digested by the helper thread while the next blocks are read; a block it reads in
    parts, an archive's header, is read whole once, checked, and served from memory).
    ``blocks``: (start, length) of each block ``digests`` covers, in order
    (:func:`segment_blocks`, :func:`uniform_blocks`)."""

    _CHUNK_BYTES = 4 * BLOCK  # whole blocks per read handed to the helper
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

    def readinto(self, b) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        done = 0
        pending: tuple[Future | bytes, int, int] | None = None

        def settle() -> None:
            nonlocal pending
            if pending is not None:
                found, k, count = pending
                pending = None
                self._check(k, count, found.result() if isinstance(found, Future) else found)

        try:
            while done < n:
                p = self.pos + done
                k = bisect.bisect_right(self.starts, p) - 1
                start, length = self.blocks[k]
                if p == start and length <= n - done and k not in self._cache:
                    # whole blocks from here: straight into the caller's buffer
                    j, span = k, 0
                    while (
                        j < len(self.blocks)
                        and span + self.blocks[j][1] <= n - done
                        and (span == 0 or span + self.blocks[j][1] <= self._CHUNK_BYTES)
                    ):
                        span += self.blocks[j][1]
                        j += 1
                    dest = out[done : done + span]
                    if read_at(self.raw, p, dest) != span:
                        raise cut_short(self.item, self.size)
                    settle()  # the chunk before, hashed while this one was read
                    chunk = self.blocks[k:j]
                    found = (  # hashed while the next chunk is read, if there is one
                        _helper().submit(digests_of, dest, chunk, p)
                        if n - done - span > 0
                        else digests_of(dest, chunk, p)
                    )
                    pending = (found, k, j - k)
                    done += span
                else:
                    settle()
                    data = self._cached_block(k)
                    take = min(length - (p - start), n - done)
                    out[done : done + take] = data[p - start : p - start + take]
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
