"""Text normalisation shared by every source, and the document record the loaders produce."""

from __future__ import annotations

import dataclasses
import re
import unicodedata

from boost_titan.data.tokenizer import SPECIAL_TOKENS

_CTRL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\ufeff]")
_MANY_BLANKS_RE = re.compile(r"\n{4,}")  # more than two blank lines
_GUT_START_RE = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUT_END_RE = re.compile(
    r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
    re.M | re.I,
)


def strip_gutenberg(text: str) -> str:
    """Drop a Project Gutenberg header/footer when the standard markers are present."""
    m = _GUT_START_RE.search(text)
    if m:
        text = text[m.end() :]
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


def decode_bytes(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("cp1252", errors="replace")


@dataclasses.dataclass
class Doc:
    source: str
    doc_id: str
    text: str
