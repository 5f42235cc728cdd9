"""Your own corpus on disk (``[training] dataset = "local_text"``): which files it is,
the checks made before the model is built, and the documents read from them (by
``boost_titan.data.text_sources``, which tokenizes them once into the cache that
training reads: ``boost_titan.data.cache``).

``dataset_path`` is one of:

* a ``save_to_disk`` folder (it holds ``dataset_info.json`` or ``state.json``): already
  Arrow on disk, memory-mapped and read by row;
* a ``.jsonl`` / ``.json`` / ``.txt`` / ``.parquet`` file, or a folder holding files of
  one of those formats (searched recursively, sorted by path; names starting with ``.``
  are skipped): **streamed**, each file read one document at a time, with no copy into
  the Hugging Face datasets cache (``load_dataset`` without streaming would first
  convert the whole corpus to Arrow in ``~/.cache/huggingface``, on every node).

Formats: ``.jsonl`` one JSON object per line (blank lines skipped); ``.json`` either
JSON Lines or one top-level array of objects (streamed element by element, never
loaded whole); ``.parquet`` a column (read in record batches); ``.txt`` one document per
file (an empty file holds none). The document text is the field ``[training] dataset_text_field``
(default ``"text"``; not used by ``.txt``).

:func:`find_corpus` and :func:`check_corpus` refuse, in one line naming the path, file
and sample: a path with no readable files of these formats, mixed formats, files that
hold no document at all, and a first document without the text field. A later
document without it stops the tokenization with the same line (file and line/row).

``[training] dataset_holdout_files = N`` holds the last N files (in path order) out of
training (:func:`split_holdout`), ``dataset_holdout_every = N`` the N-th, 2N-th, ...
document of each file (:func:`split_every`; also for a one-file corpus);
``[validation] dataset = "local_text_holdout"`` reads exactly those.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
HOLDOUT_DATASET = "local_text_holdout"
LOCAL_DATASETS = ("local_text", HOLDOUT_DATASET)


class CorpusError(ValueError):
    """A local corpus that cannot be read as asked: one line naming the file and sample."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    path: str
    kind: str  # "saved" (a save_to_disk folder, map-style) or "json" / "text" / "parquet"
    files: tuple[str, ...]  # the files streamed, in path order; () for "saved"
    text_field: str = "text"
    held_out: int = 0  # files after these, held out for validation (dataset_holdout_files)
    # dataset_holdout_every = N: the N-th, 2N-th, ... document of each file is validation's
    holdout_every: int = 0
    held: bool = False  # with holdout_every: this corpus is those documents (else the rest)

    @property
    def streamed(self) -> bool:
        return self.kind != "saved"

    def suffixes(self) -> str:
        return "/".join(sorted({Path(f).suffix for f in self.files}))


def is_saved_dataset(path: str) -> bool:
    p = Path(path)
    return p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists())


def visible_files(root: Path) -> list[Path]:
    """Every file under the folder ``root``, recursively, sorted by path; names starting
    with ``.`` (and everything under such folders) are skipped, as editors' and tools'
    own files are."""
    return sorted(
        f
        for f in root.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(root).parts)
    )


def find_corpus(path: str, text_field: str = "text") -> Corpus:
    """The corpus at ``path``: a saved dataset, one file, or a folder's files of one format."""
    p = Path(path)
    if not p.exists():
        raise CorpusError(f"local_text: dataset_path {path!r} does not exist")
    if is_saved_dataset(path):
        return Corpus(path, "saved", (), text_field)
    if p.is_file():
        if p.suffix not in FORMATS:
            raise CorpusError(
                f"local_text: {path!r} is a {p.suffix or 'suffix-less'} file; valid formats: "
                f"{sorted(FORMATS)} (or a folder of them, or a save_to_disk folder)"
            )
        return Corpus(path, FORMATS[p.suffix], (str(p),), text_field)
    found = visible_files(p)
    files = [f for f in found if f.suffix in FORMATS]
    if not files:
        others = sorted({f.suffix or f.name for f in found})
        raise CorpusError(
            f"local_text: folder {path!r} holds no {'/'.join(sorted(FORMATS))} files "
            f"({len(found)} other files{': ' + ', '.join(others[:8]) if others else ''}); "
            "point dataset_path at a file or folder of one of these formats, or a "
            "save_to_disk folder"
        )
    kinds = {FORMATS[f.suffix] for f in files}
    if len(kinds) != 1:
        by_kind = {k: [f for f in files if FORMATS[f.suffix] == k] for k in sorted(kinds)}
        detail = "; ".join(f"{len(v)} {k} (e.g. {v[0]})" for k, v in by_kind.items())
        raise CorpusError(
            f"local_text: folder {path!r} mixes formats: {detail}; keep one format per corpus"
        )
    return Corpus(path, kinds.pop(), tuple(str(f) for f in files), text_field)


def split_every(corpus: Corpus, every: int) -> tuple[Corpus, Corpus]:
    """(training, held-out) corpora: every ``every``-th document of each file (the
    ``every``-th, 2 ``every``-th, ...) is held out; both read every file."""
    if not corpus.streamed:
        raise CorpusError(
            f"local_text: dataset_holdout_every = {every} needs a corpus of files; "
            f"{corpus.path!r} is a save_to_disk folder (split it with "
            "Dataset.train_test_split and point [validation] dataset_path at the test part)"
        )
    if every < 2:
        raise CorpusError(
            f"local_text: dataset_holdout_every = {every} must be >= 2 (every N-th document "
            "of each file is held out: 1/N of the corpus)"
        )
    train = dataclasses.replace(corpus, holdout_every=every, held=False)
    return train, dataclasses.replace(corpus, holdout_every=every, held=True)


def split_holdout(corpus: Corpus, n_files: int) -> tuple[Corpus, Corpus]:
    """(training, held-out) corpora: the last ``n_files`` files are held out."""
    if not corpus.streamed:
        raise CorpusError(
            f"local_text: dataset_holdout_files = {n_files} needs a corpus of files; "
            f"{corpus.path!r} is a save_to_disk folder (split it with "
            "Dataset.train_test_split and point [validation] dataset_path at the test part)"
        )
    if not 0 < n_files < len(corpus.files):
        raise CorpusError(
            f"local_text: dataset_holdout_files = {n_files} must be between 1 and "
            f"{len(corpus.files) - 1}: {corpus.path!r} holds {len(corpus.files)} "
            f"{corpus.suffixes()} files and training keeps at least one"
        )
    keep = len(corpus.files) - n_files
    train = dataclasses.replace(corpus, files=corpus.files[:keep], held_out=n_files)
    return train, dataclasses.replace(corpus, files=corpus.files[keep:])


# ---------------------------------------------------------------------------------------
# Reading documents: each yields (where, text), where = "line 3" / "row 7" / "item 2"


def _missing(file: str, where: str, field: str, found) -> CorpusError:
    return CorpusError(
        f"local_text: {file} {where} has no text field {field!r} (fields: {sorted(found)}); "
        "set [training] dataset_text_field to the field holding the document text "
        "(--text-field for `boost-titan data tokenizer`)"
    )


def _text_of(obj, file: str, where: str, field: str) -> str:
    if not isinstance(obj, dict):
        raise CorpusError(
            f"local_text: {file} {where} is a JSON {type(obj).__name__}, not an object "
            f"with a {field!r} field"
        )
    if field not in obj:
        raise _missing(file, where, field, obj)
    text = obj[field]
    if not isinstance(text, str):
        raise CorpusError(
            f"local_text: {file} {where} field {field!r} is a {type(text).__name__}, not a string"
        )
    return text


_ARRAY_CHUNK = 1 << 20  # characters first read at a time from a top-level JSON array


class _ArrayReader:
    """The elements of a top-level JSON array, decoded one at a time as the file is read:
    a corpus that is one array is streamed like JSON Lines, never loaded whole (memory:
    the largest element, not the file)."""

    def __init__(self, f, file: str):
        self.f, self.file = f, file
        self.buf, self.pos, self.eof = "", 0, False
        self.decoder = json.JSONDecoder()

    def _more(self) -> bool:
        """Drop what is consumed, read more (at least as much as is buffered: an element
        spanning many chunks is re-decoded a logarithmic number of times)."""
        if self.eof:
            return False
        chunk = self.f.read(max(_ARRAY_CHUNK, len(self.buf) - self.pos))
        self.eof = not chunk
        self.buf, self.pos = self.buf[self.pos :] + chunk, 0
        return bool(chunk)

    def _next_char(self) -> str:
        """The next non-space character (not consumed); "" at the end of the file."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self._more():
                return self.buf[self.pos : self.pos + 1]

    def _bad(self, why: str) -> CorpusError:
        return CorpusError(f"local_text: {self.file} is not valid JSON: {why}")

    def _element(self) -> object:
        while True:
            try:
                obj, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as e:
                if self._more():  # the element may go on in the rest of the file
                    continue
                raise self._bad(e.msg) from None
            if end == len(self.buf) and self._more():  # a number may go on: decode again
                continue
            self.pos = end
            return obj

    def __iter__(self) -> Iterator[object]:
        if self._next_char() != "[":
            raise self._bad("it does not start with '['")
        self.pos += 1
        if self._next_char() == "]":
            return
        while True:
            self._next_char()
            yield self._element()
            c = self._next_char()
            if c == "]":
                self.pos += 1
                if self._next_char():
                    raise self._bad("more after the array's closing ']'")
                return
            if c != ",":
                found = repr(self.buf[self.pos : self.pos + 20]) if c else "the end of the file"
                raise self._bad(f"expected ',' or ']' after item, found {found}")
            self.pos += 1


def _json_documents(file: str, field: str) -> Iterator[tuple[str, str]]:
    with open(file, encoding="utf-8") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if head.startswith("["):  # one top-level array: streamed element by element
            for i, obj in enumerate(_ArrayReader(f, file)):
                yield f"item {i}", _text_of(obj, file, f"item {i}", field)
            return
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip())
            except json.JSONDecodeError as e:
                raise CorpusError(
                    f"local_text: {file} line {n} is not valid JSON ({e.msg} at column {e.colno})"
                ) from None
            yield f"line {n}", _text_of(obj, file, f"line {n}", field)


def _parquet_documents(file: str, field: str) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(file)
    names = pf.schema_arrow.names
    if field not in names:
        if pf.metadata.num_rows == 0:
            return
        raise _missing(file, "row 0", field, names)
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise CorpusError(
                    f"local_text: {file} row {row} field {field!r} is "
                    f"{'null' if text is None else type(text).__name__}, not a string"
                )
            yield f"row {row}", text
            row += 1


def _text_documents(file: str, field: str) -> Iterator[tuple[str, str]]:
    with open(file, encoding="utf-8") as f:
        text = f.read()
    if text:
        yield "(the whole file)", text


_READERS = {"json": _json_documents, "parquet": _parquet_documents, "text": _text_documents}


def read_documents(file: str | Path, text_field: str) -> Iterator[str]:
    """The document texts of one ``.jsonl`` / ``.json`` / ``.txt`` / ``.parquet`` file,
    lazily: the one reader of corpus files (training streams them through
    :func:`documents`, ``boost-titan data tokenizer`` samples them)."""
    for _, text in _READERS[FORMATS[Path(file).suffix]](str(file), text_field):
        yield text


def documents(
    files: list[str], kind: str, text_field: str, every: int = 0, held: bool = False
) -> Iterator[dict]:
    """Every document of ``files`` in order, as ``{"text": ...}``: the generator behind
    the streamed dataset (one shard per file: ``files`` is the list it shards). With
    ``every``: only the held-out documents (``held``) or only the others."""
    read = _READERS[kind]
    for file in files:
        for i, (_, text) in enumerate(read(file, text_field)):
            if keeps(i, every, held):
                yield {"text": text}


def keeps(index: int, every: int, held: bool) -> bool:
    """Whether a corpus with ``dataset_holdout_every = every`` reads a file's document
    number ``index`` (from 0): the held-out corpus (``held``) every ``every``-th, the
    training corpus the others; with ``every`` 0, every document."""
    return not every or (index % every == every - 1) == held


def raw_documents(file: str, kind: str, text_field: str) -> Iterator[str]:
    """Every document text of one file, held-out ones included (their index in the
    file is the index :func:`keeps` takes)."""
    for _, text in _READERS[kind](file, text_field):
        yield text


def stream(corpus: Corpus):
    """The corpus as a Hugging Face ``IterableDataset`` with one shard per file: files
    are opened as iteration reaches them and nothing is written to the datasets cache.
    Its ``state_dict`` is (epoch, file index, documents read in that file)."""
    from datasets import Features, IterableDataset, Value

    return IterableDataset.from_generator(
        documents,
        gen_kwargs={
            "files": list(corpus.files),
            "kind": corpus.kind,
            "text_field": corpus.text_field,
            "every": corpus.holdout_every,
            "held": corpus.held,
        },
        features=Features({"text": Value("string")}),
    )


# ---------------------------------------------------------------------------------------
# Checks before the model is built


def _parquet_first(file: str, field: str) -> str | None:
    """The footer only: the column and the row count (reading a row would read a whole
    column chunk, possibly hundreds of MB)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(file)
    if meta.metadata.num_rows == 0:
        return None
    if field not in meta.schema_arrow.names:
        raise _missing(file, "row 0", field, meta.schema_arrow.names)
    return "row 0"


def _first_document(file: str, kind: str, field: str) -> str | None:
    try:
        if kind == "parquet":
            return _parquet_first(file, field)
        for where, _ in _READERS[kind](file, field):
            return where
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"local_text: cannot read {file}: {e}") from None
    except Exception as e:  # pyarrow's errors on a file that is not parquet
        if isinstance(e, CorpusError):
            raise
        raise CorpusError(f"local_text: cannot read {file} as {kind}: {e}") from None
    return None


def check_corpus(corpus: Corpus) -> None:
    """Every file readable with a first document holding the text field (an empty file
    holds none and is passed over), and at least one document. Reads one document per
    file (.parquet: its footer; a saved dataset: its columns)."""
    if not corpus.streamed:
        from datasets import load_from_disk

        ds = load_from_disk(corpus.path)
        columns = getattr(ds, "column_names", None)
        if isinstance(columns, dict):  # a DatasetDict
            raise CorpusError(
                f"local_text: {corpus.path!r} is a saved DatasetDict with splits "
                f"{sorted(columns)}; point dataset_path at one split's folder"
            )
        if corpus.text_field not in columns:
            raise _missing(corpus.path, "(every row)", corpus.text_field, columns)
        if len(ds) == 0:
            raise CorpusError(f"local_text: saved dataset {corpus.path!r} holds no documents")
        return
    empty = [f for f in corpus.files if _first_document(f, corpus.kind, corpus.text_field) is None]
    if len(empty) == len(corpus.files):
        raise CorpusError(
            f"local_text: {corpus.path!r} holds no documents: its {len(empty)} "
            f"{corpus.suffixes()} file(s) are empty"
        )
