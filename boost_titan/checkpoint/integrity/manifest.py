"""A step's manifest, ``.manifest.json``: what its save wrote, byte for byte.

Written by the save, atomically (tmp + fsync + rename), before ``.metadata`` (DCP) or
after the last weight file (Hugging Face) is in place; read first by every load. Two
lines of JSON:

1. the header: ``{"seal": "boost_titan.seal/1", "algorithm": "xxh3_64", "bytes": N,
   "digest": D}``, D the xxh3_64 of the body's N bytes (so the body is checked before
   it is parsed);
2. the body: ``{"kind": "dcp"|"hf", "step": S, "save_id": U, "run_id": R, "block": 1048576,
   "files": {NAME: [BYTES, DIGESTS or null]}, "items": [[FQN, CHUNK, FILE, OFFSET,
   LENGTH, SEGMENTS, DIGESTS]]}``: S the N of the ``step-N`` folder it was saved as (null when
   saved elsewhere), U the save's id (DCP's ``save_id``, also in ``.metadata``), R the
   id of the run whose checkpoint folder it was saved into (``checkpoint.run_id``;
   null, or absent in manifests written before run ids, when there was none),
   every file of the step with its size (and its digests when no item covers it:
   ``.metadata``, a Hugging Face folder's files), and every DCP item with its FQN, its
   chunk's offset in the tensor (null for a pickled item), where it lies, the lengths
   of the segments its blocks are cut over (a tensor's data is one, the archive's
   header and tail others: ``writing.HashingStream``) and one digest per block of
   them (``blocks.segment_blocks``: ``block`` bytes from each segment's start, its last
   64 KiB apart; hex, 16 characters each). A file's digests lay the blocks over it as
   over one segment.

Only JSON is parsed here, never a pickle."""

from __future__ import annotations

import gc
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

from boost_titan.checkpoint import run_id as run_ids
from boost_titan.checkpoint.integrity.blocks import (
    ALGORITHM,
    BLOCK,
    ChecksumMismatch,
    block_count,
    digest,
)

SEAL = "boost_titan.seal/1"
NAME = ".manifest.json"
METADATA = ".metadata"
_STEP = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class FileEntry:
    bytes: int
    digests: bytes | None  # None: a DCP data file, covered by its items


class ItemEntry(NamedTuple):  # (a tuple: a load builds one per item, millions of them)
    fqn: str
    chunk: tuple[int, ...] | None
    file: str
    offset: int
    length: int
    segments: tuple[int, ...]
    digests: bytes


@dataclass
class Seal:
    kind: str  # "dcp" | "hf"
    step: int | None
    save_id: str | None
    files: dict[str, FileEntry]
    items: dict[tuple[str, tuple[int, ...] | None], ItemEntry]
    block: int = BLOCK
    run_id: str | None = None  # the run whose folder it was saved into (checkpoint.run_id)


@contextmanager
def gc_paused():
    """The cyclic garbage collector off for a parse that makes millions of objects and
    no cycle (a manifest's items, ``.metadata`` unpickled: at 1.6M items 24 s with it, 8 s
    without)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def key(index) -> tuple[str, tuple[int, ...] | None]:
    """A DCP MetadataIndex as the manifest keys its items (FQN, chunk offset)."""
    offset = getattr(index, "offset", None)
    return index.fqn, None if offset is None else tuple(int(x) for x in offset)


def step_of(folder_name: str) -> int | None:
    """N of a ``step-N`` folder name (also of the temporary name an export or import
    writes it under, ``.step-N.<hex>.tmp``: ``checkpoint.files.new_tmp``)."""
    m = re.fullmatch(r"\.?(step-\d+)(?:\.[0-9a-f]+\.tmp)?", folder_name)
    return int(_STEP.fullmatch(m[1])[1]) if m else None


def encode(seal: Seal) -> bytes:
    with gc_paused():
        entries = sorted(seal.items.values(), key=lambda i: (i.file, i.offset))
        return encode_parts(seal, [items_part(entries)])


def items_part(entries) -> bytes:
    """The items of a manifest's body, as JSON between ``[`` and ``]``: a rank encodes
    its own (``dcp_hooks``), so that the coordinator only joins the ranks' bytes."""
    rows = [
        [i.fqn, None if i.chunk is None else list(i.chunk), i.file, i.offset, i.length]
        + [list(i.segments), i.digests.hex()]
        for i in entries
    ]
    return json.dumps(rows, separators=(",", ":")).encode()[1:-1]


def encode_parts(seal: Seal, parts: list[bytes]) -> bytes:
    """The manifest of ``seal`` (its ``items`` ignored) with the items ``parts`` hold
    (:func:`items_part`); the body's digest taken over its bytes, in C."""
    head = json.dumps(
        {
            "kind": seal.kind,
            "step": seal.step,
            "save_id": seal.save_id,
            "run_id": seal.run_id,
            "block": seal.block,
            "files": {
                name: [f.bytes, None if f.digests is None else f.digests.hex()]
                for name, f in sorted(seal.files.items())
            },
            "items": [],
        },
        separators=(",", ":"),
    ).encode()
    assert head.endswith(b"[]}")  # (the items go between the brackets)
    body = head[:-2] + b",".join(p for p in parts if p) + b"]}"
    top = {"seal": SEAL, "algorithm": ALGORITHM, "bytes": len(body), "digest": digest(body).hex()}
    return json.dumps(top, separators=(",", ":")).encode() + b"\n" + body + b"\n"


def _nonneg(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**62


def _text(x) -> bool:
    """A name the manifest may hold: a string that is valid UTF-8 (a lone surrogate,
    which JSON can spell, cannot name a file nor be written to a log)."""
    if not isinstance(x, str):
        return False
    try:
        x.encode()
    except UnicodeEncodeError:
        return False
    return True


def _json(data: bytes):
    """JSON's value, or None for bytes that are not JSON (a nesting too deep for the
    parser, 200k ``[`` say, is not JSON a save writes either)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _hex_digests(text, blocks: int) -> bytes | None:
    """``blocks`` digests from their hex, or None if malformed."""
    if not isinstance(text, str) or len(text) != 16 * blocks:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def decode(data: bytes, folder: str, tail: str = "") -> Seal:
    """The manifest's contents, its body checked against the header's digest before it
    is parsed; one line naming what is wrong otherwise."""
    with gc_paused():
        return _decode(data, folder, tail)


def _decode(data: bytes, folder: str, tail: str) -> Seal:

    def bad(why: str) -> ChecksumMismatch:
        return ChecksumMismatch(f"checkpoint {folder} is corrupted: its {NAME} {why}{tail}")

    head_line, sep, rest = data.partition(b"\n")
    head = _json(head_line)
    try:
        nbytes, expected, seal = head["bytes"], head["digest"], head["seal"]
        algorithm = head["algorithm"]
    except (KeyError, TypeError):
        raise bad("does not start with the header line a save writes") from None
    if not _nonneg(nbytes) or not re.fullmatch(r"[0-9a-f]{16}", str(expected)):
        raise bad(
            f"header's bytes {str(nbytes)[:40]} and digest {str(expected)[:40]!r} are not "
            "what a save writes (a byte count and 16 hex digits)"
        )
    if seal != SEAL or algorithm != ALGORITHM:
        raise bad(
            f"is {repr(seal)[:60]} with {repr(algorithm)[:60]}; this boost_titan reads "
            f"{SEAL!r} with {ALGORITHM!r} (written by a newer version?)"
        )
    body = rest[:nbytes]
    if not sep or len(body) != nbytes or rest[nbytes:] != b"\n":
        raise bad(
            f"is cut or extended: its header gives {nbytes} bytes of body, it holds {len(rest)}"
        )
    found = digest(body).hex()
    if found != expected:
        raise bad(f"body has {ALGORITHM} {found} where its header records {expected}")
    fields = _json(body)
    try:
        kind, step, save_id, block = (fields[k] for k in ("kind", "step", "save_id", "block"))
        raw_files, raw_items = fields["files"], fields["items"]
        run_id = fields.get("run_id")  # (absent: a manifest from before run ids)
    except (KeyError, TypeError, AttributeError):
        raise bad("body is not the JSON a save writes") from None
    if (
        kind not in ("dcp", "hf")
        or not (step is None or _nonneg(step))
        or not (save_id is None or isinstance(save_id, str))
        or not (run_id is None or run_ids.valid(run_id))
        or not (_nonneg(block) and block > 0)
        or not isinstance(raw_files, dict)
        or not isinstance(raw_items, list)
    ):
        raise bad("body is not the JSON a save writes")
    files = {}
    for name, entry in raw_files.items():
        if not _text(name):
            raise bad(f"names the file {name[:120]!r}, which is not valid UTF-8")
        if not (isinstance(entry, list) and len(entry) == 2 and _nonneg(entry[0])):
            raise bad(f"entry of {name[:120]!r} is malformed")
        count = block_count([entry[0]], block)  # (counted: a forged size builds nothing)
        if isinstance(entry[1], str) and len(entry[1]) != 16 * count:
            raise bad(
                f"records {name[:120]!r} as {entry[0]} bytes with {len(entry[1]) // 16} "
                f"digests, where that size has {count}"
            )
        digests = None if entry[1] is None else _hex_digests(entry[1], count)
        if entry[1] is not None and digests is None:
            raise bad(f"digests of {name[:120]!r} are malformed")
        files[name] = FileEntry(entry[0], digests)
    items = {}
    ends = {name: f.bytes for name, f in files.items()}
    for entry in raw_items:
        at, item = _fast_item(entry, ends, block) or _item(entry, files, block, bad)
        if at in items:
            raise bad(f"lists item {item.fqn[:120]!r} twice")
        items[at] = item
    return Seal(kind, step, save_id, files, items, block, run_id)


def _fast_item(entry, ends: dict[str, int], block: int):
    """(key, ItemEntry) of an item entry a save writes (plain types, ASCII names, every
    segment within a block), checked as :func:`_item` checks it, in fewer steps; None
    for anything else, which :func:`_item` then checks and names."""
    if type(entry) is not list or len(entry) != 7:
        return None
    fqn, chunk, file, offset, length, segments, text = entry
    if not (
        type(fqn) is str
        and fqn.isascii()
        and type(file) is str
        and type(offset) is int
        and type(length) is int
        and offset >= 0
        and length >= 0
        and offset + length <= ends.get(file, -1)  # (file a str: it is a key of ends)
        and type(segments) is list
        and segments
        and all([type(n) is int and 0 < n <= block for n in segments])
        and sum(segments) == length
        and type(text) is str
        and len(text) == 16 * len(segments)  # (segments within a block: one digest each)
    ):
        return None
    if chunk is not None:
        if type(chunk) is not list or not all([type(x) is int and 0 <= x < 2**62 for x in chunk]):
            return None
        chunk = tuple(chunk)
    try:
        digests = bytes.fromhex(text)
    except ValueError:
        return None
    if len(digests) * 2 != len(text):  # (fromhex skips spaces)
        return None
    return (fqn, chunk), ItemEntry(fqn, chunk, file, offset, length, tuple(segments), digests)


def _item(entry, files: dict[str, FileEntry], block: int, bad):
    """(key, ItemEntry) of an item entry, or ``bad``'s line naming what is wrong."""
    ok = isinstance(entry, list) and len(entry) == 7
    if ok:
        fqn, chunk, file, offset, length, segments, text = entry
        ok = (
            _text(fqn)
            and (chunk is None or (isinstance(chunk, list) and all(map(_nonneg, chunk))))
            and isinstance(file, str)
            and file in files
            and _nonneg(offset)
            and _nonneg(length)
            and isinstance(segments, list)
            and all(_nonneg(n) and n > 0 for n in segments)
            and sum(segments) == length
        )
        # within the file's recorded size: checked before the blocks are counted
        if ok and offset + length > files[file].bytes:
            raise bad(
                f"puts item {fqn[:120]!r} at bytes {offset}..+{length} of {file}, which "
                f"its save wrote as {files[file].bytes} bytes"
            )
    digests = _hex_digests(text, block_count(segments, block)) if ok else None
    if digests is None:
        raise bad(f"item entry {ascii(entry)[:120]} is malformed")
    at = (fqn, None if chunk is None else tuple(chunk))
    return at, ItemEntry(fqn, at[1], file, offset, length, tuple(segments), digests)


def write(folder: str, seal: Seal, sync: bool = True, parts: list[bytes] | None = None) -> None:
    """``folder/.manifest.json``, whole or not at all (its items from ``parts`` when
    given: :func:`encode_parts`)."""
    final = os.path.join(folder, NAME)
    tmp = final + ".tmp"
    with open(tmp, "wb") as f:
        f.write(encode(seal) if parts is None else encode_parts(seal, parts))
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, final)
