"""Sealing a folder of plain files (a Hugging Face save, ``last_save_in_hf``): its
manifest lists every file with its size and digests, so that ``verify`` and every load
check it as they do a DCP step (``step.open_step``)."""

from __future__ import annotations

import os
import uuid

from boost_titan.checkpoint import run_id
from boost_titan.checkpoint.integrity import manifest as mf
from boost_titan.checkpoint.integrity.blocks import digest, read_at, segment_blocks


def file_digests(path: str) -> tuple[int, bytes]:
    """(size, digests) of the file at ``path``, read once, its blocks laid out as over
    one segment (``blocks.segment_blocks``)."""
    size = os.path.getsize(path)
    digests = bytearray()
    with open(path, "rb") as f:
        for start, n in segment_blocks([size]):
            data = bytearray(n)
            if read_at(f, start, memoryview(data)) != n:
                raise OSError(f"{path} changed while it was sealed")
            digests += digest(data)
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
    run = run_id.of_steps_in(folder)  # the checkpoint folder's run, as a DCP step's
    mf.write(folder, mf.Seal("hf", step, uuid.uuid4().hex, files, {}, run_id=run))
