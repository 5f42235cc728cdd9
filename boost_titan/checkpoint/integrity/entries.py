"""The entries of a step's manifest (:mod:`.manifest`): what each holds, and the checks
of each as it is parsed (JSON only, never a pickle), each failure one line naming it.

Shared by both layouts of the manifest: ``boost_titan.seal/1`` (one body holding every
item) and ``boost_titan.seal/2`` (a small root, then one section per data file)."""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from boost_titan.checkpoint import run_id as run_ids
from boost_titan.checkpoint.integrity.blocks import ALGORITHM, BLOCK, ChecksumMismatch, block_count

NAME = ".manifest.json"
SEAL = "boost_titan.seal/2"
SEAL_1 = "boost_titan.seal/1"  # one body with every item (steps saved before seal/2)
SEALS = (SEAL_1, SEAL)


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


class Section(NamedTuple):
    """Where a data file's items lie in a seal/2 manifest, from its root."""

    start: int  # from the first byte after the root's line
    bytes: int
    digest: bytes
    count: int


@dataclass
class Seal:
    kind: str  # "dcp" | "hf"
    step: int | None
    save_id: str | None
    files: dict[str, FileEntry]
    items: dict[tuple[str, tuple[int, ...] | None], ItemEntry]
    block: int = BLOCK
    run_id: str | None = None  # the run whose folder it was saved into (checkpoint.run_id)
    # seal/2: each data file's section (None: every item is in ``items``, a seal/1
    # manifest or one decoded whole); ``loaded``: the files whose items ``items`` holds;
    # ``read(start, n, bad)``: n bytes of its sections from start (``step_files``)
    sections: dict[str, Section] | None = None
    # DCP: the top-level keys of what the step holds (``model``, ``optimizer``...), as
    # ``.metadata`` lists them (None: not recorded, a manifest from before they were):
    # what the launch check needs, without unpickling ``.metadata``
    states: tuple[str, ...] | None = None
    loaded: set[str] = field(default_factory=set)
    read: Callable[..., bytes] | None = None

    @property
    def count(self) -> int:
        """Its items: listed in its sections, or held."""
        if self.sections is None:
            return len(self.items)
        return sum(s.count for s in self.sections.values())


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


def nonneg(x) -> bool:
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


def as_json(data: bytes):
    """JSON's value, or None for bytes that are not JSON (a nesting too deep for the
    parser, 200k ``[`` say, is not JSON a save writes either)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def hex_digests(text, blocks: int) -> bytes | None:
    """``blocks`` digests from their hex, or None if malformed."""
    if not isinstance(text, str) or len(text) != 16 * blocks:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def header(line: bytes, seals, bad) -> tuple[int, str, str]:
    """(bytes, digest, seal) of a manifest's header line, checked."""
    head = as_json(line)
    try:
        nbytes, expected, seal = head["bytes"], head["digest"], head["seal"]
        algorithm = head["algorithm"]
    except (KeyError, TypeError):
        raise bad("does not start with the header line a save writes") from None
    if not nonneg(nbytes) or not re.fullmatch(r"[0-9a-f]{16}", str(expected)):
        raise bad(
            f"header's bytes {str(nbytes)[:40]} and digest {str(expected)[:40]!r} are not "
            "what a save writes (a byte count and 16 hex digits)"
        )
    if seal not in seals or algorithm != ALGORITHM:
        raise bad(
            f"is {repr(seal)[:60]} with {repr(algorithm)[:60]}; this boost_titan reads "
            f"{' or '.join(map(repr, seals))} with {ALGORITHM!r} (written by a newer version?)"
        )
    return nbytes, expected, seal


def fields_of(fields, bad, listed: str) -> Seal:
    """The Seal of a body's (seal/1) or root's (seal/2) fields, its files checked, no
    items yet; ``listed`` the field that lists the items (``items`` or ``sections``)."""
    try:
        kind, step, save_id, block = (fields[k] for k in ("kind", "step", "save_id", "block"))
        raw_files, raw_listed = fields["files"], fields[listed]
        run_id = fields.get("run_id")  # (absent: a manifest from before run ids)
        states = fields.get("states")  # (absent: from before they were recorded)
    except (KeyError, TypeError, AttributeError):
        raise bad("body is not the JSON a save writes") from None
    if states is not None and not (
        isinstance(states, list) and all(isinstance(k, str) and _text(k) for k in states)
    ):
        raise bad("body is not the JSON a save writes")
    if (
        kind not in ("dcp", "hf")
        or not (step is None or nonneg(step))
        or not (save_id is None or isinstance(save_id, str))
        or not (run_id is None or run_ids.valid(run_id))
        or not (nonneg(block) and block > 0)
        or not isinstance(raw_files, dict)
        or not isinstance(raw_listed, list if listed == "items" else dict)
    ):
        raise bad("body is not the JSON a save writes")
    files = {}
    for name, entry in raw_files.items():
        if not _text(name):
            raise bad(f"names the file {name[:120]!r}, which is not valid UTF-8")
        if not (isinstance(entry, list) and len(entry) == 2 and nonneg(entry[0])):
            raise bad(f"entry of {name[:120]!r} is malformed")
        count = block_count([entry[0]], block)  # (counted: a forged size builds nothing)
        if isinstance(entry[1], str) and len(entry[1]) != 16 * count:
            raise bad(
                f"records {name[:120]!r} as {entry[0]} bytes with {len(entry[1]) // 16} "
                f"digests, where that size has {count}"
            )
        digests = None if entry[1] is None else hex_digests(entry[1], count)
        if entry[1] is not None and digests is None:
            raise bad(f"digests of {name[:120]!r} are malformed")
        files[name] = FileEntry(entry[0], digests)
    seal = Seal(kind, step, save_id, files, {}, block, run_id)
    seal.states = None if states is None else tuple(states)
    return seal


def add_items(seal: Seal, raw_items, bad, file: str | None = None) -> None:
    """The item entries ``raw_items`` checked into ``seal.items`` (``file``: all of them
    items of that file, its section)."""
    items, block = seal.items, seal.block
    ends = {name: f.bytes for name, f in seal.files.items()}
    for entry in raw_items:
        at, item = _fast_item(entry, ends, block) or _item(entry, seal.files, block, bad)
        if file is not None and item.file != file:
            raise bad(f"section of {file} lists item {item.fqn[:120]!r} of {item.file[:120]}")
        if at in items:
            raise bad(f"lists item {item.fqn[:120]!r} twice")
        items[at] = item


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
            and (chunk is None or (isinstance(chunk, list) and all(map(nonneg, chunk))))
            and isinstance(file, str)
            and file in files
            and nonneg(offset)
            and nonneg(length)
            and isinstance(segments, list)
            and all(nonneg(n) and n > 0 for n in segments)
            and sum(segments) == length
        )
        # within the file's recorded size: checked before the blocks are counted
        if ok and offset + length > files[file].bytes:
            raise bad(
                f"puts item {fqn[:120]!r} at bytes {offset}..+{length} of {file}, which "
                f"its save wrote as {files[file].bytes} bytes"
            )
    digests = hex_digests(text, block_count(segments, block)) if ok else None
    if digests is None:
        raise bad(f"item entry {ascii(entry)[:120]} is malformed")
    at = (fqn, None if chunk is None else tuple(chunk))
    return at, ItemEntry(fqn, at[1], file, offset, length, tuple(segments), digests)


def mismatch(folder: str, tail: str) -> Callable[[str], ChecksumMismatch]:
    """The one line of a manifest of ``folder`` that is not what its save wrote."""

    def bad(why: str) -> ChecksumMismatch:
        return ChecksumMismatch(f"checkpoint {folder} is corrupted: its {NAME} {why}{tail}")

    return bad


def sections_of(raw, seal: Seal, bad) -> dict[str, Section]:
    """A seal/2 root's sections, checked against its files (one per data file with items)."""
    out = {}
    for name, entry in raw.items():
        if name not in seal.files or seal.files[name].digests is not None:
            raise bad(f"root lists a section of {name[:120]!r}, which it lists as no data file")
        ok = isinstance(entry, list) and len(entry) == 4 and all(map(nonneg, entry[:2]))
        digest = hex_digests(entry[2], 1) if ok else None
        if digest is None or not nonneg(entry[3]):
            raise bad(f"root's section entry of {name[:120]!r} is malformed")
        out[name] = Section(entry[0], entry[1], digest, entry[3])
    return out
