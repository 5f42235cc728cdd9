"""Build the corpus: fetch, load, split, train the tokenizer, write the manifest, atomically.

Build output (``<out_dir>``, default :func:`~boost_titan.data.corpus.manifest.default_corpus_dir`)::

    train/          datasets.Dataset.save_to_disk folder, columns text/source/doc_id
    validation/     same, ~2% of whole documents (hash of (source, doc_id))
    tokenizer/      tokenizer.json + tokenizer_config.json (torchtitan HuggingFaceTokenizer)
    manifest.json   pins, counts, content hashes

The build runs in a temporary sibling folder that is renamed into place only when complete, so
nothing half-written is ever visible under ``<out_dir>``; concurrent builds of one folder are
serialised by a lock file. A build whose manifest already matches the requested vocab size and
the source pins is a no-op.

``build_corpus`` returns the manifest dict plus one key that is *not* saved to disk:
``manifest["_built_now"]`` is True when this call did the work and False when the corpus was
already up to date.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from boost_titan.data import tokenizer
from boost_titan.data.corpus import fetch, loaders
from boost_titan.data.corpus.clean import Doc
from boost_titan.data.corpus.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    TOKENIZER_DIR,
    TRAIN_DIR,
    VAL_DIR,
    manifest_matches,
    read_manifest,
    resolve_dirs,
)
from boost_titan.data.corpus.sources import SOURCES, CorpusBuildError
from boost_titan.data.corpus.split import (
    MIN_DOCS_FOR_FORCED_VAL,
    VAL_FRACTION,
    split_documents,
    texts_sha256,
)
from boost_titan.data.tokenizer import BOS_TOKEN, DEFAULT_VOCAB_SIZE, EOS_TOKEN, MIN_VOCAB_SIZE

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """Serialise concurrent builds of one out_dir (e.g. several ranks calling build_corpus)."""
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "a") as f:
        try:
            import fcntl
        except ImportError:  # non-POSIX: no locking
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _save_split(docs: list[Doc], path: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_dict(
        {
            "text": [d.text for d in docs],
            "source": [d.source for d in docs],
            "doc_id": [d.doc_id for d in docs],
        },
        features=datasets.Features(
            {
                "text": datasets.Value("string"),
                "source": datasets.Value("string"),
                "doc_id": datasets.Value("string"),
            }
        ),
    )
    ds.save_to_disk(str(path), num_shards=1)


def _count_tokens(tok, texts: list[str]) -> int:
    total = 0
    for i in range(0, len(texts), 256):
        total += sum(len(e.ids) for e in tok.encode_batch(texts[i : i + 256]))
    return total


def _build_into(tmp: Path, vocab_size: int, cache: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    archives = {name: fetch.fetch_artifact(src, cache) for name, src in SOURCES.items()}
    t_fetch = time.perf_counter()

    docs: list[Doc] = []
    for name, src in SOURCES.items():
        sdocs = loaders.load_source(src, archives[name])
        logger.info(
            "source %-12s %5d docs %9d bytes",
            name,
            len(sdocs),
            sum(len(d.text.encode("utf-8")) for d in sdocs),
        )
        docs.extend(sdocs)
    train, val = split_documents(docs)
    t_parse = time.perf_counter()

    _save_split(train, tmp / TRAIN_DIR)
    _save_split(val, tmp / VAL_DIR)

    logger.info(
        "training byte-level BPE tokenizer (vocab %d) on %d train docs", vocab_size, len(train)
    )
    tok = tokenizer.train_tokenizer([d.text for d in train], vocab_size)
    tok_dir = tmp / TOKENIZER_DIR
    tokenizer.write_tokenizer(tok, tok_dir)
    tokenizer.check_tokenizer(tok_dir, vocab_size)
    t_tok = time.perf_counter()

    val_texts = [d.text for d in val]
    val_tokens = _count_tokens(tok, val_texts)

    def nbytes(ds: Iterable[Doc]) -> int:
        return sum(len(d.text.encode("utf-8")) for d in ds)

    val_ids = {(d.source, d.doc_id) for d in val}
    sources: dict[str, Any] = {}
    for name, src in SOURCES.items():
        s_all = [d for d in docs if d.source == name]
        s_val = [d for d in s_all if (d.source, d.doc_id) in val_ids]
        sources[name] = {
            "pin": src.pin(),
            "license": src.license,
            "description": src.description,
            "docs": len(s_all),
            "bytes": nbytes(s_all),
            "train_docs": len(s_all) - len(s_val),
            "val_docs": len(s_val),
            "val_bytes": nbytes(s_val),
        }
    val_bytes, train_bytes = nbytes(val), nbytes(train)
    manifest = {
        "format_version": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "tokenizer": {
            "type": "byte-level BPE (tokenizers), ByteLevel pre-tokenizer "
            "add_prefix_space=False, trained on train",
            "path": TOKENIZER_DIR,
            "bos_token": BOS_TOKEN,
            "bos_id": 0,
            "eos_token": EOS_TOKEN,
            "eos_id": 1,
        },
        "split": {
            "rule": "sha256(source\\0doc_id)[:8]/2**64 < val_fraction; >=1 val doc per source with "
            f">= {MIN_DOCS_FOR_FORCED_VAL} docs",
            "val_fraction": VAL_FRACTION,
        },
        "sources": sources,
        # train tokens are estimated from the validation bytes/token (exact counting costs ~20 s)
        "train": {
            "path": TRAIN_DIR,
            "docs": len(train),
            "bytes": train_bytes,
            "tokens_estimate": int(round(train_bytes * val_tokens / max(val_bytes, 1))),
        },
        "validation": {
            "path": VAL_DIR,
            "docs": len(val),
            "bytes": val_bytes,
            "tokens": val_tokens,
            "bytes_per_token": round(val_bytes / max(val_tokens, 1), 4),
        },
        "content_hashes": {
            "train_texts": texts_sha256(train),
            "validation_texts": texts_sha256(val),
            "tokenizer_json": fetch.sha256_file(tok_dir / "tokenizer.json"),
        },
        "build_seconds": {
            "fetch": round(t_fetch - t0, 2),
            "parse": round(t_parse - t_fetch, 2),
            "save_and_tokenizer": round(t_tok - t_parse, 2),
            "total": round(time.perf_counter() - t0, 2),
        },
    }
    with open(tmp / MANIFEST_NAME, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=False)
        f.write("\n")
    return manifest


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an old ``out`` is moved aside first, then deleted."""
    old = None
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise CorpusBuildError(f"{out} exists and is not a directory")
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "corpus")
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    try:
        from datasets.utils import logging as ds_logging
    except ImportError:
        yield
        return
    was_enabled = ds_logging.is_progress_bar_enabled()
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            ds_logging.enable_progress_bar()


def build_corpus(
    out_dir=None, vocab_size: int = DEFAULT_VOCAB_SIZE, force: bool = False, cache_dir=None
) -> dict[str, Any]:
    """Build (or reuse) the corpus in ``out_dir``; return its manifest.

    The returned dict carries ``"_built_now"`` (not saved): True if this call built the corpus,
    False if an up-to-date one (same format version, vocab size and source pins) was reused.
    Downloads are cached in ``cache_dir`` (default ``<out_dir>/../.downloads``).
    """
    vocab_size = int(vocab_size)
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    out, cache = resolve_dirs(out_dir, cache_dir)

    def up_to_date() -> dict[str, Any] | None:
        manifest = read_manifest(out)
        if not force and manifest_matches(out, manifest, vocab_size):
            logger.info("corpus up to date: %s (vocab %d)", out, vocab_size)
            return dict(manifest, _built_now=False)
        return None

    if (m := up_to_date()) is not None:
        return m
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if (m := up_to_date()) is not None:  # another process finished it meanwhile
            return m
        logger.info("building corpus in %s (vocab %d, download cache %s)", out, vocab_size, cache)
        t0 = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            with _quiet_datasets():
                manifest = _build_into(tmp, vocab_size, cache)
            _replace_dir(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info(
            "corpus built in %.1fs: train %d docs / %.1f MB, val %d docs / %.2f MB, "
            "%.3f bytes/token on val",
            time.perf_counter() - t0,
            manifest["train"]["docs"],
            manifest["train"]["bytes"] / 1e6,
            manifest["validation"]["docs"],
            manifest["validation"]["bytes"] / 1e6,
            manifest["validation"]["bytes_per_token"],
        )
    return dict(manifest, _built_now=True)
