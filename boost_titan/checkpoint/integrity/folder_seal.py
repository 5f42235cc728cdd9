"""Sealing a folder of plain files (a Hugging Face save, ``last_save_in_hf``): its
manifest lists every file with its size and digests, so that ``verify`` and every load
check it as they do a DCP step (``step.open_step``).

The hashing is spread over the ranks of a run, at save and at load: a consolidated
30B model is 60 GB of safetensors, 1-2 minutes of hashing for one rank at 0.5-1 GB/s,
past torchtitan's collective timeouts while every other rank waits. The folder's
blocks, every file laid end to end in name order, are cut into ``world`` runs of
about equal bytes (:func:`shares`): each rank hashes or checks its own run, so no rank
reads more than ``total / world`` bytes plus a block.

========================  ============================  ==========================
who                       save (``seal_folder``)         load (``check_share``)
========================  ============================  ==========================
rank 0                    lists the folder, broadcasts   its run's blocks
                          it; writes the manifest
every rank                its run's digests, then one    its run's blocks, then one
                          ``all_gather_object``          ``all_gather_object`` of
                          (8 bytes per MiB block)        its problem lines
========================  ============================  ==========================
"""

from __future__ import annotations

import os
import uuid

import torch.distributed as dist

from boost_titan.checkpoint import run_id
from boost_titan.checkpoint.integrity import manifest as mf
from boost_titan.checkpoint.integrity.blocks import BLOCK, digest, read_at, segment_blocks

Run = tuple[str, int, int]  # (file name, first block, end block): a rank's run in one file


def shares(sizes: dict[str, int], world: int, block: int = BLOCK) -> list[list[Run]]:
    """Each rank's runs of whole blocks over the files ``sizes`` (name -> bytes), laid
    end to end in name order: rank r takes the blocks that start in its r-th
    ``1/world`` of the bytes, so no rank hashes more than ``total / world + block``."""
    total = sum(sizes.values())
    out: list[list[Run]] = [[] for _ in range(world)]
    at = 0  # where the file starts, the files laid end to end
    for name in sorted(sizes):
        owner, first = None, 0
        blocks = segment_blocks([sizes[name]], block)
        for i, (start, _n) in enumerate(blocks):
            rank = min(world - 1, (at + start) * world // total)
            if rank != owner:
                if owner is not None:
                    out[owner].append((name, first, i))
                owner, first = rank, i
        if owner is not None:
            out[owner].append((name, first, len(blocks)))
        at += sizes[name]
    return out


def _digest_run(folder: str, name: str, k: int, j: int, size: int) -> bytes:
    """The digests of blocks ``k .. j-1`` of the file ``name`` (``size`` bytes), each
    block read once."""
    digests = bytearray()
    path = os.path.join(folder, name)
    with open(path, "rb") as f:
        for start, n in segment_blocks([size])[k:j]:
            data = bytearray(n)
            if read_at(f, start, memoryview(data)) != n:
                raise OSError(f"{path} changed while it was sealed")
            digests += digest(data)
    return bytes(digests)


def listing(folder: str) -> dict[str, int]:
    """The files a folder's seal covers (regular files, not the manifest, not in
    sub-folders), with their sizes."""
    sizes = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name in (mf.NAME, mf.NAME + ".tmp") or os.path.islink(path) or not os.path.isfile(path):
            continue
        sizes[name] = os.path.getsize(path)
    return sizes


def digest_share(folder: str, sizes: dict[str, int], runs: list[Run]) -> list[tuple[Run, bytes]]:
    """One rank's part of a folder's seal: each of its runs with its digests."""
    return [((name, k, j), _digest_run(folder, name, k, j, sizes[name])) for name, k, j in runs]


def join_shares(sizes: dict[str, int], parts) -> dict[str, mf.FileEntry]:
    """Every file's entry from the ranks' parts (:func:`digest_share`), in block order."""
    runs = sorted((run for part in parts for run in part), key=lambda r: (r[0][0], r[0][1]))
    digests: dict[str, bytearray] = {name: bytearray() for name in sizes}
    for (name, _k, _j), d in runs:
        digests[name] += d
    return {name: mf.FileEntry(sizes[name], bytes(digests[name])) for name in sorted(sizes)}


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def seal_folder(folder: str, step: int | None = None) -> None:
    """Write ``folder``'s manifest over every regular file in it (not in sub-folders);
    ``step``: the N it was saved as (default: from a ``step-N`` folder name). Under
    torch.distributed a collective: every rank hashes its share (module docstring);
    a rank that cannot read its share ends every rank on its line, before any
    manifest is written."""
    rank, world = _rank_world()
    box = [listing(folder) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    sizes = box[0]
    try:
        part, problem = digest_share(folder, sizes, shares(sizes, world)[rank]), None
    except OSError as e:
        part, problem = [], f"{folder} cannot be sealed: {e}"
    parts = [(part, problem)]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, (part, problem))
    problems = [p for _, p in parts if p is not None]
    if problems:
        raise OSError(problems[0])
    if rank != 0:
        return
    files = join_shares(sizes, [p for p, _ in parts])
    if step is None:
        step = mf.step_of(os.path.basename(os.path.normpath(folder)))
    run = run_id.of_steps_in(folder)  # the checkpoint folder's run, as a DCP step's
    mf.write(folder, mf.Seal("hf", step, uuid.uuid4().hex, files, {}, run_id=run))
