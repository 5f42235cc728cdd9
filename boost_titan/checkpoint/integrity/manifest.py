"""A step's manifest, ``.manifest.json``: what its save wrote, byte for byte.

Written by the save, atomically (tmp + fsync + rename), before ``.metadata`` (DCP) or
after the last weight file (Hugging Face) is in place; read first by every load. Lines
of JSON (``boost_titan.seal/2``):

1. the header: ``{"seal": "boost_titan.seal/2", "algorithm": "xxh3_64", "bytes": N,
   "digest": D}``, D the xxh3_64 of the root's N bytes (so the root is checked before
   it is parsed);
2. the root: ``{"kind": "dcp"|"hf", "step": S, "save_id": U, "run_id": R, "block": 1048576,
   "files": {NAME: [BYTES, DIGESTS or null]}, "sections": {FILE: [START, BYTES, DIGEST,
   COUNT]}, "sections_bytes": T, "states": [KEY, ...]}``: S the N of the ``step-N``
   folder it was saved as (null when saved elsewhere), U the save's id (DCP's ``save_id``, also in
   ``.metadata``), R the id of the run whose checkpoint folder it was saved into
   (``checkpoint.run_id``; null, or absent in manifests written before run ids, when
   there was none), every file of the step with its size (and its digests when no item
   covers it: ``.metadata``, a Hugging Face folder's files), and for each DCP data file
   where its section lies (START bytes after the root's line, BYTES long, its xxh3_64
   DIGEST) and how many items it lists (a file with no item has none); T the bytes of
   all sections (each ends in a newline), to the end of the file; KEY the top-level
   keys of the state dict saved (``model``, ``optimizer``, ...: what the launch check
   asks of a step without unpickling ``.metadata``; absent in manifests from before);
3. one section per data file, one line each: ``[[FQN, CHUNK, FILE, OFFSET, LENGTH,
   SEGMENTS, DIGESTS], ...]``, every DCP item of that file with its FQN, its chunk's
   offset in the tensor (null for a pickled item), where it lies, the lengths of the
   segments its blocks are cut over (a tensor's data is one, the archive's header and
   tail others: ``writing.HashingStream``) and one digest per block of them
   (``blocks.segment_blocks``: ``block`` bytes from each segment's start, its last 64
   KiB apart; hex, 16 characters each). A file's digests lay the blocks over it as over
   one segment.

A rank's load reads the header and the root, then only the sections of the files its
load plan reads (``step.open_step``, ``Step.reading``): what it parses grows with its
share of the step, not with the world. Each rank encodes its own files' sections and
their digests (``dcp_hooks``, :func:`sections_part`); the coordinator only joins the
bytes. ``boost_titan.seal/1`` manifests (saved before: one body, the root's fields
with every item under ``"items"``, its digest in the header) are still read, whole.

Only JSON is parsed here, never a pickle."""

from __future__ import annotations

import json
import os
import re

from boost_titan.checkpoint.integrity.blocks import ALGORITHM, digest
from boost_titan.checkpoint.integrity.entries import (  # noqa: F401  (the format's names)
    NAME,
    SEAL,
    SEAL_1,
    SEALS,
    FileEntry,
    ItemEntry,
    Seal,
    Section,
    add_items,
    as_json,
    fields_of,
    gc_paused,
    header,
    key,
    mismatch,
    nonneg,
    sections_of,
)

METADATA = ".metadata"
_STEP = re.compile(r"step-(\d+)")


def step_of(folder_name: str) -> int | None:
    """N of a ``step-N`` folder name (also of the temporary name an export or import
    writes it under, ``.step-N.<hex>.tmp``: ``checkpoint.files.new_tmp``)."""
    m = re.fullmatch(r"\.?(step-\d+)(?:\.[0-9a-f]+\.tmp)?", folder_name)
    return int(_STEP.fullmatch(m[1])[1]) if m else None


def items_part(entries) -> bytes:
    """Item entries as JSON between ``[`` and ``]``."""
    rows = [
        [i.fqn, None if i.chunk is None else list(i.chunk), i.file, i.offset, i.length]
        + [list(i.segments), i.digests.hex()]
        for i in entries
    ]
    return json.dumps(rows, separators=(",", ":")).encode()[1:-1]


def sections_part(entries) -> dict[str, tuple[bytes, str, int]]:
    """The sections of the items ``entries`` (sorted by file and offset): for each
    file, (its section's bytes, their digest, its items). A rank makes its own
    (``dcp_hooks``), so that the coordinator only joins the ranks' bytes."""
    by_file: dict[str, list] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    out = {}
    for name, group in by_file.items():
        data = b"[" + items_part(group) + b"]"
        out[name] = (data, digest(data).hex(), len(group))
    return out


def encode(seal: Seal) -> bytes:
    with gc_paused():
        entries = sorted(seal.items.values(), key=lambda i: (i.file, i.offset))
        return encode_parts(seal, [sections_part(entries)])


def _root_fields(seal: Seal) -> dict:
    fields = {
        "kind": seal.kind,
        "step": seal.step,
        "save_id": seal.save_id,
        "run_id": seal.run_id,
        "block": seal.block,
        "files": {
            name: [f.bytes, None if f.digests is None else f.digests.hex()]
            for name, f in sorted(seal.files.items())
        },
    }
    if seal.states is not None:
        fields["states"] = list(seal.states)
    return fields


def _headed(body: bytes, seal: str = SEAL) -> bytes:
    top = {"seal": seal, "algorithm": ALGORITHM, "bytes": len(body), "digest": digest(body).hex()}
    return json.dumps(top, separators=(",", ":")).encode() + b"\n" + body + b"\n"


def encode_parts(seal: Seal, parts: list[dict]) -> bytes:
    """The manifest of ``seal`` (its ``items`` ignored) with the sections ``parts`` hold
    (:func:`sections_part`, one per rank), joined as bytes; the root's digest taken over
    its bytes, in C."""
    sections, chunks, at = {}, [], 0
    for part in parts:
        for name, (data, hexdigest, count) in (part or {}).items():
            if name in sections:
                raise ValueError(f"two ranks wrote sections of {name}")
            sections[name] = [at, len(data), hexdigest, count]
            chunks += [data, b"\n"]
            at += len(data) + 1
    root = {**_root_fields(seal), "sections": sections, "sections_bytes": at}
    return _headed(json.dumps(root, separators=(",", ":")).encode()) + b"".join(chunks)


def encode_v1(seal: Seal) -> bytes:
    """``seal`` as a ``boost_titan.seal/1`` manifest (one body with every item), as
    saves wrote before seal/2."""
    entries = sorted(seal.items.values(), key=lambda i: (i.file, i.offset))
    head = json.dumps({**_root_fields(seal), "items": []}, separators=(",", ":")).encode()
    return _headed(head[:-2] + items_part(entries) + b"]}", SEAL_1)


def _body(body: bytes, following: bytes, nbytes: int, expected: str, bad, held: int):
    """The fields of a body (seal/1) or root (seal/2) of ``nbytes``, followed by its
    newline, checked against the header's digest before it is parsed."""
    if len(body) != nbytes or following != b"\n":
        raise bad(f"is cut or extended: its header gives {nbytes} bytes of body, it holds {held}")
    found = digest(body).hex()
    if found != expected:
        raise bad(f"body has {ALGORITHM} {found} where its header records {expected}")
    return as_json(body)


def decode_root(root: bytes, following: bytes, nbytes: int, expected: str, after: int, bad):
    """A seal/2 manifest's root (``root``, the byte after it, and ``after``: the bytes of
    the file after the root's newline), checked; its sections not read."""
    fields = _body(root, following, nbytes, expected, bad, len(root) + len(following) - 1)
    seal = fields_of(fields, bad, "sections")
    total = fields.get("sections_bytes")
    if not nonneg(total):
        raise bad("body is not the JSON a save writes")
    if total != after:
        raise bad(f"is cut or extended: its root gives {total} bytes of sections, it holds {after}")
    seal.sections = sections_of(fields["sections"], seal, bad)
    for name, s in seal.sections.items():
        if s.start + s.bytes >= total:
            raise bad(f"root puts the section of {name[:120]!r} past its end")
    return seal


def load_section(seal: Seal, file: str, bad) -> None:
    """The items of ``file``'s section (seal/2) into ``seal.items``, its bytes checked
    against the root's digest before they are parsed."""
    s = seal.sections[file]
    data = seal.read(s.start, s.bytes, bad)
    found = digest(data)
    if len(data) != s.bytes or found != s.digest:
        raise bad(
            f"section of {file}: {ALGORITHM} {found.hex()} ({len(data)} bytes) where its root "
            f"records {s.digest.hex()} ({s.bytes} bytes)"
        )
    raw = as_json(data)
    if not isinstance(raw, list) or len(raw) != s.count:
        raise bad(f"section of {file} is not the list of {s.count} items its root records")
    with gc_paused():
        add_items(seal, raw, bad, file)
    seal.loaded.add(file)


def load_all(seal: Seal, bad) -> None:
    """Every section not read yet (``verify``: the whole step)."""
    for name in sorted(seal.sections or ()):
        if name not in seal.loaded:
            load_section(seal, name, bad)


def decode(data: bytes, folder: str, tail: str = "") -> Seal:
    """The whole manifest ``data`` (either layout), every part checked against its
    digest before it is parsed; one line naming what is wrong otherwise."""
    with gc_paused():
        bad = mismatch(folder, tail)
        head_line, sep, rest = data.partition(b"\n")
        nbytes, expected, seal = header(head_line, SEALS, bad)
        if not sep:
            raise bad(f"is cut or extended: its header gives {nbytes} bytes of body, it holds 0")
        if seal == SEAL_1:
            fields = _body(rest[:nbytes], rest[nbytes:], nbytes, expected, bad, len(rest))
            out = fields_of(fields, bad, "items")
            add_items(out, fields["items"], bad)
            return out
        base = nbytes + 1
        out = decode_root(rest[:nbytes], rest[nbytes:base], nbytes, expected, len(rest) - base, bad)
        out.read = lambda start, n, _bad: rest[base + start : base + start + n]
        load_all(out, bad)
        out.sections, out.read = None, None
        return out


def write(folder: str, seal: Seal, sync: bool = True, parts: list[dict] | None = None) -> None:
    """``folder/.manifest.json``, whole or not at all (its sections from ``parts`` when
    given: :func:`encode_parts`)."""
    final = os.path.join(folder, NAME)
    tmp = final + ".tmp"
    with open(tmp, "wb") as f:
        f.write(encode(seal) if parts is None else encode_parts(seal, parts))
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, final)
