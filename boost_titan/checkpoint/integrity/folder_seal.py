"""Sealing a folder of plain files (a Hugging Face save, ``last_save_in_hf``): its
manifest lists every file with its size and one xxh3_64 per MiB, so that ``verify`` and
every load check it as they do a DCP step (``step.open_step``)."""

from __future__ import annotations

import os
import uuid

from boost_titan.checkpoint.integrity import manifest as mf
from boost_titan.checkpoint.integrity.blocks import BLOCK, block_digests

_CHUNK = 16 * BLOCK


def file_digests(path: str) -> tuple[int, bytes]:
    """(size, digests) of the file at ``path``, read once."""
    digests = bytearray()
    size = 0
    buf = memoryview(bytearray(_CHUNK))
    with open(path, "rb") as f:
        while True:
            n = 0
            while n < len(buf) and (got := f.readinto(buf[n:])):
                n += got
            if not n:
                break
            digests += block_digests(buf[:n])
            size += n
    return size, bytes(digests)


def seal_folder(folder: str, step: int | None = None) -> None:
    """Write ``folder``'s manifest over every regular file in it (not in sub-folders);
    ``step``: the N it was saved as (default: from a ``step-N`` folder name)."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in (mf.NAME, mf.NAME + ".tmp") or os.path.islink(path) or not os.path.isfile(path):
            continue
        size, digests = file_digests(path)
        files[name] = mf.FileEntry(size, digests)
    if step is None:
        step = mf.step_of(os.path.basename(os.path.normpath(folder)))
    mf.write(folder, mf.Seal("hf", step, uuid.uuid4().hex, files, {}))
