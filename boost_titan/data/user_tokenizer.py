"""Train the byte-level BPE tokenizer on a user's own files, streaming them.

``boost-titan data tokenizer --from PATH --vocab-size N --out DIR`` reads the
documents of PATH one at a time (training's reader, ``local_text.read_documents``), feeds
them to the same trainer as the embedded corpus' tokenizer (``tokenizer.train_tokenizer``:
byte-level BPE, BOS/EOS ids 0/1) and writes DIR with ``tokenizer.json`` +
``tokenizer_config.json``: the folder ``[model] hf_assets_path`` takes. Memory follows the
number of distinct words seen, not the corpus size; ``--sample-docs`` / ``--sample-bytes``
bound the text read.

The model's ``vocab_size`` is not taken from the tokenizer: it is the flavor's
(``boost_titan.models.flavors``: 8192 for the debug models, 32000 from 60m up), and
``LlamaArgs.update_from_config`` refuses a tokenizer with more tokens than that. A
tokenizer with fewer tokens trains, with the extra embedding/LM-head rows unused.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from boost_titan.data import local_text, tokenizer
from boost_titan.data.corpus.sources import CorpusBuildError

INFO_NAME = "boost_tokenizer.json"  # how it was trained; torchtitan ignores it

SUFFIXES = tuple(local_text.FORMATS)


@dataclass
class ReadStats:
    """What has been read so far: updated as documents are yielded."""

    files: int = 0  # files opened
    docs: int = 0
    bytes: int = 0  # UTF-8 bytes of the yielded texts
    current: str = ""


def find_files(path: str | Path) -> list[Path]:
    """The readable files under ``path`` (itself if a file; a folder's as training finds
    them, :func:`local_text.visible_files`, any mix of the formats), sorted; a clear
    error if none."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CorpusBuildError(f"--from {str(path)!r} does not exist")
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise CorpusBuildError(
                f"--from {str(path)!r} has suffix {p.suffix!r}; readable: {list(SUFFIXES)}"
            )
        return [p]
    found = local_text.visible_files(p)
    files = [f for f in found if f.suffix in SUFFIXES]
    if not files:
        seen = sorted({f.suffix or f.name for f in found})[:10]
        raise CorpusBuildError(
            f"--from {str(path)!r} holds no {'/'.join(SUFFIXES)} files (found {seen or 'nothing'})"
        )
    return files


def read_file(path: Path, field: str) -> Iterator[str]:
    """The documents of one file, lazily, by training's reader (``field`` is ignored for
    ``.txt``)."""
    try:
        yield from local_text.read_documents(path, field)
    except local_text.CorpusError as e:
        raise CorpusBuildError(str(e)) from None


def iter_documents(
    files: list[Path],
    field: str,
    stats: ReadStats,
    max_docs: int | None = None,
    max_bytes: int | None = None,
) -> Iterator[str]:
    """The documents of ``files`` in order, counting into ``stats``.

    With a budget (``max_docs`` or ``max_bytes``) the sample is spread over the files:
    each file gives at most (budget left) / (files left), read from its start, so a
    folder sorted by source gives every source its share; a short file leaves its unused
    share to the files after it."""
    budget = max_docs if max_docs is not None else max_bytes
    for i, path in enumerate(files):
        share = None if budget is None else (budget - _used(stats, max_docs)) / (len(files) - i)
        if share is not None and share <= 0:
            break
        stats.files += 1
        stats.current = str(path)
        taken = 0
        for text in read_file(path, field):
            size = len(text.encode("utf-8"))
            stats.docs += 1
            stats.bytes += size
            taken += 1 if max_docs is not None else size
            yield text
            if share is not None and taken >= share:
                break


def _used(stats: ReadStats, max_docs: int | None) -> int:
    return stats.docs if max_docs is not None else stats.bytes


class Progress:
    """A one-line stderr bar of files, documents and bytes read, redrawn at most every
    ``every`` seconds (a new line each time when stderr is not a terminal)."""

    def __init__(self, stats: ReadStats, n_files: int, budget: str, stream: TextIO):
        self.stats, self.n_files, self.budget, self.stream = stats, n_files, budget, stream
        self.tty = stream.isatty()
        self.every = 0.5 if self.tty else 10.0
        self.t0 = self.last = time.perf_counter()

    def line(self) -> str:
        s, dt = self.stats, max(time.perf_counter() - self.t0, 1e-9)
        return (
            f"read {s.docs:,} docs, {s.bytes / 1e6:,.1f} MB{self.budget} from file "
            f"{s.files}/{self.n_files} ({s.bytes / 1e6 / dt:.1f} MB/s, {dt:.0f} s)"
        )

    def tick(self) -> None:
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self.stream.write(("\r" + self.line()) if self.tty else self.line() + "\n")
            self.stream.flush()

    def done(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self.line() + "\n")
        self.stream.flush()


def _out_dir_ready(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CorpusBuildError(f"--out {str(out)!r} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise CorpusBuildError(
            f"--out {str(out)!r} is not empty ({sorted(p.name for p in out.iterdir())[:5]}); "
            f"pass --force to overwrite its tokenizer files"
        )


def train_user_tokenizer(
    source: str | Path,
    out: str | Path,
    vocab_size: int,
    text_field: str = "text",
    sample_docs: int | None = None,
    sample_bytes: int | None = None,
    force: bool = False,
    progress: TextIO | None = sys.stderr,
) -> dict[str, Any]:
    """Train on ``source``'s documents (all, or the sample) and write the tokenizer folder
    ``out``; returns what ``boost_tokenizer.json`` records. Raises ``CorpusBuildError``
    with a one-line reason for every bad input."""
    if vocab_size < tokenizer.MIN_VOCAB_SIZE:
        raise CorpusBuildError(
            f"--vocab-size {vocab_size} is too small: at least {tokenizer.MIN_VOCAB_SIZE} "
            f"(the 256 byte tokens, BOS, EOS and merges)"
        )
    for name, value in (("--sample-docs", sample_docs), ("--sample-bytes", sample_bytes)):
        if value is not None and value <= 0:
            raise CorpusBuildError(f"{name} {value} must be positive")
    if sample_docs is not None and sample_bytes is not None:
        raise CorpusBuildError("give --sample-docs or --sample-bytes, not both")
    out = Path(out).expanduser().absolute()
    _out_dir_ready(out, force)
    files = find_files(source)

    stats = ReadStats()
    docs = iter_documents(files, text_field, stats, sample_docs, sample_bytes)
    budget = (
        f" of {sample_docs:,} docs"
        if sample_docs is not None
        else f" of {sample_bytes / 1e6:,.1f} MB"
        if sample_bytes is not None
        else ""
    )
    bar = Progress(stats, len(files), budget, progress) if progress is not None else None

    def feed():
        for text in docs:
            if bar is not None:
                bar.tick()
            yield text
        if bar is not None:  # the trainer now merges pairs: silent, and long at 32000
            bar.done()
            progress.write(f"computing the BPE merges up to {vocab_size} tokens...\n")
            progress.flush()

    t0 = time.perf_counter()
    tok = tokenizer.train_tokenizer(feed(), vocab_size)
    seconds = time.perf_counter() - t0
    if stats.docs == 0:
        raise CorpusBuildError(
            f"--from {str(source)!r}: its {len(files)} file(s) hold no documents"
        )
    got = tok.get_vocab_size()
    if got < vocab_size:
        raise CorpusBuildError(
            f"the text read ({stats.docs:,} docs, {stats.bytes / 1e6:,.2f} MB from "
            f"{str(source)!r}) makes only {got} tokens, fewer than --vocab-size {vocab_size}: "
            f"give more text (a larger or no --sample-docs/--sample-bytes) or --vocab-size {got}"
        )

    info = {
        "vocab_size": got,
        "source": str(Path(source).expanduser().absolute()),
        "text_field": text_field,
        "files": len(files),
        "read": asdict(stats) | {"current": None},
        "sample_docs": sample_docs,
        "sample_bytes": sample_bytes,
        "train_seconds": round(seconds, 2),
        "type": "byte-level BPE (tokenizers), ByteLevel pre-tokenizer add_prefix_space=False",
        "bos_token": tokenizer.BOS_TOKEN,
        "bos_id": 0,
        "eos_token": tokenizer.EOS_TOKEN,
        "eos_id": 1,
    }
    # written beside ``out`` and renamed into place: no half-written tokenizer folder
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        tokenizer.write_tokenizer(tok, tmp)
        (tmp / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        tokenizer.check_tokenizer(tmp, vocab_size)
        if out.exists():  # --force: replace our files one by one, leave anything else
            for f in tmp.iterdir():
                os.replace(f, out / f.name)
        else:
            os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def summary(info: dict[str, Any], out: Path) -> str:
    """What the command prints at the end: what was read, and how to use the folder."""
    r = info["read"]
    v = info["vocab_size"]
    return "\n".join(
        [
            f"tokenizer: {out} ({v} tokens, BOS id 0, EOS id 1; trained in "
            f"{info['train_seconds']:.1f} s on {r['docs']:,} docs, {r['bytes'] / 1e6:,.1f} MB "
            f"from {r['files']} of {info['files']} file(s))",
            f'use it: [model] hf_assets_path = "{out}"',
            f"vocab_size: the model's comes from its flavor, not from the tokenizer "
            f"(debugmodel 8192; 60m and larger 32000); it must be >= {v}: a tokenizer "
            f"with more tokens is refused at launch, one with fewer leaves the extra "
            f"embedding rows unused"
            + ("" if v in (8192, 32000) else " (--vocab-size 32000 fits the recipes)"),
        ]
    )
