"""Stream the documents of a user's text files, one at a time, without loading a corpus.

The formats are ``local_text``'s (``boost_titan.datasets``): ``.jsonl`` (one JSON object a
line), ``.json`` (JSON Lines, or one JSON array of objects, which is parsed whole: one
file at a time), ``.txt`` (one document per file) and ``.parquet`` (read in record
batches of the one column). ``path`` is such a file or a folder searched recursively.
Nothing goes through Hugging Face ``datasets`` (no Arrow conversion, no cache).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from boost_titan.data.sources import CorpusBuildError

SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")
PARQUET_BATCH_ROWS = 1024


@dataclass
class ReadStats:
    """What has been read so far: updated as documents are yielded."""

    files: int = 0  # files opened
    docs: int = 0
    bytes: int = 0  # UTF-8 bytes of the yielded texts
    current: str = ""


def find_files(path: str | Path) -> list[Path]:
    """The readable files under ``path`` (itself if a file), sorted; a clear error if none."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CorpusBuildError(f"--from {str(path)!r} does not exist")
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise CorpusBuildError(
                f"--from {str(path)!r} has suffix {p.suffix!r}; readable: {list(SUFFIXES)}"
            )
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
    if not files:
        seen = sorted({f.suffix or f.name for f in p.rglob("*") if f.is_file()})[:10]
        raise CorpusBuildError(
            f"--from {str(path)!r} holds no {'/'.join(SUFFIXES)} files (found {seen or 'nothing'})"
        )
    return files


def _field(sample, field: str, where: str) -> str:
    if not isinstance(sample, dict):
        raise CorpusBuildError(
            f"{where} is a JSON {type(sample).__name__}, not an object with a {field!r} field"
        )
    if field not in sample:
        raise CorpusBuildError(
            f"{where} has no text field {field!r} (fields: {sorted(sample)[:20]}); "
            f"pick one with --text-field"
        )
    text = sample[field]
    if not isinstance(text, str):
        raise CorpusBuildError(f"{where}: field {field!r} is {type(text).__name__}, not a string")
    return text


def _json_lines(f, path: Path, field: str, first_line: int = 1) -> Iterator[str]:
    for n, line in enumerate(f, first_line):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
        except ValueError as e:
            raise CorpusBuildError(f"{path} line {n} is not JSON: {e}") from None
        yield _field(sample, field, f"{path} line {n}")


def _read_json(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if not head.startswith("["):
            yield from _json_lines(f, path, field)
            return
        try:
            samples = json.load(f)  # a JSON array cannot be streamed without a parser
        except ValueError as e:
            raise CorpusBuildError(f"{path} is not JSON: {e}") from None
    for n, sample in enumerate(samples):
        yield _field(sample, field, f"{path} item {n}")


def _read_parquet(path: Path, field: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise CorpusBuildError(
            f"{path} has no text column {field!r} (columns: {names[:20]}); "
            f"pick one with --text-field"
        )
    row = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field]):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise CorpusBuildError(
                    f"{path} row {row}: column {field!r} is {type(text).__name__}, not a string"
                )
            row += 1
            yield text


def read_file(path: Path, field: str) -> Iterator[str]:
    """The documents of one file, lazily (``field`` is ignored for ``.txt``)."""
    if path.suffix == ".txt":
        yield path.read_text(encoding="utf-8")
    elif path.suffix == ".parquet":
        yield from _read_parquet(path, field)
    elif path.suffix == ".json":
        yield from _read_json(path, field)
    else:
        with open(path, encoding="utf-8") as f:
            yield from _json_lines(f, path, field)


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
