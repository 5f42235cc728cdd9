"""Per-block digests of a corpus part's ``.bin``: what lets a reader check the bytes it
reads, and only those, against what ``data tokenize`` / ``data seal`` wrote.

A part's ``.bin`` is cut into :data:`BLOCK`-byte blocks from its start (the last one
may be short); each block's digest is its xxh3-64 (8 bytes, big-endian: the same
function and encoding as a checkpoint's block digests,
``boost_titan.checkpoint.integrity.blocks``). The digests of a part lie back to back in
a file of the corpus folder, ``part-NNNNN.blocks`` (beside the part for a tokenized
corpus; beside ``corpus.json`` for sealed Megatron files, which stay untouched where
they are), and the manifest's entry of the part names that file with its own xxh3-128
(:func:`entry`): the manifest's digest covers the digests, which cover every byte.

Why 64 KiB: a window of the recipes is 8-32 KiB (4,097 tokens of uint16 or int32), and
a block is read whole the first time a window meets it; 64 KiB keeps that extra read
within a few windows' bytes, and its digests are 1/8,192 of the corpus (128 MiB per
TB of tokens, read a part at a time). A checkpoint's 1 MiB blocks would make every
first read 32-128 windows' worth of I/O for a shuffled reader that rarely meets a block
twice in a pass."""

from __future__ import annotations

import os
from typing import Any

import xxhash

BLOCK = 64 << 10
DIGEST = 8  # bytes of one block's digest
SUFFIX = ".blocks"


def digest(data) -> bytes:
    return xxhash.xxh3_64_digest(data)


class BlockHasher:
    """The block digests of a stream given in pieces (``update``), in order."""

    def __init__(self):
        self._pending = bytearray()
        self._digests = bytearray()

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if self._pending:  # complete the block begun before
            take = min(BLOCK - len(self._pending), len(view))
            self._pending += view[:take]
            view = view[take:]
            if len(self._pending) < BLOCK:
                return
            self._digests += digest(self._pending)
            self._pending.clear()
        whole = len(view) - len(view) % BLOCK
        for at in range(0, whole, BLOCK):
            self._digests += digest(view[at : at + BLOCK])
        self._pending += view[whole:]

    def finish(self) -> bytes:
        if self._pending:
            self._digests += digest(bytes(self._pending))
            self._pending.clear()
        return bytes(self._digests)


def count(size: int) -> int:
    """Blocks of a ``.bin`` of ``size`` bytes."""
    return -(-size // BLOCK)


def write(path: str, digests: bytes) -> dict[str, Any]:
    """``digests`` written to ``path`` (the caller's temporary name); the manifest entry
    that names the final file (``path`` without a ``.tmp.PID`` tail)."""
    with open(path, "wb") as f:
        f.write(digests)
        f.flush()
        os.fsync(f.fileno())
    name = os.path.basename(path).split(".tmp.")[0]
    return {"file": name, "bytes": BLOCK, "digest": xxhash.xxh3_128_hexdigest(digests)}


def check_entry(entry: Any) -> str | None:
    """What is wrong with a manifest's entry of a part's block digests, or None (its
    file a plain name in the corpus folder, this block size)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
        return "names no block digests (corpora written before the digests per block)"
    name = entry["file"]
    if not name or "/" in name or name in (".", ".."):
        return f"names block digests {name!r}, not a file of the corpus folder"
    if entry.get("bytes") != BLOCK or not isinstance(entry.get("digest"), str):
        return f"has block digests of {entry.get('bytes')!r} bytes; this boost_titan's are {BLOCK}"
    return None
