"""Reading checkpoints written with per-item trailers (boost_titan before sealed steps):
each item's stored bytes were its payload, one xxh3_64 digest per MiB of it and a
20-byte footer (payload length u64 LE, block size u32 LE, magic), declared in
``.metadata`` as the DCP extension ``boost_titan.xxh3/1``; ``.metadata`` had its
digest in a ``.metadata.xxh3`` sidecar. Nothing writes this any more; such a step
loads with every item checked against its own trailer and ``.metadata`` against its
sidecar, and a warning that nothing binds its items to the step."""

from __future__ import annotations

import json
import struct

from boost_titan.checkpoint.integrity.blocks import (
    ALGORITHM,
    ChecksumMismatch,
    Item,
    VerifyingReader,
    describe,
    digest,
    mismatch,
    read_at,
    uniform_blocks,
)

DESCRIPTOR = "boost_titan.xxh3/1"
SIDECAR_SUFFIX = ".xxh3"
_MAGIC = b"BTxxh3\x00\x01"
_FOOTER = struct.Struct("<QI")
FOOTER_BYTES = _FOOTER.size + len(_MAGIC)


def _trailer_bytes(payload: int, block: int) -> int:
    return -(-payload // block) * 8 + FOOTER_BYTES


def _no_trailer(item: Item, size: int, why: str) -> ChecksumMismatch:
    return ChecksumMismatch(
        f"checkpoint {item.folder} is corrupted: {item.file}, {item.what}: its {size} bytes "
        f"end without the {ALGORITHM} trailer its .metadata declares ({why}){item.tail}"
    )


def parse_trailer(item: Item, raw, size: int) -> tuple[int, int, bytes]:
    """(payload length, block size, digests) of an item of ``size`` stored bytes."""
    if size < FOOTER_BYTES:
        raise _no_trailer(item, size, "too short")
    footer = bytearray(FOOTER_BYTES)
    if read_at(raw, size - FOOTER_BYTES, memoryview(footer)) != FOOTER_BYTES:
        raise _no_trailer(item, size, "the file is shorter than its .metadata says")
    if not footer.endswith(_MAGIC):
        raise _no_trailer(item, size, "no trailer magic")
    payload, block = _FOOTER.unpack_from(footer)
    if block <= 0 or payload + _trailer_bytes(payload, block) != size:
        raise _no_trailer(item, size, f"its footer says {payload} bytes in blocks of {block}")
    digests = bytearray(size - FOOTER_BYTES - payload)
    if read_at(raw, payload, memoryview(digests)) != len(digests):
        raise _no_trailer(item, size, "the file is shorter than its .metadata says")
    return payload, block, bytes(digests)


def reader(raw, size: int, item: Item) -> VerifyingReader:
    """An item with a trailer, read as its payload, every block checked."""
    payload, block, digests = parse_trailer(item, raw, size)
    return VerifyingReader(raw, payload, digests, item, uniform_blocks(payload, block))


def check_sidecar(folder: str, name: str, data: bytes, record: bytes, tail: str) -> None:
    """Raise unless ``data`` (the bytes of ``name``) match its sidecar ``record``."""
    try:
        fields = json.loads(record)
        algorithm, expected, nbytes = fields["algorithm"], fields["digest"], int(fields["bytes"])
    except (ValueError, KeyError, TypeError):
        raise ChecksumMismatch(
            f"checkpoint {folder} is corrupted: {name}{SIDECAR_SUFFIX} is not the JSON "
            f"{{algorithm, digest, bytes}} a save writes{tail}"
        ) from None
    if algorithm != ALGORITHM:
        raise ChecksumMismatch(
            f"checkpoint {folder}: {name}{SIDECAR_SUFFIX} records algorithm {algorithm!r}, "
            f"this boost_titan checks {ALGORITHM!r}{tail}"
        )
    found = digest(data).hex()
    if found != expected or len(data) != nbytes:
        raise ChecksumMismatch(
            f"checkpoint {folder} is corrupted: {name}: {ALGORITHM} {found} ({len(data)} "
            f"bytes) where {name}{SIDECAR_SUFFIX} records {expected} ({nbytes} bytes); not "
            f"unpickled{tail.replace(';', ',')}"
        )


def consistency(folder: str, storage: dict, tail: str) -> None:
    """A step with a sidecar: every item must carry the trailer."""
    unchecked = [i for i, s in storage.items() if DESCRIPTOR not in (s.transform_descriptors or ())]
    if unchecked:
        raise ChecksumMismatch(
            f"checkpoint {folder} is corrupted: .metadata{SIDECAR_SUFFIX} says it was "
            f"written with checksums, but {len(unchecked)} of its {len(storage)} items "
            f"carry none (e.g. {describe(unchecked[0])}): altered or mixed{tail}"
        )


def verify_item(item: Item, view, length: int, buf: memoryview) -> None:
    """Check every block of one stored item against its trailer (``verify``)."""
    payload, block, digests = parse_trailer(item, view, length)
    data = buf if block == len(buf) else memoryview(bytearray(block))
    for k, start in enumerate(range(0, payload, block)):
        n = min(block, payload - start)
        if read_at(view, start, data[:n]) != n:
            raise _no_trailer(item, length, "the file is shorter")
        found = digest(data[:n])
        if found != digests[8 * k : 8 * k + 8]:
            raise mismatch(item, start, start + n, found, digests[8 * k : 8 * k + 8])
