"""The temporary folder a conversion writes its step into, beside ``--to``: ours alone,
and gone on every way out but the rename.

A conversion writes for minutes to hours (2.6 GB at 1B): a run stopped by Ctrl-C, by an
exception or by SIGTERM / SIGHUP (turned into :class:`Stopped`, which unwinds like an
exception) removes its folder; only SIGKILL (or a power cut) leaves one. So that a later
run can tell such a leftover from anything else, the folder holds a marker while it is
written, :data:`MARKER`: which command wrote it, for which output, on which host, and a
``flock`` the writer holds until it exits (the kernel drops it when the process dies).
A new run for the same ``--to`` removes a leftover only when all of that proves it is a
dead conversion's: the name is ours (``.NAME.XXXXXXXX.tmp``), the folder and the marker
are no links, the marker names this command, this output and this host, and its lock
is free. Anything else beside ``--to`` is left alone. The marker is removed just before
the rename: the step folder holds only the step's files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

MARKER = ".from_dense.in_progress"
WRITER = "boost-titan checkpoint from-dense"
_MAX_MARKER = 4096


class Stopped(BaseException):
    """SIGTERM or SIGHUP during a conversion: unwinds like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread (default: the process
    dies where it is, its ``finally`` blocks never run)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Stopped(signum)

    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _record(out: Path) -> dict:
    return {"written_by": WRITER, "output": str(out.resolve()), "host": socket.gethostname()}


def _ours(folder: Path, out: Path) -> bool:
    """Whether ``folder`` is the leftover of a dead conversion to ``out`` (module doc)."""
    try:
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return False
        fd = os.open(folder / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            record = json.loads(os.read(fd, _MAX_MARKER + 1)[:_MAX_MARKER])
        except ValueError:
            return False
        if not isinstance(record, dict) or {k: record.get(k) for k in _record(out)} != _record(out):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its writer is alive
            return False
        return True
    finally:
        os.close(fd)


def remove_leftovers(out: Path) -> list[Path]:
    """Removes the folders dead conversions to ``out`` left beside it; returns them."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[0-9a-f]{{8}}\.tmp")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(out.parent):
            path = Path(entry.path)
            if pattern.fullmatch(entry.name) and _ours(path, out):
                shutil.rmtree(path)
                removed.append(path)
    return removed


class Scratch:
    """Our temporary folder for ``out`` (:func:`scratch`); :meth:`commit` renames it."""

    def __init__(self, path: Path, out: Path, marker_fd: int):
        self.path, self.out, self._fd = path, out, marker_fd

    def commit(self) -> None:
        os.unlink(self.path / MARKER)
        os.replace(self.path, self.out)


@contextlib.contextmanager
def scratch(out: Path) -> Iterator[Scratch]:
    """A new marked temporary folder beside ``out``, removed on every exit unless
    committed; SIGTERM / SIGHUP raise :class:`Stopped` meanwhile."""
    from boost_titan.checkpoint.files import new_tmp

    for path in remove_leftovers(out):
        print(f"removed {path}, left by a from-dense run that was killed", file=sys.stderr)
    with signals_raise():
        tmp = fd = None
        try:
            tmp = new_tmp(out, folder=True)
            flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW
            fd = os.open(tmp / MARKER, flags, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps({**_record(out), "pid": os.getpid()}).encode())
            yield Scratch(tmp, out, fd)
        finally:
            if fd is not None:
                os.close(fd)
            if tmp is not None and tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
