"""``boost-titan data seal``: existing Megatron-LM / NeMo / GPT-NeoX ``.bin``/``.idx``
corpora made a tokenized corpus where they lie (no copy): a ``corpus.json`` naming each
prefix, with its counts, sizes and the digest of its ``.bin`` (read once, here), its
digests per block (``part-NNNNN.blocks`` beside ``corpus.json``: what training checks
each block against as it reads it, ``boost_titan.data.part_blocks``), and the tokenizer
the user says it was made with.

Checked on the way, each refusal one line naming the file: each ``.idx`` and ``.bin`` a
regular file (a folder or a FIFO is named as such; a FIFO is never opened to block),
the ``.idx`` (version, dtype, size: ``boost_titan.data.indexed``), the ``.bin`` against
it (sequences back to back, the size the lengths make), and every token id below the
tokenizer's vocabulary; ``--out`` holds no input (symbolic links resolved) and nothing
but a sealed corpus of ours (``boost_titan.data.out_folder``). Nothing is written unless
every prefix passes; a corpus sealed again in the same folder replaces the old one, and
the block digests it no longer lists are removed.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from boost_titan.data import indexed, out_folder, part_blocks
from boost_titan.data.files import open_regular, overlap
from boost_titan.data.local_text import CorpusError
from boost_titan.data.tokenize import _write_json, tokenizer_identity
from boost_titan.data.tokenized import FORMAT, MANIFEST, VERSION, digest_of, manifest_digest

_CHUNK = 1 << 26  # bytes hashed and scanned at a time


def _prefix(path: str) -> str:
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def _scan(fd: int, bin_path: str, dtype: np.dtype, vocab: int) -> tuple[str, int, bytes]:
    """(xxh3-128 of the .bin, its largest token id, its block digests), checking ids
    against ``vocab``."""
    import xxhash

    digest, blocks, top = xxhash.xxh3_128(), part_blocks.BlockHasher(), -1
    with os.fdopen(fd, "rb") as f:
        offset = 0
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            blocks.update(chunk)
            tokens = np.frombuffer(chunk, dtype)
            if tokens.size:
                low, high = int(tokens.min()), int(tokens.max())
                if low < 0 or high >= vocab:
                    bad = low if low < 0 else high
                    at = offset + int(np.flatnonzero(tokens == bad)[0])
                    raise CorpusError(
                        f"{bin_path}: token {at} is id {bad}, outside the tokenizer's "
                        f"vocabulary 0..{vocab - 1}: the corpus was made with another "
                        "tokenizer (pass that one with --tokenizer)"
                    )
                top = max(top, high)
            offset += tokens.size
    return digest.hexdigest(), top, blocks.finish()


def _check_out(prefixes: list[str], out: str) -> list[str]:
    """``out`` against the inputs and what it holds (module docstring); its names."""
    for prefix in prefixes:
        for path in (prefix + ".idx", prefix + ".bin"):
            if os.path.lexists(path) and overlap(out, path) in ("is", "holds"):
                raise CorpusError(
                    f"data seal --out {out} {'is' if overlap(out, path) == 'is' else 'holds'} "
                    f"the input {path} (symbolic links resolved): corpus.json and the block "
                    "digests would be written among the files they describe; give --out a "
                    "folder of its own"
                )
    names = out_folder.check_out(out, "data seal")
    old = out_folder.own_manifest(out)
    kind = old.get("source", {}).get("kind") if old and isinstance(old.get("source"), dict) else ""
    sealed = out_folder.listed(old) if kind == "megatron" else set()
    for name in names:
        if name not in sealed and ".tmp." not in name:
            raise CorpusError(
                f"data seal --out {out} holds {name!r} of a corpus `data tokenize` wrote: "
                "seal into a folder of its own"
            )
    return names


def seal(prefixes: list[str], tokenizer_dir: str, out: str) -> dict[str, Any]:
    prefixes = [os.path.abspath(_prefix(given)) for given in prefixes]
    names = _check_out(prefixes, out)
    tokenizer = tokenizer_identity(tokenizer_dir)
    parts, sums, dtypes, top = [], [], set(), -1
    for prefix in prefixes:
        index = indexed.read_index(prefix + ".idx")
        if not os.path.lexists(prefix + ".bin"):
            raise CorpusError(f"{prefix}.bin does not exist (its .idx does)")
        fd = open_regular(prefix + ".bin")  # a folder or a FIFO: named as such, one line
        try:
            tokens = indexed.contiguous_tokens(index, prefix + ".bin", os.fstat(fd).st_size)
        except CorpusError:
            os.close(fd)
            raise
        size = os.fstat(fd).st_size
        digest, high, blocks = _scan(fd, prefix + ".bin", index.dtype, tokenizer["vocab_size"])
        top = max(top, high)
        dtypes.add(index.dtype.name)
        sums.append(blocks)
        parts.append({
            "prefix": prefix, "tokens": tokens, "documents": max(index.documents - 1, 0),
            "bin_bytes": size, "idx_bytes": os.path.getsize(prefix + ".idx"), "digest": digest,
        })  # fmt: skip
    if len(dtypes) != 1:
        raise CorpusError(
            f"the prefixes hold tokens of different dtypes ({sorted(dtypes)}): seal each "
            "dtype as its own corpus and blend them"
        )
    if not sum(p["tokens"] for p in parts):
        raise CorpusError(f"{', '.join(prefixes)}: no tokens: an empty corpus")
    os.makedirs(out, exist_ok=True)
    tmp = f".tmp.{os.getpid()}"
    for i, (part, blocks) in enumerate(zip(parts, sums)):
        part["blocks"] = part_blocks.write(
            os.path.join(out, f"part-{i:05d}{part_blocks.SUFFIX}{tmp}"), blocks
        )
    body = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtypes.pop(),
        "tokenizer": tokenizer,
        "source": {"kind": "megatron", "path": parts[0]["prefix"], "prefixes": len(parts)},
        "plan": digest_of([p["digest"] for p in parts]),
        "documents": sum(p["documents"] for p in parts),
        "tokens": sum(p["tokens"] for p in parts),
        "max_token": top,
        "parts": parts,
    }
    manifest = {**body, "digest": manifest_digest(body)}
    old = out_folder.own_manifest(out) if MANIFEST in names else None
    if old is not None:  # no corpus while the digests it lists are replaced
        out_folder.remove(out, {MANIFEST})
    for part in parts:
        name = part["blocks"]["file"]
        os.replace(os.path.join(out, name + tmp), os.path.join(out, name))
    _write_json(os.path.join(out, MANIFEST), manifest)
    if old is not None:
        out_folder.remove(out, out_folder.listed(old) - out_folder.listed(manifest))
    return manifest
