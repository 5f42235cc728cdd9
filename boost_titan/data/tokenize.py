"""``boost-titan data tokenize``: raw text into a tokenized corpus (``boost_titan.data.
tokenized``), once, on every local core or on many machines.

**Plan.** The source's units (``boost_titan.data.text_sources``) are grouped in order
into parts of about :data:`~boost_titan.data.text_sources.UNIT_BYTES` of input; part
``p`` is ``part-{p:05d}.bin/.idx`` (Megatron's format, one document per sequence: BOS +
its tokens + EOS, as torchtitan's text dataset tokenizes a document) and
``part-{p:05d}.blocks`` (its digests per block, ``boost_titan.data.part_blocks``). The
plan and its digest depend only on the source and the tokenizer.

**Where.** ``--out`` must lie outside ``--from`` and not hold it (symbolic links
resolved), and hold nothing but a corpus of ours (``boost_titan.data.out_folder``):
anything else in it is refused in one line naming it, before anything is written.
``--force`` replaces a corpus of ours by removing what our own records name, nothing
else.

**Work.** ``--workers N`` processes (default: every core) take parts in turn; ``--shard
i/n`` takes only parts ``p % n == i`` (one machine of ``n``). A part is written under
temporary names, its record (``part-NNNNN.json``: counts, sizes, digests) written, then
its files renamed, block digests last: a killed run leaves temporary files or a part
whose digests do not match its record, and a rerun with the same arguments keeps every
finished part of the same plan and does the rest.

**Merge.** When every part is done (after the last shard, or ``--merge``: no work, only
the check), ``corpus.json`` is written (temporary name, rename): the corpus exists from
that moment, never before. Merging reads no token: the parts stay where they are.

Throughput (``benchmarks/data_loader.py``): docs/benchmarks.md.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from typing import Any

import numpy as np
import xxhash

from boost_titan.data import indexed, out_folder, part_blocks, text_sources
from boost_titan.data.files import overlap, read_regular
from boost_titan.data.local_text import CorpusError
from boost_titan.data.text_sources import Unit
from boost_titan.data.tokenized import (
    FORMAT,
    MANIFEST,
    VERSION,
    digest_of,
    manifest_digest,
    open_corpus,
)

_BATCH = 512  # documents encoded at a time (tokenizers' encode_batch)


# ---------------------------------------------------------------------------------------
# The tokenizer's identity and its encoding


def tokenizer_identity(folder: str) -> dict[str, Any]:
    """A tokenizer folder's identity: digests of its files, its BOS/EOS ids, vocabulary."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    files = {}
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                files[name] = xxhash.xxh3_128_hexdigest(f.read())
    if "tokenizer.json" not in files:
        raise CorpusError(f"tokenizer folder {folder!r} holds no tokenizer.json")
    tok = HuggingFaceTokenizer(folder)
    record = {"files": files, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    return {
        "digest": digest_of(record),
        **record,
        "vocab_size": tok.get_vocab_size(),
        "path": os.path.abspath(folder),
    }


def encode(tok, texts: list[str]) -> list[list[int]]:
    """``tok.encode(text, add_bos=True, add_eos=True)`` for each text, in one batch call."""
    ids = [e.ids for e in tok.tokenizer.encode_batch(texts)]
    bos = [tok.bos_id] if tok.bos_id is not None and not tok.hf_adds_bos else []
    eos = [tok.eos_id] if tok.eos_id is not None and not tok.hf_adds_eos else []
    return [bos + x + eos for x in ids]


# ---------------------------------------------------------------------------------------
# Plan


def plan_parts(units: list[Unit]) -> list[list[Unit]]:
    parts: list[list[Unit]] = [[]]
    size = 0
    for u in units:
        if parts[-1] and size + u.bytes > text_sources.UNIT_BYTES:
            parts.append([])
            size = 0
        parts[-1].append(u)
        size += u.bytes
    return [p for p in parts if p]


class Job:
    """One tokenization: the source, the tokenizer, the output folder and the plan."""

    def __init__(self, source, tokenizer_dir: str, out: str):
        self.source, self.tokenizer_dir, self.out = source, tokenizer_dir, out
        self.tokenizer = tokenizer_identity(tokenizer_dir)
        self.dtype = indexed.token_dtype(self.tokenizer["vocab_size"])
        self.identity = source.identity()
        self.parts = plan_parts(source.units())
        self.plan = digest_of({
            "source": self.identity,
            "tokenizer": self.tokenizer["digest"],
            "dtype": self.dtype.name,
            "parts": [[[u.name, u.start, u.stop] for u in p] for p in self.parts],
        })  # fmt: skip
        self._tok = None

    def prefix(self, p: int) -> str:
        return os.path.join(self.out, f"part-{p:05d}")

    def done(self, p: int) -> dict[str, Any] | None:
        """The record of a finished part of this plan, or None."""
        prefix = self.prefix(p)
        try:
            with open(prefix + ".json") as f:
                record = json.load(f)
            ok = (
                record.get("plan") == self.plan
                and part_blocks.check_entry(record.get("blocks")) is None
                and all(
                    os.path.getsize(prefix + s) == record[k]
                    for s, k in ((".bin", "bin_bytes"), (".idx", "idx_bytes"))
                )
                and xxhash.xxh3_128_hexdigest(read_regular(prefix + part_blocks.SUFFIX))
                == record["blocks"]["digest"]
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError, CorpusError):
            return None
        return record if ok else None

    def run_part(self, p: int) -> dict[str, Any]:
        if self._tok is None:
            from torchtitan.components.tokenizer import HuggingFaceTokenizer

            self._tok = HuggingFaceTokenizer(self.tokenizer_dir)
        prefix, tmp = self.prefix(p), f".tmp.{os.getpid()}"
        writer = indexed.IndexWriter(prefix + ".bin" + tmp, self.dtype)
        bin_digest, text_digest = xxhash.xxh3_128(), xxhash.xxh3_128()
        blocks = part_blocks.BlockHasher()
        max_token, batch = -1, []

        def flush():
            nonlocal max_token
            for ids in encode(self._tok, batch):
                tokens = np.asarray(ids, np.int64)
                if len(tokens):
                    max_token = max(max_token, int(tokens.max()))
                data = writer.add(tokens)
                bin_digest.update(data)
                blocks.update(data)
            batch.clear()

        for unit in self.parts[p]:
            for text in self.source.texts(unit):
                data = text.encode("utf-8", "surrogatepass")
                text_digest.update(len(data).to_bytes(8, "little") + data)
                batch.append(text)
                if len(batch) >= _BATCH:
                    flush()
        flush()
        writer.finish(prefix + ".idx" + tmp)
        record = {
            "part": p,
            "plan": self.plan,
            "documents": len(writer.lengths),
            "tokens": writer.tokens,
            "bin_bytes": os.path.getsize(prefix + ".bin" + tmp),
            "idx_bytes": os.path.getsize(prefix + ".idx" + tmp),
            "digest": bin_digest.hexdigest(),
            "blocks": part_blocks.write(prefix + part_blocks.SUFFIX + tmp, blocks.finish()),
            "text_digest": text_digest.hexdigest(),
            "max_token": max_token,
            "input_bytes": sum(u.bytes for u in self.parts[p]),
        }
        # the record first: it makes the part's files ours (boost_titan.data.out_folder)
        # before they have their names; the block digests renamed last, so that a part
        # whose digests match its record has every file of this run (done)
        _write_json(prefix + ".json", record)
        for suffix in (".bin", ".idx", part_blocks.SUFFIX):
            os.replace(prefix + suffix + tmp, prefix + suffix)
        return record

    def manifest(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "tokenizer": self.tokenizer,
            "source": {
                **{k: v for k, v in self.identity.items() if k != "files"},
                "files": len(self.identity.get("files", [])),
                "input_bytes": sum(r["input_bytes"] for r in records),
                "text_digest": digest_of([r["text_digest"] for r in records]),
            },
            "plan": self.plan,
            "documents": sum(r["documents"] for r in records),
            "tokens": sum(r["tokens"] for r in records),
            "max_token": max(r["max_token"] for r in records),
            "parts": [
                {
                    "prefix": f"part-{r['part']:05d}",
                    "tokens": r["tokens"],
                    "documents": r["documents"],
                    "bin_bytes": r["bin_bytes"],
                    "idx_bytes": r["idx_bytes"],
                    "digest": r["digest"],
                    "blocks": r["blocks"],
                }
                for r in records
            ],  # fmt: skip
        }
        return {**body, "digest": manifest_digest(body)}


def _write_json(path: str, record: dict[str, Any]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# Run

_JOB: Job | None = None  # the job of a forked worker


def _worker_init(threads: int) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # tokenizers' pool, set before first use


def _worker_part(p: int) -> dict[str, Any]:
    return _JOB.run_part(p)


class Progress:
    """One line on stderr: parts, input bytes, tokens/s and time left (rewritten in place
    on a terminal, every 30 s otherwise)."""

    def __init__(self, total_bytes: int, parts: int, quiet: bool = False):
        self.total, self.parts, self.quiet = max(total_bytes, 1), parts, quiet
        self.done_bytes = self.tokens = self.done = 0
        self.start = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()

    def update(self, record: dict[str, Any]) -> None:
        self.done += 1
        self.done_bytes += record["input_bytes"]
        self.tokens += record["tokens"]
        now = time.monotonic()
        if self.quiet or (not self.tty and now - self.last < 30 and self.done < self.parts):
            return
        self.last = now
        rate = self.tokens / max(now - self.start, 1e-9)
        left = (now - self.start) * (self.total - self.done_bytes) / max(self.done_bytes, 1)
        line = (
            f"tokenize: {self.done}/{self.parts} parts, {self.done_bytes / 1e9:.2f} of "
            f"{self.total / 1e9:.2f} GB, {rate / 1e6:.2f}M tokens/s, "
            f"{int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d} left"
        )
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)  # fmt: skip

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr)


def tokenize(
    source,
    tokenizer_dir: str,
    out: str,
    workers: int | None = None,
    shard: tuple[int, int] = (0, 1),
    merge_only: bool = False,
    force: bool = False,
    quiet: bool = False,
) -> dict[str, Any] | None:
    """Tokenize ``source`` into ``out`` (module docstring); the manifest once the corpus is
    complete, None while other shards' parts are missing."""
    global _JOB
    where = overlap(out, source.path) if os.path.exists(source.path) else None
    if where:
        raise CorpusError(
            f"data tokenize --out {out} {where} --from {source.path} (symbolic links "
            "resolved): the corpus would be written among the text it is made from; give "
            "--out a folder outside --from"
        )
    source.check()  # an empty or unreadable source: one line, nothing written
    job = Job(source, tokenizer_dir, out)
    if not job.parts:
        raise CorpusError(f"{source.path!r} holds no documents: nothing to tokenize")
    old = out_folder.own_manifest(out)
    if old is not None and not force:
        if old.get("version") == VERSION and old.get("plan") == job.plan:
            return open_corpus(out).manifest  # done: nothing to do
        if old.get("plan") != job.plan:
            src = old.get("source") if isinstance(old.get("source"), dict) else {}
            raise CorpusError(
                f"{out} already holds a tokenized corpus of another source or tokenizer "
                f"({old.get('documents')} documents, {old.get('tokens')} tokens, tokenized "
                f"from {src.get('kind')} {src.get('path')!r}); choose another output folder "
                "or pass --force"
            )
    names = out_folder.check_out(out, "data tokenize")
    if force:  # what our own records name, nothing else (boost_titan.data.out_folder)
        out_folder.remove(out, out_folder.own_files(out, names))
    elif old is not None:  # this plan, an older version: its parts made again
        out_folder.remove(out, {MANIFEST})
    os.makedirs(out, exist_ok=True)
    index, count = shard
    mine = [p for p in range(len(job.parts)) if p % count == index]
    todo = [] if merge_only else [p for p in mine if job.done(p) is None]
    cores = max(1, workers or os.cpu_count() or 1)
    procs = max(1, min(cores, len(todo)))
    threads = max(1, cores // procs)  # fewer parts than cores: tokenizers' threads
    progress = Progress(sum(sum(u.bytes for u in job.parts[p]) for p in todo), len(todo), quiet)
    if procs == 1:
        _worker_init(threads)
        for p in todo:
            progress.update(job.run_part(p))
    else:
        _JOB = job
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(procs, initializer=_worker_init, initargs=(threads,)) as pool:
            for record in pool.imap_unordered(_worker_part, todo):
                progress.update(record)
        _JOB = None
    progress.close()
    records = [job.done(p) for p in range(len(job.parts))]
    missing = [p for p, r in enumerate(records) if r is None]
    if missing:
        if merge_only or count == 1:
            raise CorpusError(
                f"{out}: {len(missing)} of {len(job.parts)} parts are not done "
                f"(part-{missing[0]:05d}{', ...' if len(missing) > 1 else ''}): run every "
                "shard (--shard i/n) with the same arguments, then --merge"
            )
        return None
    manifest = job.manifest(records)
    if manifest["documents"] == 0:
        raise CorpusError(f"{source.path!r} holds no documents: nothing to tokenize")
    if manifest["max_token"] >= job.tokenizer["vocab_size"]:
        raise CorpusError(
            f"{out}: token id {manifest['max_token']} is at or above the tokenizer's "
            f"vocabulary size {job.tokenizer['vocab_size']}"
        )
    _write_json(os.path.join(out, MANIFEST), manifest)
    return manifest
