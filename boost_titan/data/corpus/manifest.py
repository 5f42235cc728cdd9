"""Where a corpus lives and what its manifest says: paths, reading, readiness, summary.

A corpus folder holds ``train/`` and ``validation/`` (``datasets.Dataset.save_to_disk``),
``tokenizer/`` and ``manifest.json`` (pins, counts, content hashes). It is ready when its
manifest has the current format version, the current source pins (and the requested vocab
size) and every output file is present.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from boost_titan.data.corpus.sources import SOURCES

# Bump whenever cleaning, splitting, tokenizer settings or the output layout change: a manifest
# with another format version is treated as stale and rebuilt.
FORMAT_VERSION = 1

ENV_DATA_DIR = "BOOST_TITAN_DATA"
BUILD_HINT = "build it with `boost-titan data build` (the README's `make data`)"
MANIFEST_NAME = "manifest.json"
TRAIN_DIR = "train"
VAL_DIR = "validation"
TOKENIZER_DIR = "tokenizer"


def default_corpus_dir() -> Path:
    """``$BOOST_TITAN_DATA`` if set, else ``./data/boost_corpus`` (relative to the cwd),
    absolute."""
    env = os.environ.get(ENV_DATA_DIR)
    path = Path(env).expanduser() if env else Path("data") / "boost_corpus"
    return path.absolute()


def resolve_dirs(out_dir, cache_dir) -> tuple[Path, Path]:
    out = Path(out_dir).expanduser().absolute() if out_dir is not None else default_corpus_dir()
    cache = (
        Path(cache_dir).expanduser().absolute()
        if cache_dir is not None
        else out.parent / ".downloads"
    )
    return out, cache


def read_manifest(out_dir=None) -> dict[str, Any] | None:
    out, _ = resolve_dirs(out_dir, None)
    try:
        with open(out / MANIFEST_NAME, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def manifest_matches(out: Path, manifest: dict[str, Any] | None, vocab_size: int | None) -> bool:
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        return False
    if vocab_size is not None and manifest.get("vocab_size") != vocab_size:
        return False
    pins = {name: info.get("pin") for name, info in (manifest.get("sources") or {}).items()}
    if pins != {name: src.pin() for name, src in SOURCES.items()}:
        return False
    required = [
        out / TRAIN_DIR / "dataset_info.json",
        out / VAL_DIR / "dataset_info.json",
        out / TOKENIZER_DIR / "tokenizer.json",
        out / TOKENIZER_DIR / "tokenizer_config.json",
    ]
    return all(p.is_file() for p in required)


def corpus_is_ready(out_dir=None, vocab_size: int | None = None) -> bool:
    """True if ``out_dir`` holds a complete corpus built with the current pins (and
    ``vocab_size``, unless None)."""
    out, _ = resolve_dirs(out_dir, None)
    return manifest_matches(out, read_manifest(out), vocab_size)


def format_manifest(manifest: dict[str, Any]) -> str:
    """Human-readable summary of a manifest."""
    lines = [f"format {manifest.get('format_version')}, vocab size {manifest.get('vocab_size')}"]
    lines.append(f"{'source':<12} {'artifact':<42} {'docs':>6} {'val':>4} {'MB':>7}")
    for name, s in manifest.get("sources", {}).items():
        lines.append(
            f"{name:<12} {s['pin']['artifact']:<42} {s['docs']:>6} {s['val_docs']:>4} "
            f"{s['bytes'] / 1e6:>7.2f}"
        )
    tr, va = manifest.get("train", {}), manifest.get("validation", {})
    lines.append(
        f"train:      {tr.get('docs')} docs, {tr.get('bytes', 0) / 1e6:.2f} MB, "
        f"~{tr.get('tokens_estimate')} tokens"
    )
    lines.append(
        f"validation: {va.get('docs')} docs, {va.get('bytes', 0) / 1e6:.2f} MB, "
        f"{va.get('tokens')} tokens, {va.get('bytes_per_token')} bytes/token"
    )
    for k, v in manifest.get("content_hashes", {}).items():
        lines.append(f"sha256 {k}: {v}")
    return "\n".join(lines)
