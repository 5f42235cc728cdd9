"""Whole-document train/validation split, and the content hash of a split."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from boost_titan.data.corpus.clean import Doc

VAL_FRACTION = 0.02
MIN_DOCS_FOR_FORCED_VAL = 10  # a source with at least this many docs always gets >= 1 val doc


def _val_score(source: str, doc_id: str) -> float:
    digest = hashlib.sha256(f"{source}\x00{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_documents(docs: list[Doc]) -> tuple[list[Doc], list[Doc]]:
    """Whole-document split: a doc goes to validation iff hash(source, doc_id) < VAL_FRACTION;
    a source with >= MIN_DOCS_FOR_FORCED_VAL docs and no val doc gives its lowest-hash doc."""
    by_source: dict[str, list[Doc]] = {}
    for d in docs:
        by_source.setdefault(d.source, []).append(d)
    train, val = [], []
    for source in sorted(by_source):
        sdocs = by_source[source]
        scores = {d.doc_id: _val_score(source, d.doc_id) for d in sdocs}
        is_val = {d.doc_id: scores[d.doc_id] < VAL_FRACTION for d in sdocs}
        if len(sdocs) >= MIN_DOCS_FOR_FORCED_VAL and not any(is_val.values()):
            is_val[min(sdocs, key=lambda d: (scores[d.doc_id], d.doc_id)).doc_id] = True
        for d in sdocs:
            (val if is_val[d.doc_id] else train).append(d)
    key = lambda d: (d.source, d.doc_id)  # noqa: E731
    return sorted(train, key=key), sorted(val, key=key)


def texts_sha256(docs: Iterable[Doc]) -> str:
    """Content hash of a split: sha256 over source, doc_id and text of every row, in order."""
    h = hashlib.sha256()
    for d in docs:
        for field in (d.source, d.doc_id, d.text):
            b = field.encode("utf-8")
            h.update(len(b).to_bytes(8, "little"))
            h.update(b)
    return h.hexdigest()
