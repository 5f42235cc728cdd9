"""``boost-titan checkpoint verify``: every byte of a checkpoint step checked against the
digests its save recorded, without loading it or any config. It never prints a
traceback and never blocks on a file: every problem is one line."""

from __future__ import annotations

import io
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.utils import _create_file_view

from boost_titan.checkpoint import safe_metadata
from boost_titan.checkpoint.integrity import legacy
from boost_titan.checkpoint.integrity.blocks import (
    ALGORITHM,
    BLOCK,
    ChecksumMismatch,
    Item,
    VerifyingReader,
    describe,
    segment_blocks,
)
from boost_titan.checkpoint.integrity.dcp_hooks import trailers_line, unverified_line
from boost_titan.checkpoint.integrity.folder_seal import shares
from boost_titan.checkpoint.integrity.manifest import METADATA, NAME, key, step_of
from boost_titan.checkpoint.integrity.step import HF_INDEX, SEALED, TRAILERS, UNVERIFIED, open_step
from boost_titan.checkpoint.model_tokenizer import TOKENIZER_DIR
from boost_titan.config import Parser
from boost_titan.models.recorded import MODEL_ARGS_FILE

logger = logging.getLogger()  # torchtitan's logger (the root logger), as boost_titan.train.fault

_CHUNK = 8 * BLOCK


@dataclass
class Verification:
    """What :func:`check` found in one step folder."""

    folder: str
    problems: list[str] = field(default_factory=list)  # one line each
    unlisted: list[str] = field(default_factory=list)  # files its manifest does not list
    trust: str = SEALED  # SEALED, TRAILERS, or UNVERIFIED (nothing to verify)
    items: int = 0
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def checksummed(self) -> bool:
        return self.trust != UNVERIFIED


def _read_through(reader, buf: memoryview, keep: bool) -> bytes:
    """Read ``reader`` to its end (every block checked); its bytes if ``keep``."""
    kept = bytearray() if keep else None
    while n := reader.readinto(buf):
        if kept is not None:
            kept += buf[:n]
    return bytes(kept) if kept is not None else b""


def _check_train_state(folder: str, data: bytes, out: Verification) -> None:
    """A full save's ``train_state.step`` is the N of the ``step-N`` it was saved as."""
    import torch

    named = step_of(os.path.basename(os.path.normpath(folder)))
    try:
        saved = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001
        out.problems.append(
            f"checkpoint {folder} is corrupted: its train_state.step cannot be read ({e})"
        )
        return
    if named is not None and saved != named:
        out.problems.append(
            f"checkpoint {folder} is corrupted: its train_state.step is {saved}, the folder "
            f"is step {named} (a step saved under another step's name)"
        )


def _verify_items(step, relative: str, items: list, out: Verification, buf: memoryview) -> None:
    """Every item of one file; its problems as one line (the first item that differs,
    and how many more do: a stale file differs in all of them)."""
    folder = step.folder
    first, more = None, 0
    with open(os.path.join(folder, relative), "rb") as f:  # a regular file: open_step
        for index, info in sorted(items, key=lambda it: it[1].offset):
            item = Item(folder, relative, describe(index), info.offset, "")
            out.items += 1
            out.nbytes += info.length
            raw = _create_file_view(f, info.offset, info.length)
            try:
                if step.seal is not None:
                    entry = step.seal.items[key(index)]
                    blocks = segment_blocks(entry.segments, step.seal.block)
                    reader = VerifyingReader(raw, entry.length, entry.digests, item, blocks)
                else:
                    reader = legacy.reader(raw, info.length, item)
                data = _read_through(reader, buf, keep=index.fqn == "train_state.step")
            except ChecksumMismatch as e:
                if first is None:
                    first = str(e)
                else:
                    more += 1
                continue
            if index.fqn == "train_state.step":
                _check_train_state(folder, data, out)
    if first is not None:
        out.problems.append(
            first + (f" (and {more} more of its {len(items)} items)" if more else "")
        )


def _verify_files(step, out: Verification, buf: memoryview, share=None) -> None:
    """A sealed Hugging Face folder: every file against its digests; ``share`` (rank,
    world): only that rank's run of blocks (``folder_seal.shares``)."""
    files = step.seal.files
    if share is None:
        runs = [(name, 0, None) for name in sorted(files)]
    else:
        rank, world = share
        runs = shares({name: e.bytes for name, e in files.items()}, world, step.seal.block)[rank]
    for name, k, j in runs:
        entry = files[name]
        blocks = segment_blocks([entry.bytes], step.seal.block)
        j = len(blocks) if j is None else j
        start, end = (blocks[k][0], sum(blocks[j - 1])) if j > k else (0, 0)
        out.items += 1
        out.nbytes += end - start
        item = Item(step.folder, name, "the file", 0, "")
        with open(os.path.join(step.folder, name), "rb") as f:
            reader = VerifyingReader(f, entry.bytes, entry.digests or b"", item, blocks)
            reader.seek(start)
            try:
                while start < end:  # (a run ends on a block's end: each block checked whole)
                    start += reader.readinto(buf[: min(len(buf), end - start)])
            except ChecksumMismatch as e:
                out.problems.append(str(e))


# what a step folder holds besides the files its manifest lists: the manifest itself,
# and the model record and tokenizer a conversion writes (checked when read:
# models.recorded, checkpoint.model_tokenizer)
_SIDE_FILES = frozenset({NAME, MODEL_ARGS_FILE, TOKENIZER_DIR})


def _unlisted(step) -> list[str]:
    """Entries of a sealed step folder its manifest does not list (no load reads them:
    reported, not refused); one listdir."""
    if step.seal is None:
        return []
    return sorted(set(os.listdir(step.folder)) - set(step.seal.files) - _SIDE_FILES)


def _check(folder: Path, out: Verification, share) -> None:
    if not os.path.lexists(folder):
        out.problems.append(f"{folder} is not a DCP checkpoint: it does not exist")
        return
    step = open_step(folder, "", whole=True)  # (every section, every file)
    out.trust = step.trust
    out.unlisted = _unlisted(step)
    buf = memoryview(bytearray(_CHUNK))
    if step.format == "hf":
        if step.seal is not None:
            _verify_files(step, out, buf, share)
        return
    if share is not None:
        raise ValueError(f"a share of the checks is for Hugging Face folders; {folder} is DCP")
    if step.trust == UNVERIFIED:
        return
    per_file: dict[str, list] = {}
    for index, info in step.metadata.storage_data.items():
        per_file.setdefault(info.relative_path, []).append((index, info))
    for relative, items in sorted(per_file.items()):
        _verify_items(step, relative, items, out, buf)


def check(step_dir: str | os.PathLike, share: tuple[int, int] | None = None) -> Verification:
    """Verify one step folder without loading it and without torch.distributed: the
    step opened as every load opens it (``step.open_step``: folder, manifest, files,
    ``.metadata``), then every stored byte against its digests, each file read once.
    ``share`` (rank, world): a Hugging Face folder's bytes checked only over that
    rank's run of its blocks (``folder_seal``: the ranks of a load share the work)."""
    folder = Path(step_dir)
    out = Verification(str(folder))
    try:
        _check(folder, out, share)
    except (ChecksumMismatch, safe_metadata.UntrustedCheckpointError) as e:
        out.problems.append(str(e))
    except Exception as e:  # noqa: BLE001  (verify names every problem in one line)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        out.problems.append(f"checkpoint {folder} cannot be verified: {type(e).__name__}: {first}")
    return out


def verify(path: str | os.PathLike) -> list[str]:
    """The problems of one step folder, one line each (empty: verified, or a checkpoint
    without checksums: see :func:`check`)."""
    return check(path).problems


_STEP = re.compile(r"step-(\d+)")


def step_folders(folder: str | os.PathLike) -> list[Path]:
    """``step-N`` entries of ``folder`` (torchtitan's checkpoint folder) that are or
    point to folders, newest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    steps = [
        (int(m[1]), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(steps, reverse=True)]


def newest_verified(folder: str | os.PathLike) -> tuple[str | None, list[str]]:
    """(the newest complete step folder under ``folder`` that verifies, the first
    problem line of each newer one that does not)."""
    bad = []
    for step in step_folders(folder):
        if not (step / METADATA).is_file() and not (step / HF_INDEX).is_file():
            continue  # cut off (fault.quarantine_incomplete_checkpoints' case)
        result = check(step)
        if result.ok:
            return str(step), bad
        bad.append(result.problems[0])
    return None, bad


def main(argv: list[str]) -> int:
    """``boost-titan checkpoint verify PATH [PATH ...]``; returns the exit code."""
    import sys

    p = Parser(
        prog="boost-titan checkpoint verify",
        description="Verify checkpoint steps without loading them: the step's manifest, "
        "then every stored byte against the digests its save recorded. Exit 0 when "
        "everything verifies, 1 with one line per problem otherwise. A checkpoint "
        "written without checksums (before boost_titan checksummed checkpoints, or by "
        "another writer) cannot be verified: it prints an 'unverified' line and does "
        "not change the exit code.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="a step folder (<dump_folder>/checkpoint/step-N), or a folder of step-N "
        "folders (each is verified)",
    )
    args = p.parse_args(argv)
    status = 0
    for path in map(Path, args.paths):
        plain = path.is_dir() and not path.is_symlink()
        if plain and not (path / METADATA).exists() and not (path / HF_INDEX).exists():
            steps = sorted(step_folders(path), key=lambda s: int(s.name[5:])) or [path]
        else:
            steps = [path]
        for step in steps:
            result = check(step)
            for line in result.problems:
                print(line, file=sys.stderr)
            if result.unlisted:
                shown = ", ".join(result.unlisted[:5])
                extra = f" and {len(result.unlisted) - 5} more" if len(result.unlisted) > 5 else ""
                print(
                    f"note: {step} holds {len(result.unlisted)} entries its manifest does not "
                    f"list ({shown}{extra}): not part of the sealed step, no load reads them",
                    file=sys.stderr,
                )
            if result.problems:
                status = 1
            elif result.trust == UNVERIFIED:
                print(f"unverified: {unverified_line(str(step))}")
            else:
                note = f": {trailers_line(str(step))}" if result.trust == TRAILERS else ""
                what = "items" if (step / METADATA).exists() else "files"
                print(
                    f"ok: {step} ({result.items} {what}, "
                    f"{result.nbytes / 2**20:.1f} MiB, {ALGORITHM}){note}"
                )
    return status
