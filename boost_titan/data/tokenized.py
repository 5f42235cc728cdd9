"""A tokenized corpus on disk: what ``boost-titan data tokenize`` (or ``data seal``) writes
and training reads, and the reader of its windows.

A corpus is a folder with ``corpus.json`` (:data:`MANIFEST`) and its parts, each a pair of
Megatron files (``boost_titan.data.indexed``): ``part-00000.bin/.idx``, ... written by
``data tokenize``, or existing Megatron-LM / NeMo / GPT-NeoX prefixes named by ``data
seal`` (read where they are). The manifest holds, per part, its token and document
counts, its files' sizes, the digest of its ``.bin`` and the file of its digests per
64 KiB block (``boost_titan.data.part_blocks``); for the whole corpus, the token
dtype, the largest token id, the tokenizer it was made with (a digest of its files and
its BOS/EOS ids) and the source it was made from; and ``digest``, the xxh3-128 of all
of that but where things are (:func:`manifest_digest`): the corpus' identity, recorded
in every checkpoint's data position and compared between ranks before the first step.

The corpus' token stream is its parts' ``.bin`` files back to back. :class:`WindowReader`
reads a window as byte ranges of them (``os.pread``), opening a part when a window
reaches it and checking then that it is a regular file of its size, and its block
digests against the manifest (at most :data:`MAX_OPEN` kept open, least recently used
closed first): a rank opens only the parts its windows fall in and reads only its
windows' bytes, except that the first read of a block reads the whole block and checks
it (its digest, and no id above the corpus' largest), once per reader: a damaged or
edited part is refused in one line naming the part and the block's byte offset, at the
first read of that block.

A folder without ``corpus.json`` is never read (``data tokenize`` writes it last, after
every part: a tokenization that was killed, or a shard of a multi-machine one, is not
a corpus until it is complete).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import json
import os
from typing import Any

import numpy as np
import xxhash

from boost_titan.data import part_blocks
from boost_titan.data.files import open_regular, read_regular
from boost_titan.data.local_text import CorpusError

MANIFEST = "corpus.json"
FORMAT = "boost_titan tokenized corpus"
VERSION = 2  # 1: no digests per block (refused: sealed or tokenized again, see open_corpus)
MAX_OPEN = 64  # part files a reader keeps open (least recently used closed first)


def digest_of(record: Any) -> str:
    """xxh3-128 of a record's canonical JSON (keys sorted, no spaces)."""
    text = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return xxhash.xxh3_128_hexdigest(text.encode())


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The corpus' identity: its manifest's digest, less where things were (the source's
    and the tokenizer's paths, and ``digest`` itself): the same files copied to another
    disk or cluster, or tokenized there from a copy of the source, are the same corpus."""
    body = {k: v for k, v in manifest.items() if k not in ("digest", "plan")}  # plan: paths
    for key in ("source", "tokenizer"):
        if isinstance(body.get(key), dict):
            body[key] = {k: v for k, v in body[key].items() if k != "path"}
    if isinstance(body.get("parts"), list):  # (sealed Megatron files: absolute prefixes)
        body["parts"] = [
            {k: v for k, v in p.items() if k != "prefix"} if isinstance(p, dict) else p
            for p in body["parts"]
        ]
    return digest_of(body)


@dataclasses.dataclass(frozen=True)
class Part:
    prefix: str  # absolute path of the .bin/.idx pair, without the suffix
    tokens: int
    documents: int
    bin_bytes: int
    digest: str  # xxh3-128 of the .bin
    blocks: str  # absolute path of its block digests (part_blocks)
    blocks_digest: str  # xxh3-128 of that file


@dataclasses.dataclass(frozen=True)
class TokenizedCorpus:
    path: str
    manifest: dict[str, Any]
    parts: tuple[Part, ...]

    @property
    def digest(self) -> str:
        return self.manifest["digest"]

    @property
    def tokens(self) -> int:
        return self.manifest["tokens"]

    @property
    def documents(self) -> int:
        return self.manifest["documents"]

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.manifest["dtype"])

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.manifest["tokenizer"]

    def windows(self, window: int) -> int:
        return self.tokens // window

    def identity(self) -> dict[str, Any]:
        """What a checkpoint's data position records of the corpus (plain data)."""
        return {
            "path": self.path,
            "digest": self.digest,
            "tokens": self.tokens,
            "documents": self.documents,
            "tokenizer": self.tokenizer["digest"],
            "source": self.manifest["source"].get("path", ""),
        }

    def describe(self) -> str:
        src = self.manifest["source"]
        return (
            f"{self.path}: {self.documents} documents, {self.tokens} tokens "
            f"({self.dtype.name}, {len(self.parts)} part{'s' * (len(self.parts) != 1)}, "
            f"digest {self.digest[:12]}), tokenized from {src.get('kind')} "
            f"{src.get('path')!r}"
        )


def _bad(path: str, why: str) -> CorpusError:
    return CorpusError(f"tokenized corpus {path}: {why}")


def open_corpus(path: str) -> TokenizedCorpus:
    """The corpus at ``path`` (its manifest, checked whole; no part opened)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        why = "does not exist" if not os.path.exists(path) else f"holds no {MANIFEST}"
        hint = (
            " (a tokenization still running, killed or sharded over machines and not "
            "merged: run `boost-titan data tokenize` again with the same arguments)"
            if os.path.isdir(path) and any(n.startswith("part-") for n in os.listdir(path))
            else "; make one with `boost-titan data tokenize` (raw text) or `boost-titan "
            "data seal` (Megatron .bin/.idx files)"
        )
        raise _bad(path, why + hint)
    try:
        manifest = json.loads(read_regular(manifest_path, f"tokenized corpus {path}: "))
    except (ValueError, RecursionError) as e:
        raise _bad(path, f"{MANIFEST} cannot be read as JSON ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _bad(path, f"{MANIFEST} is not a {FORMAT!r} manifest")
    if manifest.get("version") != VERSION:
        remake = (
            "seal it again: `boost-titan data seal` with the same prefixes"
            if isinstance(manifest.get("source"), dict)
            and manifest["source"].get("kind") == "megatron"
            else "tokenize it again: `boost-titan data tokenize` with the same arguments"
        )
        why = (
            " (written before the digests per block that let training check each part as "
            "it reads it)"
            if manifest.get("version") == 1
            else ""
        )
        raise _bad(
            path,
            f"{MANIFEST} has version {manifest.get('version')!r}{why}; this boost_titan "
            f"reads version {VERSION}: {remake}",
        )
    try:
        ok = manifest_digest(manifest) == manifest.get("digest")
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise _bad(path, f"{MANIFEST} does not match its own digest: it was edited or damaged")
    parts = []
    for i, p in enumerate(manifest["parts"]):
        prefix = p["prefix"] if os.path.isabs(p["prefix"]) else os.path.join(path, p["prefix"])
        wrong = part_blocks.check_entry(p.get("blocks"))
        if wrong:
            raise _bad(path, f"{MANIFEST}'s part {i} ({prefix}.bin) {wrong}")
        blocks = os.path.join(path, p["blocks"]["file"])
        parts.append(Part(prefix, p["tokens"], p["documents"], p["bin_bytes"], p["digest"],
                          blocks, p["blocks"]["digest"]))  # fmt: skip
    return TokenizedCorpus(os.path.abspath(path), manifest, tuple(parts))


class WindowReader:
    """Reads windows of a corpus' token stream, checking each block of a part the first
    time it is read (module docstring); counts what it reads."""

    def __init__(self, corpus: TokenizedCorpus, window: int, vocab_size: int | None = None):
        self.corpus, self.window = corpus, window
        self.item = corpus.dtype.itemsize
        self.signed = corpus.dtype.kind == "i"
        self.top = int(corpus.manifest["max_token"])  # no id above it is read
        if vocab_size is not None and self.top >= vocab_size:
            raise _bad(
                corpus.path,
                f"holds token id {self.top} and the model's vocabulary is {vocab_size} "
                f"(ids 0..{vocab_size - 1}): it was made with a larger tokenizer than the model's",
            )
        self.starts = [0]  # first token of each part in the stream
        for p in corpus.parts:
            self.starts.append(self.starts[-1] + p.tokens)
        self._fds: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._sums: dict[int, bytes] = {}  # the block digests of each open part
        self._checked: dict[int, bytearray] = {}  # per part, 1 for each block checked
        self.bytes_read = 0  # the windows' bytes
        self.bytes_checked = 0  # bytes read whole at a block's first read, and checked
        self.reads = 0

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is not None:
            self._fds.move_to_end(i)
            return fd
        if len(self._fds) >= MAX_OPEN:  # shuffled windows touch every part in time
            j, old = self._fds.popitem(last=False)
            os.close(old)
            del self._sums[j]
        part = self.corpus.parts[i]
        path = part.prefix + ".bin"
        what = f"tokenized corpus {self.corpus.path}: "
        fd = open_regular(path, what)
        size = os.fstat(fd).st_size
        if size != part.bin_bytes:
            os.close(fd)
            raise _bad(
                self.corpus.path,
                f"{path} is {size} bytes, the manifest says {part.bin_bytes}: the file "
                "changed since the corpus was tokenized (tokenize it again)",
            )
        try:
            sums = read_regular(part.blocks, what)
        except CorpusError:
            os.close(fd)
            raise
        if len(sums) != part_blocks.count(size) * part_blocks.DIGEST or (
            xxhash.xxh3_128_hexdigest(sums) != part.blocks_digest
        ):
            os.close(fd)
            raise _bad(
                self.corpus.path,
                f"{part.blocks} does not match the digest {MANIFEST} records for it: the "
                f"block digests of {path} were damaged or edited (make the corpus again)",
            )
        self._fds[i], self._sums[i] = fd, sums
        self._checked.setdefault(i, bytearray(part_blocks.count(size)))
        return fd

    def _check(self, i: int, data: bytes, base: int, first: int, last: int) -> None:
        """Blocks ``first..last`` of part ``i``, read whole into ``data`` from byte
        ``base``: each one not yet checked against its digest, then every id of them
        against the largest (once for the whole read: one reduction, not one a block)."""
        part, sums, checked = self.corpus.parts[i], self._sums[i], self._checked[i]
        B, D = part_blocks.BLOCK, part_blocks.DIGEST
        view = memoryview(data) if first != last else None
        for k in range(first, last + 1):
            if checked[k]:
                continue
            block = data if view is None else view[k * B - base : (k + 1) * B - base]
            if part_blocks.digest(block) != sums[k * D : (k + 1) * D]:
                raise _bad(
                    self.corpus.path,
                    f"{part.prefix}.bin: its block {k} (bytes {k * B}..{k * B + len(block) - 1}) "
                    f"does not match the digest {MANIFEST} records for it: the file was "
                    "damaged or edited since the corpus was made (make the corpus again)",
                )
        ids = np.frombuffer(data, self.corpus.dtype)
        if int(ids.max()) > self.top or (self.signed and int(ids.min()) < 0):
            at = int(np.flatnonzero((ids > self.top) | (ids < 0))[0])
            raise _bad(
                self.corpus.path,
                f"{part.prefix}.bin: byte {base + at * self.item} holds token id "
                f"{int(ids[at])}, outside 0..{self.top} (the corpus' largest id, "
                f"{MANIFEST}): the part was edited since the corpus was made",
            )
        checked[first : last + 1] = b"\x01" * (last + 1 - first)
        self.bytes_checked += len(data)

    def read(self, window_id: int) -> np.ndarray:
        """Tokens ``[w W, (w + 1) W)`` of the stream, as int64."""
        lo, hi = window_id * self.window, (window_id + 1) * self.window
        if window_id < 0 or hi > self.corpus.tokens:
            raise IndexError(f"window {window_id} of {self.corpus.windows(self.window)}")
        out = np.empty(self.window, np.int64)
        i, at = bisect.bisect_right(self.starts, lo) - 1, lo
        B = part_blocks.BLOCK
        while at < hi:
            end = min(hi, self.starts[i + 1])
            start, stop = (at - self.starts[i]) * self.item, (end - self.starts[i]) * self.item
            fd = self._fd(i)
            first, last = start // B, (stop - 1) // B
            if self._checked[i].find(0, first, last + 1) < 0:
                data = os.pread(fd, stop - start, start)
                whole = len(data) == stop - start
            else:  # a block's first read: the whole block, checked
                base = first * B
                n = min((last + 1) * B, self.corpus.parts[i].bin_bytes) - base
                data = os.pread(fd, n, base)
                whole = len(data) == n
                if whole:
                    self._check(i, data, base, first, last)
                    data = memoryview(data)[start - base : stop - base]
            if not whole:
                raise _bad(self.corpus.path, f"{self.corpus.parts[i].prefix}.bin ended early")
            out[at - lo : end - lo] = np.frombuffer(data, self.corpus.dtype)
            self.bytes_read += stop - start
            self.reads += 1
            at, i = end, i + 1
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._sums.clear()

    def __getstate__(self):  # DataLoader workers open their own descriptors
        state = dict(self.__dict__)
        state["_fds"], state["_sums"] = collections.OrderedDict(), {}
        return state
