"""What a checkpoint folder (``<dump_folder>/<[checkpoint] folder>``) holds, read the way
torchtitan reads it, without importing torchtitan: its complete ``step-N`` folders,
which training states a step folder holds (a full save, or the model only), and the
record of the ``initial_load_path`` the run writing the folder started from.

Read by the parse-time checks (``boost_titan.train.config_check.checkpoint``) and by the
trainer's checkpoint manager (``boost_titan.checkpoint.manager``), so both see a
folder the same way.
"""

from __future__ import annotations

import json
import os
import re

# top-level DCP keys of the training states torchtitan saves beside the model; a full
# save holds all four, a model-only one (``last_save_model_only``, ``import``) none
TRAINING_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
# beside the step folders: {"initial_load_path": <as given>, "realpath": <resolved>}
RECORD = "initial_load.json"


def is_complete(step_dir: str) -> bool:
    """A finished save: DCP writes ``.metadata`` last (a rename, once every rank's data
    is on disk); torchtitan's Hugging Face layout has its index file instead."""
    return os.path.isfile(os.path.join(step_dir, ".metadata")) or os.path.isfile(
        os.path.join(step_dir, "model.safetensors.index.json")
    )


def complete_steps(folder: str) -> list[int]:
    """The steps N of ``folder``'s complete ``step-N`` folders, ascending (the ones
    torchtitan would load; [] when the folder does not exist)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = re.fullmatch(r"step-(\d+)", name)
        if m and is_complete(os.path.join(folder, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def states_held(path: str, files: bool = False) -> set[str]:
    """The :data:`TRAINING_STATES` a complete step folder holds (empty: the model only).
    The step is opened through ``boost_titan.checkpoint.integrity`` (its manifest and
    ``.metadata``'s bytes verified before ``.metadata`` is unpickled, allowlisted): a
    damaged step raises its one-line ``ChecksumMismatch``, a crafted one is refused; a
    Hugging Face step folder holds the model only. ``files``: every file of the step
    present (one listing of the folder)."""
    from boost_titan.checkpoint.integrity.step import states_held as held

    if not os.path.isfile(os.path.join(path, ".metadata")):
        if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
            held(path)  # a sealed Hugging Face folder is checked too
        return set()
    return held(path, files) & set(TRAINING_STATES)


def missing_states(path: str, excluded, files: bool = False) -> list[str]:
    """The training states a full load of ``path`` would ask for (all but ``excluded``,
    ``[checkpoint] exclude_from_loading``) that it does not hold (``files``: as
    :func:`states_held`)."""
    held = states_held(path, files)
    return [s for s in TRAINING_STATES if s not in excluded and s not in held]


def read_record(folder: str) -> dict | None:
    """The initial_load_path record of ``folder``, None when there is none."""
    try:
        with open(os.path.join(folder, RECORD)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def started_from(folder: str, initial_load_path: str) -> bool:
    """Whether the run that wrote ``folder`` started from ``initial_load_path``."""
    record = read_record(folder)
    return bool(record) and record.get("realpath") == os.path.realpath(initial_load_path)


def write_record(folder: str, initial_load_path: str) -> None:
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{RECORD}.tmp")
    with open(tmp, "w") as f:
        json.dump(
            {
                "initial_load_path": initial_load_path,
                "realpath": os.path.realpath(initial_load_path),
            },
            f,
        )
        f.write("\n")
    os.replace(tmp, os.path.join(folder, RECORD))
