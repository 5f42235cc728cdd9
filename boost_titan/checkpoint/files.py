"""Writing files and folders that appear whole or not at all; reading safetensors files
that may not be whole.

Every command that writes a checkpoint, an export or a Hugging Face folder writes into a
temporary name beside the target and renames it into place when complete.

A safetensors file cut short, or with a damaged header (a header length of 2^60, tensor
offsets past the end), makes ``safetensors`` raise its ``SafetensorError`` with a message
that names no file; :func:`open_safetensors` and :func:`load_safetensors` raise
:class:`DamagedSafetensorsError` instead (a ValueError: the commands' one line), naming
the file, its size and what is wrong with it."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def new_tmp(target: Path, *, folder: bool) -> Path:
    """A new temporary file or folder beside ``target``, to be renamed onto it, created
    as a plain write creates one (0666 / 0777 less the umask): ``tempfile.mkstemp`` and
    ``mkdtemp`` make theirs 0600 / 0700, and the rename would carry that to the output."""
    while True:
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            if folder:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:  # another export's temporary name: draw again
            continue


class DamagedSafetensorsError(ValueError):
    """A safetensors file that cannot be read: cut short, or a damaged header."""


def _damaged(path: str | os.PathLike, e: Exception) -> DamagedSafetensorsError:
    try:
        size = f"{os.path.getsize(path):,} bytes"
    except OSError:
        size = "unreadable"
    why = str(e).removeprefix("Error while deserializing header: ")
    return DamagedSafetensorsError(
        f"{str(path)!r} ({size}) is not a readable safetensors file, cut short or damaged: {why}"
    )


@contextlib.contextmanager
def open_safetensors(path: str | os.PathLike) -> Iterator:
    """``safetensors.safe_open(path, framework="pt")``; a damaged file (when opened or
    read) raises :class:`DamagedSafetensorsError`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise _damaged(path, e) from None


def load_safetensors(path: str | os.PathLike) -> dict:
    """``safetensors.torch.load_file(path)``; a damaged file raises
    :class:`DamagedSafetensorsError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise _damaged(path, e) from None
