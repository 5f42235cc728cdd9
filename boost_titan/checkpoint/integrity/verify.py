"""``boost-titan checkpoint verify``: every byte of a checkpoint checked against the
checksums its save recorded, without loading it or any config."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.metadata import Metadata

from boost_titan.checkpoint import safe_metadata
from boost_titan.checkpoint.integrity.dcp_hooks import (
    UNVERIFIED,
    _check_metadata_bytes,
    _consistency,
    _unverified_line,
)
from boost_titan.checkpoint.integrity.trailer import (
    ALGORITHM,
    BLOCK,
    ChecksumMismatch,
    _describe,
    _digest,
    _Item,
    _mismatch,
    _no_trailer,
    _parse_trailer,
    _read_at,
)

logger = logging.getLogger()  # torchtitan's logger (the root logger), as boost_titan.train.fault

# ---------------------------------------------------------------- standalone verification


@dataclass
class Verification:
    """What :func:`check` found in one step folder."""

    folder: str
    problems: list[str] = field(default_factory=list)  # one line each
    checksummed: bool = True  # False: a checkpoint without checksums (nothing to verify)
    items: int = 0
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _metadata_files(folder: Path) -> list[Path]:
    if (folder / filesystem._metadata_fn).is_file():
        return [folder / filesystem._metadata_fn]
    return sorted(
        (
            p
            for p in folder.glob(f"__*{filesystem._metadata_fn}")
            if re.fullmatch(r"__\d+\.metadata", p.name)
        ),
        key=lambda p: int(p.name[2:].split(".")[0]),
    )


def _verify_file(folder: str, path: Path, items: list[tuple[Any, Any]], out: Verification) -> None:
    """Check every block of each (index, storage info) stored in the file at ``path``:
    one line per bad item (its first bad block)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        out.problems.append(
            f"checkpoint {folder} is incomplete: {path.name} ({len(items)} items) cannot be "
            f"read: {e.strerror or e}"
        )
        return
    buf = memoryview(bytearray(BLOCK))
    with f:
        for index, info in sorted(items, key=lambda it: it[1].offset):
            item = _Item(folder, path.name, _describe(index), info.offset, "")
            view = filesystem._create_file_view(f, info.offset, info.length)
            out.items += 1
            out.nbytes += info.length
            try:
                payload, block, digests = _parse_trailer(item, view, info.length)
                data = buf if block == BLOCK else memoryview(bytearray(block))
                for k, start in enumerate(range(0, payload, block)):
                    n = min(block, payload - start)
                    if _read_at(view, start, data[:n]) != n:
                        raise _no_trailer(item, info.length, "the file is shorter")
                    found = _digest(data[:n])
                    if found != digests[8 * k : 8 * k + 8]:
                        raise _mismatch(item, start, start + n, found, digests[8 * k : 8 * k + 8])
            except ChecksumMismatch as e:
                out.problems.append(str(e))


def check(step_dir: str | os.PathLike) -> Verification:
    """Verify one DCP step folder without loading it and without torch.distributed: the
    .metadata against its sidecar (before it is unpickled, with safe_metadata's
    allowlist), then every stored item's trailer, reading each file once."""
    folder = Path(step_dir)
    out = Verification(str(folder))
    metadata_files = _metadata_files(folder)
    if not metadata_files:
        if (folder / "model.safetensors.index.json").is_file():
            out.checksummed = False  # torchtitan's HF format: not checksummed (module doc)
        else:
            why = "does not exist" if not folder.exists() else "has no .metadata"
            out.problems.append(f"{folder} is not a DCP checkpoint: it {why}")
        return out

    def read(p) -> bytes | None:
        return Path(p).read_bytes() if os.path.isfile(p) else None

    for path in metadata_files:
        data = path.read_bytes()
        try:
            sealed = _check_metadata_bytes(read, path, data, "")
            metadata = safe_metadata.loads(data, str(folder))
        except (ChecksumMismatch, safe_metadata.UntrustedCheckpointError) as e:
            out.problems.append(str(e))
            continue
        if not isinstance(metadata, Metadata):
            out.problems.append(
                f"checkpoint {folder}: its {path.name} holds a {type(metadata).__name__}, "
                "not DCP Metadata"
            )
            continue
        problem = _consistency(str(folder), path.name, metadata, sealed, "")
        if problem == UNVERIFIED:
            out.checksummed = False
            continue
        if problem is not None:
            out.problems.append(problem)
            continue
        per_file: dict[str, list[tuple[Any, Any]]] = {}
        for index, info in metadata.storage_data.items():
            per_file.setdefault(info.relative_path, []).append((index, info))
        for relative, items in sorted(per_file.items()):
            _verify_file(str(folder), folder / relative, items, out)
    return out


def verify(path: str | os.PathLike) -> list[str]:
    """The problems of one step folder, one line each (empty: verified, or a checkpoint
    without checksums: see :func:`check`)."""
    return check(path).problems


_STEP = re.compile(r"step-(\d+)")


def step_folders(folder: str | os.PathLike) -> list[Path]:
    """``step-N`` subfolders of ``folder`` (torchtitan's checkpoint folder), newest first."""
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
        if (
            not (step / filesystem._metadata_fn).is_file()
            and not (step / "model.safetensors.index.json").is_file()
        ):
            continue  # cut off (fault.quarantine_incomplete_checkpoints' case)
        result = check(step)
        if result.ok:
            return str(step), bad
        bad.append(result.problems[0])
    return None, bad


def main(argv: list[str]) -> int:
    """``boost-titan checkpoint verify PATH [PATH ...]``; returns the exit code."""
    import argparse
    import sys

    p = argparse.ArgumentParser(
        prog="boost-titan checkpoint verify",
        description="Verify DCP checkpoints without loading them: every stored item and "
        ".metadata against the checksums its save recorded. Exit 0 when everything "
        "verifies, 1 with one line per bad item otherwise. A checkpoint written without "
        "checksums (before boost_titan checksummed checkpoints) cannot be verified: it "
        "prints an 'unverified' line and does not change the exit code.",
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
        if path.is_dir() and not _metadata_files(path) and step_folders(path):
            steps = sorted(step_folders(path), key=lambda s: int(s.name[5:]))
        else:
            steps = [path]
        for step in steps:
            result = check(step)
            for line in result.problems:
                print(line, file=sys.stderr)
            if result.problems:
                status = 1
            elif not result.checksummed:
                print(f"unverified: {_unverified_line(str(step))}")
            else:
                print(
                    f"ok: {step} ({result.items} items, {result.nbytes / 2**20:.1f} MiB, "
                    f"{ALGORITHM})"
                )
    return status
