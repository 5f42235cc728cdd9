"""``boost-titan data seal``: existing Megatron-LM / NeMo / GPT-NeoX ``.bin``/``.idx``
corpora made a tokenized corpus where they lie (no copy): a ``corpus.json`` naming each
prefix, with its counts, sizes and the digest of its ``.bin`` (read once, here), and the
tokenizer the user says it was made with.

Checked on the way, each refusal one line naming the file: the ``.idx`` (version,
dtype, size: ``boost_titan.data.indexed``), the ``.bin`` against it (sequences back to
back, the size the lengths make), and every token id below the tokenizer's
vocabulary. Nothing is written unless every prefix passes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from boost_titan.data import indexed
from boost_titan.data.local_text import CorpusError
from boost_titan.data.tokenize import _write_json, tokenizer_identity
from boost_titan.data.tokenized import FORMAT, MANIFEST, VERSION, digest_of, manifest_digest

_CHUNK = 1 << 26  # bytes hashed and scanned at a time


def _prefix(path: str) -> str:
    for suffix in (".bin", ".idx"):
        if path.endswith(suffix):
            return path[: -len(suffix)]
    return path


def _scan(bin_path: str, dtype: np.dtype, vocab: int) -> tuple[str, int]:
    """(xxh3-128 of the .bin, its largest token id), checking ids against ``vocab``."""
    import xxhash

    digest, top = xxhash.xxh3_128(), -1
    with open(bin_path, "rb") as f:
        offset = 0
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
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
    return digest.hexdigest(), top


def seal(prefixes: list[str], tokenizer_dir: str, out: str) -> dict[str, Any]:
    tokenizer = tokenizer_identity(tokenizer_dir)
    parts, dtypes, top = [], set(), -1
    for given in prefixes:
        prefix = os.path.abspath(_prefix(given))
        index = indexed.read_index(prefix + ".idx")
        if not os.path.isfile(prefix + ".bin"):
            raise CorpusError(f"{prefix}.bin does not exist (its .idx does)")
        tokens = indexed.contiguous_tokens(index, prefix + ".bin")
        digest, high = _scan(prefix + ".bin", index.dtype, tokenizer["vocab_size"])
        top = max(top, high)
        dtypes.add(index.dtype.name)
        parts.append({
            "prefix": prefix, "tokens": tokens, "documents": max(index.documents - 1, 0),
            "bin_bytes": os.path.getsize(prefix + ".bin"),
            "idx_bytes": os.path.getsize(prefix + ".idx"), "digest": digest,
        })  # fmt: skip
    if len(dtypes) != 1:
        raise CorpusError(
            f"the prefixes hold tokens of different dtypes ({sorted(dtypes)}): seal each "
            "dtype as its own corpus and blend them"
        )
    if not sum(p["tokens"] for p in parts):
        raise CorpusError(f"{', '.join(prefixes)}: no tokens: an empty corpus")
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
    os.makedirs(out, exist_ok=True)
    _write_json(os.path.join(out, MANIFEST), manifest)
    return manifest
