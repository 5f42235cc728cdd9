"""Which run a checkpoint folder and each of its steps belong to.

A run id is made by the first run on a checkpoint folder and kept beside its steps,
in ``<checkpoint folder>/run.json``, written before its first step is saved; every
later start on that folder (a resume, a requeued job) reads it back and is the same
run. A folder without ``run.json`` that holds steps (copied into a new dump folder to
go on there, or saved before run ids existed) compares nothing: the run takes the id of
the step it resumes, or a new one.

Every sealed step records the id of the folder it is saved into (its manifest's
``run_id``, read from ``run.json`` when the step is sealed:
``integrity.dcp_hooks.finish``), so a step copied in from another run's folder
carries that run's id, and resuming a folder that has a ``run.json`` sets it aside
(``integrity.resume``) unless ``[checkpoint] allow_foreign_steps`` is set. Loading
another run's step on purpose is ``initial_load_path``, which this never checks.

Steps saved before run ids existed (a manifest without one, or no manifest) record
none: in a folder with a ``run.json`` they resume with a warning, as its own."""

from __future__ import annotations

import json
import os
import re
import time
import uuid

FILE = "run.json"
_ID = re.compile(r"[0-9A-Za-z_.-]{1,64}")


class BadRunFile(ValueError):
    """``run.json`` exists but is not what a run writes: one line."""


def valid(run_id) -> bool:
    return isinstance(run_id, str) and _ID.fullmatch(run_id) is not None


def new() -> str:
    return uuid.uuid4().hex


def read(folder: str) -> str | None:
    """The run id of checkpoint folder ``folder``; None when it has no ``run.json``."""
    path = os.path.join(folder, FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise BadRunFile(f"{path} cannot be read ({e.strerror})") from None
    try:
        run_id = json.loads(raw)["run_id"]
    except (ValueError, KeyError, TypeError, RecursionError):
        run_id = None
    if not valid(run_id):
        raise BadRunFile(
            f'{path} is not the run record a run writes ({{"run_id": ...}}, {len(raw)} bytes read)'
        )
    return run_id


def of_steps_in(folder: str) -> str | None:
    """The run id a step saved into ``folder`` (a ``step-N`` of a checkpoint folder)
    records: its parent's; None where the parent has no valid ``run.json``."""
    try:
        return read(os.path.dirname(os.path.normpath(folder)))
    except BadRunFile:
        return None


def write(folder: str, run_id: str) -> None:
    """``folder/run.json``, whole or not at all (the folder made if need be)."""
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump({"run_id": run_id, "created": time.strftime("%Y-%m-%d %H:%M:%S %z")}, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, FILE))


def foreign_line(step: str, recorded: str, folder_run: str, folder: str, allowed: bool) -> str:
    """The dump folder's ``step`` was saved by run ``recorded``, not the folder's: why it
    is not resumed (or, ``allowed``, that it is)."""
    line = (
        f"checkpoint {step} belongs to another run: it was saved by run {recorded}, this "
        f"checkpoint folder is run {folder_run} ({os.path.join(folder, FILE)})"
    )
    if allowed:
        return line + "; resumed all the same: [checkpoint] allow_foreign_steps = true"
    return line + (
        " (a step copied in from another run's folder?); not loaded. Set [checkpoint] "
        "allow_foreign_steps = true to resume it anyway, or start from it on purpose with "
        "[checkpoint] initial_load_path and a new --job.dump_folder"
    )
