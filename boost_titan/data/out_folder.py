"""What ``data tokenize`` and ``data seal`` may write or remove in their ``--out`` folder:
files of their own, and nothing else.

A file in ``--out`` is ours when one of our own records names it:

* ``corpus.json`` when it is a tokenized corpus' manifest (``format``, any version), and
  every file of the folder it lists: a tokenized part's ``.bin``, ``.idx`` and record
  (``part-NNNNN.json``), each part's block digests (``part-NNNNN.blocks``);
* a part record ``part-NNNNN.json`` of ``data tokenize`` (a run killed, or a shard of a
  run over machines, before its ``corpus.json``): the record of part NNNNN of a plan,
  and the files of that part;
* a temporary of one of those names (``NAME.tmp.PID``: a writer killed before its
  rename).

Anything else (a user's ``part-00000.jsonl`` or ``notes.txt``, a folder, a
``corpus.json`` that is not a manifest of ours) is not, and a command whose ``--out``
holds one refuses in one line naming it -- the first such name in sorted order, so the
same folder always names the same file -- before it writes anything: ours would be
written next to, or over, what a user put there. Removal (``data tokenize --force``,
and the block digests a new ``data seal`` no longer lists) removes only files named by
our own records (:func:`own_files`), never a user's."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from boost_titan.data.files import read_regular
from boost_titan.data.local_text import CorpusError
from boost_titan.data.tokenized import FORMAT, MANIFEST

PART_FILES = (".bin", ".idx", ".json", ".blocks")
_RECORD = re.compile(r"part-(\d{5})\.json")
_TEMPORARY = re.compile(r"(corpus\.json|part-\d{5}\.(bin|idx|json|blocks))\.tmp\.\d+")


def _json(path: str) -> Any:
    try:
        return json.loads(read_regular(path))
    except (CorpusError, ValueError, RecursionError):
        return None


def own_manifest(out: str) -> dict[str, Any] | None:
    """``out``'s ``corpus.json`` when it is a manifest of ours (any version), else None."""
    manifest = _json(os.path.join(out, MANIFEST))
    ours = isinstance(manifest, dict) and manifest.get("format") == FORMAT
    return manifest if ours and isinstance(manifest.get("parts"), list) else None


def listed(manifest: dict[str, Any]) -> set[str]:
    """The files of the corpus folder a manifest of ours names (never a path outside it:
    sealed Megatron files are the user's, where they lie)."""
    names = {MANIFEST}
    for part in manifest["parts"]:
        if not isinstance(part, dict):
            continue
        prefix, blocks = part.get("prefix"), part.get("blocks")
        if isinstance(prefix, str) and _plain(prefix):
            names.update(prefix + s for s in PART_FILES)
        if isinstance(blocks, dict) and isinstance(blocks.get("file"), str):
            if _plain(blocks["file"]):
                names.add(blocks["file"])
    return names


def _plain(name: str) -> bool:
    return bool(name) and "/" not in name and name not in (".", "..")


def own_files(out: str, names: list[str]) -> set[str]:
    """Which of ``names`` (the entries of ``out``) are ours (module docstring), less
    temporaries."""
    ours = set()
    manifest = own_manifest(out) if MANIFEST in names else None
    if manifest is not None:
        ours |= listed(manifest)
    for name in names:
        m = _RECORD.fullmatch(name)
        if m and name not in ours:
            record = _json(os.path.join(out, name))
            if isinstance(record, dict) and record.get("part") == int(m.group(1)):
                if isinstance(record.get("plan"), str):
                    ours.update(name[: -len(".json")] + s for s in PART_FILES)
    return ours & set(names)


def check_out(out: str, command: str) -> list[str]:
    """The names of ``out``'s files that are ours (temporaries included); refused in one
    line when ``out`` is not a folder or holds anything that is not ours."""
    if not os.path.lexists(out):
        return []
    if os.path.islink(out) and not os.path.exists(out):
        raise CorpusError(f"{command} --out {out} is a symbolic link to nothing")
    if not os.path.isdir(out):
        raise CorpusError(f"{command} --out {out} is a file, not a folder")
    names = sorted(os.listdir(out))
    ours = own_files(out, names)
    foreign = [n for n in names if n not in ours and not _TEMPORARY.fullmatch(n)]
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise CorpusError(
            f"{command} --out {out} holds {foreign[0]!r}{more}, which is not a file of a "
            "corpus boost_titan wrote: nothing of yours is written over or removed; give a "
            "new or empty folder, or one holding only a corpus this command wrote"
        )
    return names


def remove(out: str, names: set[str]) -> None:
    """Remove ``names`` of ``out`` (files :func:`own_files` found ours), the manifest
    first: the folder is no corpus from the first removal on."""
    for name in sorted(names, key=lambda n: n != MANIFEST):
        try:
            os.remove(os.path.join(out, name))
        except FileNotFoundError:
            pass
