"""One run per checkpoint folder: a run holds an exclusive ``flock`` on
``<checkpoint folder>.lock`` (beside the folder, ``outputs/run/checkpoint.lock`` for
the default one) from the moment its checkpoint manager is built until it ends.

Two runs on one folder overwrite, set aside and load each other's steps (issue #48:
a second run started 25 s after the first renamed the first's step in progress to
``step_30.incomplete``, loaded one of its steps, and the first died on ENOENT). The
second one is now refused at start-up, before it renames, sets aside or loads
anything, on one line naming the folder and the holder (host, pid, start time: the
holder writes them into the lock file).

Why these choices:

* **flock, held by a process that lives for the run**: the kernel releases it when
  the process ends, however it ends (SIGKILL, OOM killer, a node reboot), so a dead run
  never leaves the folder locked and there is nothing to clean up. The lock file stays
  (deleting it would let a run lock a new file while another holds the old one).
* **beside the folder, not inside it**: the checkpoint folder's existence means
  something to torchtitan (it exists: resume from it; it does not: load
  ``initial_load_path`` or the Hugging Face weights), and a ``load_only`` run must
  leave it untouched; a lock file inside would create it at every start.
* **global rank 0 takes it** (``checkpoint.manager``), not each node's local rank 0:
  rank 0 is the one rank that renames, sets aside and purges steps and writes
  ``.metadata``, and the folder is one shared folder for every node (DCP needs that),
  so a lock per node would refuse the second node of the very run that holds it. Rank
  0 broadcasts the outcome and every rank stops on the same line: none is left
  waiting in a collective.
* **children do not keep it**: a process forked after the lock is taken (a data loader
  worker) would share the lock and could hold it for seconds after the run died; the
  fork handler closes its copy (the lock stays the parent's). A child that execs
  (``subprocess``, a spawned process) never has it (the descriptor is close-on-exec).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass

SUFFIX = ".lock"


class FolderRefused(SystemExit):
    """This run may not use the checkpoint folder (another run holds it, its lock file
    cannot be taken, or its run record is unreadable): one line, exit 1, no traceback."""

    def __init__(self, line: str):
        super().__init__(1)
        self.line = line

    def __str__(self) -> str:
        return self.line


def lock_path(folder: str) -> str:
    """The lock file of checkpoint folder ``folder``: beside it, its name + ``.lock``."""
    return os.path.normpath(os.path.abspath(folder)) + SUFFIX


@dataclass
class FolderLock:
    folder: str
    path: str
    fd: int | None  # None: released (or the file system has no locks)

    def release(self) -> None:
        if self.fd is not None:
            _held.pop(self.fd, None)
            os.close(self.fd)  # the last descriptor of the open file: the lock goes
            self.fd = None


_held: dict[int, FolderLock] = {}  # this process's locks, by descriptor


def _close_in_child() -> None:
    """After a fork: the child's copies of the locked descriptors closed (closing
    releases nothing while the parent keeps its own; never LOCK_UN here: that would
    release the parent's lock, which is the same open file)."""
    for fd, held in list(_held.items()):
        held.fd = None
        try:
            os.close(fd)
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _holder(fd: int) -> str:
    """What the holder wrote into the lock file, as words for the refusal line."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw)
        return f"host {info['host']}, pid {info['pid']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its host and pid not yet written (it is starting)"


def _refused(path: str, what: str) -> FolderRefused:
    return FolderRefused(
        f"checkpoint lock file {path} {what}: a run holds its checkpoint folder only through "
        "that file, and does not start without it. Make it a plain file this user may write "
        "(or remove it), or give this run another --job.dump_folder"
    )


def _open(path: str) -> int:
    """The lock file's descriptor, refused (one line) unless it is a regular file of its
    own: never through a symbolic link (the record would overwrite its target), never a
    FIFO or device (``O_NONBLOCK``: opening one does not wait for a writer), never a
    file with other names (a hard link to a user's file)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP and os.path.islink(path):
            raise _refused(path, "is a symbolic link") from None
        raise _refused(path, f"cannot be made or opened ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
        if stat.S_ISREG(st.st_mode):
            what = f"a file with {st.st_nlink} names (hard links)"
        raise _refused(path, f"is {what}")
    return fd


def acquire(folder: str) -> FolderLock:
    """Hold ``folder``'s lock for the life of this process (or until ``release``); raise
    :class:`FolderRefused` naming the holder if another process holds it, and naming the
    lock file and what is wrong with it if it cannot be taken (fail closed: a run that
    cannot lock its folder does not start). Where the file system has no locks (some
    network mounts), a lock that is not held (fd None): the caller warns."""
    path = lock_path(folder)
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
        os.close(fd)
        if holder is None:
            if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                return FolderLock(folder, path, None)
            raise _refused(path, f"cannot be locked ({e.strerror})") from None
        raise FolderRefused(
            f"checkpoint folder {folder} is in use by another run ({holder}; lock file "
            f"{path}): two runs on one folder set aside, load and delete each other's "
            "steps. Wait until that run ends, or give this one another --job.dump_folder"
        ) from None
    started = time.strftime("%Y-%m-%d %H:%M:%S %z")
    record = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started})
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode() + b"\n", 0)
    except OSError as e:
        os.close(fd)
        raise _refused(path, f"cannot be written ({e.strerror})") from None
    lock = FolderLock(folder, path, fd)
    _held[fd] = lock
    return lock
