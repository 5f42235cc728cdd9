"""Raw text that ``data tokenize`` reads: the documents of a source, in corpus order, cut
into units that parts of the tokenized corpus are planned from.

``FileText``   a ``local_text`` corpus of .jsonl/.json/.txt/.parquet files
               (``boost_titan.data.local_text``): files in path order, documents in file
               order, the holdout rule applied (``dataset_holdout_every``: which
               documents of each file this corpus is); one unit per file
``SavedText``  a ``save_to_disk`` folder (the embedded corpus' splits, a user's saved
               dataset) or a map-style dataset of torchtitan's registry: rows in order,
               units of about :data:`UNIT_BYTES` of text

Units depend only on the source (never on the number of workers or machines), so a
corpus tokenized by 1 process, 64 workers or 16 machines is the same corpus, part for
part and digest for digest.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from boost_titan.data import local_text
from boost_titan.data.local_text import Corpus, CorpusError

UNIT_BYTES = 64 << 20  # about this much text per unit of a saved dataset (and per part)


@dataclasses.dataclass(frozen=True)
class Unit:
    name: str  # a file, or "rows LO..HI-1"
    bytes: int  # its size on disk (a file) or its share of the dataset's bytes
    start: int = 0  # rows [start, stop) of a saved dataset
    stop: int = 0


class FileText:
    def __init__(self, corpus: Corpus):
        if not corpus.streamed:
            raise ValueError("FileText reads a corpus of files")
        self.corpus = corpus
        self.path = corpus.path

    def identity(self) -> dict[str, Any]:
        c = self.corpus
        root = c.path if os.path.isdir(c.path) else os.path.dirname(c.path)
        return {
            "kind": f"{c.kind} files",
            "path": os.path.abspath(c.path),
            "text_field": c.text_field,
            "files": [[os.path.relpath(f, root), os.path.getsize(f)] for f in c.files],
            "holdout_every": c.holdout_every,
            "held": c.held,
        }

    def units(self) -> list[Unit]:
        return [Unit(f, os.path.getsize(f)) for f in self.corpus.files]

    def texts(self, unit: Unit) -> Iterator[str]:
        c = self.corpus
        for i, text in enumerate(local_text.raw_documents(unit.name, c.kind, c.text_field)):
            if local_text.keeps(i, c.holdout_every, c.held):
                yield text

    def check(self) -> None:
        local_text.check_corpus(self.corpus)


class SavedText:
    """Rows of a map-style ``datasets.Dataset``: the column ``field``, or
    ``text_of(row)`` (a registered dataset's sample processor)."""

    def __init__(self, path: str, field: str = "text", text_of: Callable | None = None,
                 name: str = "", loader: Callable | None = None):  # fmt: skip
        self.path, self.field, self.text_of = path, field, text_of
        self.name, self.loader = name or "saved dataset", loader
        self._data = None

    @property
    def data(self):
        if self._data is None:
            if self.loader is not None:
                self._data = self.loader(self.path)
            else:
                from datasets import load_from_disk

                self._data = load_from_disk(self.path)
        return self._data

    def __getstate__(self):  # workers reopen the memory-mapped dataset
        return {**self.__dict__, "_data": None}

    def identity(self) -> dict[str, Any]:
        data = self.data
        return {
            "kind": self.name,
            "path": os.path.abspath(self.path) if os.path.exists(self.path) else self.path,
            "text_field": self.field if self.text_of is None else "(sample processor)",
            "rows": len(data),
            "fingerprint": getattr(data, "_fingerprint", ""),
        }

    def units(self) -> list[Unit]:
        data = self.data
        rows = len(data)
        size = int(getattr(data, "dataset_size", 0) or data.data.nbytes or 1)
        per_unit = max(1, rows * UNIT_BYTES // max(size, 1))
        return [
            Unit(
                f"rows {lo}..{min(rows, lo + per_unit) - 1}",
                size * (min(rows, lo + per_unit) - lo) // max(rows, 1),
                lo,
                min(rows, lo + per_unit),
            )
            for lo in range(0, rows, per_unit)
        ]  # fmt: skip

    def texts(self, unit: Unit) -> Iterator[str]:
        data = self.data
        for lo in range(unit.start, unit.stop, 1024):
            batch = data[lo : min(unit.stop, lo + 1024)]
            if self.text_of is None:
                yield from batch[self.field]
            else:
                for row in zip(*batch.values()):
                    yield self.text_of(dict(zip(batch, row)))

    def check(self) -> None:
        data = self.data
        columns = getattr(data, "column_names", None)
        if isinstance(columns, dict):
            raise CorpusError(
                f"{self.path!r} is a saved DatasetDict with splits {sorted(columns)}; "
                "point at one split's folder"
            )
        if self.text_of is None and self.field not in columns:
            raise CorpusError(
                f"{self.path!r} has no text column {self.field!r} (columns: {columns}); "
                "set the text field to the column holding the document text"
            )
        if len(data) == 0:
            raise CorpusError(f"{self.path!r} holds no documents")


def source_of(path: str, text_field: str = "text", every: int = 0, held: bool = False):
    """The source at ``path``: a saved dataset folder, or files (``every``/``held``:
    the holdout rule of ``dataset_holdout_every``)."""
    corpus = local_text.find_corpus(path, text_field)
    if not corpus.streamed:
        if every:
            raise CorpusError(
                f"dataset_holdout_every = {every} needs a corpus of files; {path!r} is a "
                "save_to_disk folder"
            )
        return SavedText(path, text_field)
    if every:
        corpus = dataclasses.replace(corpus, holdout_every=every, held=held)
    return FileText(corpus)
