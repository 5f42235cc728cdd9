"""The documents of the global order (``boost_titan.data.order``), read from a cursor.

A source yields every document in corpus order from a cursor ``(epoch, file, doc)`` on,
each with the cursor right after it, pass after pass (``infinite``) or to the end of the
pass; :func:`chunks` groups them for the DataLoader workers and reads the texts of the
chunks a process tokenizes.

``SavedSource``  a map-style ``datasets.Dataset`` (``boost_corpus``, a ``local_text``
                 ``save_to_disk`` folder, any registered dataset whose loader returns
                 one): document ``i`` is row ``i``; a chunk another worker tokenizes is
                 skipped by arithmetic, nothing read
``FileSource``   a ``local_text`` corpus of files (``boost_titan.data.local_text``):
                 files in path order, documents in file order, the holdout rule on each
                 document's index in its file; every process parses every document
                 (a few percent of tokenizing it) and tokenizes only its own chunks
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from boost_titan.data import local_text
from boost_titan.data.local_text import CorpusError, Corpus
from boost_titan.data.order import Cursor


class SavedSource:
    def __init__(self, name: str, dataset, text_of: Callable[[dict], str] | None, field: str):
        """``text_of(row)``: the text of a row (a registered dataset's sample
        processor); None: the column ``field``."""
        if len(dataset) == 0:
            raise CorpusError(f"{name}: the dataset holds no documents")
        self.name, self.dataset, self.text_of, self.field = name, dataset, text_of, field

    def __len__(self) -> int:
        return len(self.dataset)

    def documents(self, cursor: Cursor, infinite: bool) -> Iterator[tuple[Cursor, int]]:
        epoch, _, doc = cursor
        n = len(self.dataset)
        while True:
            for i in range(doc, n):
                yield (epoch, 0, i + 1), i
            if not infinite:
                return
            epoch, doc = epoch + 1, 0

    def texts(self, refs: list[int]) -> list[str]:
        out: list[str] = []
        for _, run in itertools.groupby(enumerate(refs), key=lambda p: p[1] - p[0]):
            idx = [i for _, i in run]  # consecutive rows: one slice
            if self.text_of is None:
                out += self.dataset[idx[0] : idx[-1] + 1][self.field]
            else:
                batch = self.dataset[idx[0] : idx[-1] + 1]
                out += [self.text_of(dict(zip(batch, row))) for row in zip(*batch.values())]
        return out


class FileSource:
    def __init__(self, name: str, corpus: Corpus):
        self.name, self.corpus = name, corpus

    def documents(self, cursor: Cursor, infinite: bool) -> Iterator[tuple[Cursor, str]]:
        c = self.corpus
        epoch, first_file, first_doc = cursor
        while True:
            read = 0
            for f in range(first_file, len(c.files)):
                docs = local_text.raw_documents(c.files[f], c.kind, c.text_field)
                skip = first_doc if f == first_file else 0
                for i, text in enumerate(docs):
                    if i >= skip and local_text.keeps(i, c.holdout_every, c.held):
                        read += 1
                        yield (epoch, f, i + 1), text
            if not infinite:
                return
            if not read and (first_file, first_doc) == (0, 0):  # a whole pass, nothing
                raise CorpusError(
                    f"{self.name}: a whole pass over {c.path!r} read no document; check the "
                    "files and [training] dataset_holdout_every"
                )
            epoch, first_file, first_doc = epoch + 1, 0, 0

    def texts(self, refs: list[str]) -> list[str]:
        return refs


def chunks(
    source, cursor: Cursor, size: int, infinite: bool, wanted: Callable[[int], bool]
) -> Iterator[tuple[list[Cursor], list[str] | None]]:
    """Chunk after chunk of ``size`` documents from ``cursor``: the cursors after each
    document, and their texts where ``wanted(chunk_index)`` (else None)."""
    docs = source.documents(cursor, infinite)
    for c in itertools.count():
        block: list[Any] = list(itertools.islice(docs, size))
        if not block:
            return
        afters = [after for after, _ in block]
        yield afters, (source.texts([ref for _, ref in block]) if wanted(c) else None)
