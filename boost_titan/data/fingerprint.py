"""Which files a streamed ``local_text`` position was saved over, checked on resume.

A streamed position (``datasets``' IterableDataset state: pass, file index in the
rank's share, documents read in that file) means nothing once the files change: a file
added, removed or renamed shifts every index after it (and the by-file / by-sample
sharding rule and datasets' per-pass file order are functions of the file list), a
resized file moves document boundaries, another holdout setting changes which
documents count. :func:`fingerprint` records the training corpus' files (names relative
to ``dataset_path``, sizes in bytes) and the holdout in each saved position (the
data-parallel degree is not part of it: the global order is the same at every degree,
``boost_titan.data.order``); :func:`check` compares it with the files read now and refuses a change in
one line (:class:`~boost_titan.checkpoint.data_position.DataResumeError`: a SystemExit, no
traceback per rank) naming what changed and the ways forward.

Names and sizes, not modification times or paths: copying a corpus to another disk or
node (``cp``, ``rsync`` without ``-t``, an object-store download) changes every mtime
and possibly ``dataset_path`` while the position still fits, so those would refuse good
resumes. A file rewritten in place at the same size is not caught (hashing every file
at every start would read the whole corpus). Checkpoints saved before the fingerprint
existed carry none and load as before.
"""

from __future__ import annotations

import os
from typing import Any

from boost_titan.data.local_text import Corpus

KEY = "corpus"  # the fingerprint's key in a saved position
RESTART = (
    "keep the model, optimizer and step and restart the data from its first document "
    "with --checkpoint.exclude_from_loading dataloader"
)


def _relative(corpus: Corpus, file: str) -> str:
    root = corpus.path if os.path.isdir(corpus.path) else os.path.dirname(corpus.path)
    return os.path.relpath(file, root)


def fingerprint(corpus: Corpus) -> dict[str, Any]:
    """Plain data (lists, str, int: what ``safe_metadata.dataloader_state`` unpickles)."""
    return {
        "files": [[_relative(corpus, f), os.path.getsize(f)] for f in corpus.files],
        "holdout_every": corpus.holdout_every,
    }


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What changed between the checkpoint's files and this run's, most telling first."""
    out = []
    before, after = dict(saved["files"]), dict(now["files"])
    added = [n for n in after if n not in before]
    removed = [n for n in before if n not in after]
    if removed:
        out.append(f"{len(removed)} file(s) gone: {_names(removed)}")
    if added:
        out.append(f"{len(added)} file(s) added: {_names(added)}")
    for name in before:
        if name in after and before[name] != after[name]:
            out.append(f"{name} was {before[name]} bytes at the checkpoint, now {after[name]}")
    if not out and [n for n, _ in saved["files"]] != [n for n, _ in now["files"]]:
        out.append("the files are the same but in another order")
    if saved.get("holdout_every") != now.get("holdout_every"):
        out.append(
            f"[training] dataset_holdout_every was {saved.get('holdout_every')} at the "
            f"checkpoint, now {now.get('holdout_every')}"
        )
    return out


def check(saved: dict[str, Any] | None, now: dict[str, Any], name: str, path: str) -> None:
    """Raise :class:`DataResumeError` when ``saved`` (None: a checkpoint saved before
    fingerprints, loaded as before) does not describe the files read now (the
    data-parallel degree that checkpoints of the per-rank loaders recorded is ignored)."""
    if saved is None:
        return
    saved = {k: v for k, v in saved.items() if k != "dp_world_size"}
    if saved == now:
        return
    from boost_titan.checkpoint.data_position import DataResumeError

    what = differences(saved, now) or ["the saved fingerprint differs"]
    n = len(saved["files"])
    raise DataResumeError(
        f"{name}: the checkpoint's data position was saved over other files than "
        f"dataset_path {path!r} holds now ({'; '.join(what)}; {n} training files at the "
        f"checkpoint, {len(now['files'])} now): the saved position (file index and "
        f"documents read in it) would resume at the wrong place; resume with the same "
        f"files, or {RESTART}"
    )
