"""The files the data commands read and the folders they write, taken as they are, not
as they are named: a FIFO, a device or a folder where a regular file is expected is one
line (never an ``open`` that blocks forever on a FIFO), and a folder written into is
compared with the folders read by where they really are (symbolic links resolved), so
that a command never writes into, or removes from, the data it reads.

Every refusal is a :class:`~boost_titan.data.local_text.CorpusError`: one line naming
the path and what it is."""

from __future__ import annotations

import fcntl
import os
import stat

from boost_titan.data.local_text import CorpusError


def kind(mode: int) -> str:
    """What a file of ``mode`` is, in the words a refusal uses."""
    for test, name in (
        (stat.S_ISDIR, "is a directory"),
        (stat.S_ISFIFO, "is a FIFO"),
        (stat.S_ISCHR, "is a character device"),
        (stat.S_ISBLK, "is a block device"),
        (stat.S_ISSOCK, "is a socket"),
    ):
        if test(mode):
            return name
    return "is not a regular file"


def open_regular(path: str, what: str = "") -> int:
    """A read-only descriptor of ``path``, refused in one line unless it is a regular
    file. Opened with ``O_NONBLOCK`` (a FIFO's open returns at once instead of waiting
    for a writer), checked with ``fstat`` (the file opened, not a name that may change
    between a check and the open), then made blocking again."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CorpusError(f"{what}{path} does not exist") from None
    except OSError as e:
        raise CorpusError(f"{what}cannot open {path}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CorpusError(f"{what}{path} {kind(mode)}, not a regular file")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def read_regular(path: str, what: str = "") -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`)."""
    with os.fdopen(open_regular(path, what), "rb") as f:
        return f.read()


def regular_size(path: str, what: str = "") -> int:
    """The size of the regular file ``path``, refused like :func:`open_regular`."""
    fd = open_regular(path, what)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def real(path: str) -> str:
    """``path`` with every symbolic link resolved (a path that does not exist yet: its
    existing part resolved)."""
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def overlap(out: str, source: str) -> str | None:
    """How the folder ``out`` and the file or folder ``source`` overlap once resolved
    ("is", "is inside", "holds"), or None when neither holds the other."""
    a, b = real(out), real(source)
    if a == b:
        return "is"
    if os.path.commonpath([a, b]) == b:
        return "is inside"
    if os.path.commonpath([a, b]) == a:
        return "holds"
    return None
