"""Writing files and folders that appear whole or not at all.

Every command that writes a checkpoint, an export or a Hugging Face folder writes into a
temporary name beside the target and renames it into place when complete."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def new_tmp(target: Path, *, folder: bool) -> Path:
    """A new temporary file or folder beside ``target``, to be renamed onto it, created
    as a plain write creates one (0666 / 0777 less the umask): ``tempfile.mkstemp`` and
    ``mkdtemp`` make theirs 0600 / 0700, and the rename would carry that to the output."""
    while True:
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            if folder:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:  # another export's temporary name: draw again
            continue
