"""The save side of per-block digests: :class:`HashingStream` passes DCP's writes to
the file and digests the bytes as they go (one helper thread hashes a tensor's data
beside its write and the writes after it), :class:`Digests` carries the result to the
coordinator that writes the manifest. Blocks are laid out as
:func:`~.blocks.segment_blocks` says, so that a load meets whole blocks."""

from __future__ import annotations

import io
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from boost_titan.checkpoint.integrity.blocks import BLOCK, segment_digests

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
