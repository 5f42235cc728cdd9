"""A step folder's files, read without trusting them: the folder is a real one, each
file a regular file inside it (no link out, no FIFO: a read never blocks), its bytes
read as they are, and the manifest's header and root read before any of its sections
(:func:`read_manifest`). Each problem is one :class:`ChecksumMismatch` line."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from boost_titan.checkpoint.integrity.blocks import NOT_LOADED, ChecksumMismatch
from boost_titan.checkpoint.integrity.manifest import (
    NAME,
    SEAL_1,
    SEALS,
    Seal,
    decode,
    decode_root,
    gc_paused,
    header,
    mismatch,
)


def _problem(folder: str, what: str, tail: str) -> ChecksumMismatch:
    return ChecksumMismatch(f"checkpoint {folder} {what}{tail}")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "folder"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISLNK, "symbolic link"),
    ):
        if test(mode):
            return name
    return "special file"


def _lstat(path: str):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def check_folder(folder: str, tail: str = NOT_LOADED, allow_link: bool = False) -> None:
    st = _lstat(folder)
    if st is None:
        raise _problem(folder, "does not exist", tail)
    if stat.S_ISLNK(st.st_mode) and allow_link:
        st = _lstat(os.path.realpath(folder))
        if st is None:
            raise _problem(
                folder, f"is a symbolic link to {os.readlink(folder)}, which does not exist", tail
            )
    if stat.S_ISLNK(st.st_mode):
        raise _problem(
            folder,
            f"is a symbolic link (to {os.readlink(folder)}), not a folder: a step folder "
            "must be a real one (a link loads as a step it is not, and the next save of "
            "that step would write through it)",
            tail,
        )
    if not stat.S_ISDIR(st.st_mode):
        raise _problem(folder, f"is a {_kind(st.st_mode)}, not a step folder", tail)


def _open_regular(folder: str, name: str, tail: str) -> int | None:
    """A descriptor of ``folder/name`` (None if absent), refused unless a regular file
    (opened without following a link, without blocking on a FIFO)."""
    path = os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        kind = "symbolic link" if os.path.islink(path) else None
        if kind:
            raise _problem(
                folder, f"is refused: its {name} is a {kind}, not a regular file", tail
            ) from None
        raise _problem(
            folder, f"is damaged: its {name} cannot be read ({e.strerror})", tail
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _problem(
            folder, f"is refused: its {name} is a {_kind(mode)}, not a regular file", tail
        )
    return fd


def read_regular(folder: str, name: str, tail: str = NOT_LOADED) -> bytes | None:
    """The bytes of ``folder/name`` (None if absent), refused unless a regular file."""
    fd = _open_regular(folder, name, tail)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise _problem(
                folder, f"is damaged: its {name} cannot be read ({e.strerror})", tail
            ) from None


def _encodable(name: str) -> bool:
    """Whether ``name`` can name a file (a lone surrogate cannot: the file system call
    would raise UnicodeEncodeError)."""
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        return False
    return True


def _stat(call, path: str, folder: str, relative: str, tail: str):
    """``call(path)`` (lstat or stat) with a missing or unreadable file as the step's line."""
    try:
        return call(path)
    except FileNotFoundError:
        raise _problem(folder, f"is incomplete: {relative} is missing", tail) from None
    except OSError as e:
        raise _problem(
            folder, f"is damaged: {relative} cannot be read ({e.strerror})", tail
        ) from None


def present(folder: str, names, tail: str = NOT_LOADED) -> None:
    """Every file of ``names`` is in ``folder`` as a regular file, from one listing of
    the folder (a directory entry's type needs no call per file): what a start-up asks
    of a step at any world size. A name the listing does not show as a plain regular
    file (missing, a link, a name through subfolders, another kind) is then checked as
    :func:`member_size` checks it, whose line names what is wrong. Sizes are not
    checked here: a load checks each file's when it reads it (``Step.reading``)."""
    try:
        with os.scandir(folder) as entries:
            regular = {e.name for e in entries if e.is_file(follow_symlinks=False)}
    except OSError as e:
        raise _problem(folder, f"cannot be listed ({e.strerror or e})", tail) from None
    for name in names:
        if not (isinstance(name, str) and name in regular):
            member_size(folder, name, tail)


def member_size(folder: str, relative, tail: str = NOT_LOADED) -> int:
    """The size of the file a step's metadata names, refused unless it is a relative
    path to a regular file inside the folder."""
    if (
        not isinstance(relative, str)
        or not relative
        or os.path.isabs(relative)
        or ".." in Path(relative).parts
        or "\x00" in relative
    ):
        raise _problem(
            folder,
            f"is refused: its metadata names the file {relative!r}, not a relative path "
            "inside the step folder",
            tail,
        )
    if not _encodable(relative):
        raise _problem(
            folder,
            f"is refused: its metadata names the file {relative!r}, a name no file can have "
            "(a lone surrogate)",
            tail,
        )
    path = os.path.join(folder, relative)
    st = _stat(os.lstat, path, folder, relative, tail)
    # one lstat suffices for a plain name that is no link (DCP's __R_0.distcp): it lies in
    # the folder checked; a link, or a name through subfolders (a link among them), is
    # resolved to be checked inside it
    if stat.S_ISLNK(st.st_mode) or os.sep in relative:
        real, base = os.path.realpath(path), os.path.realpath(folder)
        if os.path.commonpath([real, base]) != base:
            raise _problem(
                folder,
                f"is refused: its metadata names {relative!r}, which resolves to {real}, "
                "outside the step folder",
                tail,
            )
        st = _stat(os.stat, path, folder, relative, tail)
    if not stat.S_ISREG(st.st_mode):
        raise _problem(
            folder, f"is refused: {relative} is a {_kind(st.st_mode)}, not a regular file", tail
        )
    return st.st_size


class _Source:
    """The bytes of a seal/2 manifest at an offset (a section), read when a load asks
    for them: the file reopened (no link, regular), the same file as at the open."""

    def __init__(self, folder: str, base: int, st):
        self.folder, self.base = folder, base
        self.signature = (st.st_ino, st.st_size, st.st_mtime_ns)

    def __call__(self, start: int, n: int, bad) -> bytes:
        fd = _open_regular(self.folder, NAME, "")
        if fd is None:
            raise bad("is gone (the step was moved or removed while it was loaded)")
        try:
            st = os.fstat(fd)
            if (st.st_ino, st.st_size, st.st_mtime_ns) != self.signature:
                raise bad("changed while the step was loaded")
            return _pread(fd, n, self.base + start, self.folder, "")
        finally:
            os.close(fd)


def _pread(fd: int, n: int, at: int, folder: str, tail: str) -> bytes:
    """``n`` bytes of ``fd`` from ``at`` (fewer at its end)."""
    out = []
    try:
        while n > 0:
            got = os.pread(fd, min(n, 1 << 30), at)
            if not got:
                break
            out.append(got)
            n, at = n - len(got), at + len(got)
    except OSError as e:
        raise _problem(
            folder, f"is damaged: its {NAME} cannot be read ({e.strerror})", tail
        ) from None
    return b"".join(out)


_FIRST = 4096  # the first read of a manifest: its header line (and a small root)


def read_manifest(folder: str, tail: str = NOT_LOADED) -> Seal | None:
    """The manifest of ``folder`` (None if it has none): a seal/2 one's header and root
    read and checked, its sections left to the reads that need them (``Step.reading``);
    a seal/1 one read whole."""
    fd = _open_regular(folder, NAME, tail)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        first = _pread(fd, _FIRST, 0, folder, tail)
        head_line, sep, _ = first.partition(b"\n")
        bad = mismatch(folder, tail)
        version = header(head_line, SEALS, bad)[2] if sep else None
        if version in (None, SEAL_1):  # (no line: decode names what is wrong)
            return decode(first + _pread(fd, st.st_size, _FIRST, folder, tail), folder, tail)
        nbytes, expected, _ = header(head_line, SEALS, bad)
        base = len(head_line) + 1
        if base + nbytes + 1 > st.st_size:
            raise bad(
                f"is cut or extended: its header gives {nbytes} bytes of body, it holds "
                f"{st.st_size - base}"
            )
        root = first[base : base + nbytes + 1]
        if len(root) < nbytes + 1:
            root = _pread(fd, nbytes + 1, base, folder, tail)
        after = st.st_size - base - nbytes - 1
        with gc_paused():
            seal = decode_root(root[:nbytes], root[nbytes:], nbytes, expected, after, bad)
        seal.read = _Source(folder, base + nbytes + 1, st)
        return seal
    finally:
        os.close(fd)
