"""Training on from a converted step: the command ``from-dense`` prints after it writes one.

The step is model-only: the run starts with a fresh optimizer, LR schedule and data
position. Measured on the debug model (docs/from-dense.md, "Training on from a converted
model"): the debug configs' schedule (AdamW at lr 3e-3 after 4 warm-up steps) throws a
converted CoLA model 0.2-0.5 nats up at step 1 (Adam's first steps move every parameter by
about the learning rate); a third of it after 20 warm-up steps keeps step 1 at the
conversion's loss and ends 100 steps below it. What decides whether the run ends below
the conversion at all is the data: from one of our dense runs' steps the data restarts at
its first sample, with the same seed the windows the dense model was trained on first, and
every learning rate measured then ends above the conversion's loss. So the command holds
all of it, and runs as printed: the steps (:data:`CONTINUE_STEPS`; the debug configs' 20
are all warm-up), the learning rate and warm-up, a dump folder of its own (a folder that
holds a checkpoint would be resumed instead of the step) and, from one of our steps,
another ``[training] dataset_seed`` than the dense run's: read from the step's data
position (``dataloader.position``), or, from a model-only step that records none, the
config's seed + 1 (another seed than the dense run's when the dense run used this
config's). ``benchmarks/quality.py``'s converted runs use the same settings.
"""

from __future__ import annotations

import shlex
import warnings
from pathlib import Path

CONTINUE_LR_DIVISOR = 3
CONTINUE_WARMUP = 20
CONTINUE_STEPS = 100  # as measured: 20 warm-up steps, then a linear decay to 0
_POSITION = "dataloader.position"  # boost_titan.checkpoint.data_position.POSITION_ITEM


def continue_lr(config_lr: float) -> float:
    """The recommended learning rate for training on from a converted step."""
    return config_lr / CONTINUE_LR_DIVISOR


def world_size(parallelism) -> int:
    """The ranks a config's parallelism needs (``data_parallel_shard_degree = -1``, which
    fills the ranks, counts as 1)."""
    n = 1
    for key in (
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "context_parallel_degree",
        "data_parallel_replicate_degree",
        "data_parallel_shard_degree",
    ):
        n *= max(1, int(getattr(parallelism, key, 1) or 1))
    return n


def dense_run_seed(step: str | Path) -> int | None:
    """The ``[training] dataset_seed`` a dense run of ours read its data with, from its
    step's data position; None when the step records none (model-only, or another loader's)."""
    import torch.distributed.checkpoint as dcp

    from boost_titan.checkpoint import safe_metadata

    meta = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    if _POSITION not in meta:
        return None
    state = {_POSITION: b""}
    with warnings.catch_warnings():  # one process, no process group: the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step), no_dist=True)
    blob = state[_POSITION]
    position = safe_metadata.dataloader_state(blob, _POSITION) if isinstance(blob, bytes) else None
    seed = position.get("seed") if isinstance(position, dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def continue_seed(dense_seed: int | None, config_seed: int) -> int:
    """A ``dataset_seed`` other than the dense run's (module docstring)."""
    if dense_seed is None:
        return config_seed + 1
    return config_seed if config_seed != dense_seed else dense_seed + 1


def continue_flags(
    step: str, config_lr: float, from_our_run: bool, dense_seed: int | None, config_seed: int
) -> list[str]:
    """The trainer's flags of the printed command (:func:`continue_command`)."""
    flags = [
        "--model.flavor", step, "--checkpoint.enable", "--checkpoint.initial_load_path", step,
        "--job.dump_folder", f"{step.rstrip('/')}-train",
        "--training.steps", str(CONTINUE_STEPS), "--optimizer.lr", f"{continue_lr(config_lr):.3g}",
        "--lr_scheduler.warmup_steps", str(CONTINUE_WARMUP),
    ]  # fmt: skip
    if from_our_run:
        flags += ["--training.dataset_seed", str(continue_seed(dense_seed, config_seed))]
    return flags


def continue_command(
    config_file: str,
    step: str,
    config_lr: float,
    ngpu: int,
    from_our_run: bool,
    dense_seed: int | None = None,
    config_seed: int = 0,
) -> str:
    """What to run to train on from the converted ``step``, and why (``from_our_run``:
    the dense model was a step of our trainer, whose data a run with the same seed reads
    again from its start; ``dense_seed``: that run's seed, when its step records it)."""
    q = shlex.quote
    lr = continue_lr(config_lr)
    if not from_our_run:
        data = "the data starts from its first sample"
    else:
        seed = continue_seed(dense_seed, config_seed)
        was = (
            f"the dense run's seed {dense_seed}, recorded in its step"
            if dense_seed is not None
            else "the step records no data position (model-only): the config's seed "
            f"{config_seed} + 1, another than the dense run's if it ran with this config's"
        )
        data = (
            f"--training.dataset_seed {seed}, a new order of the windows ({was}): with the "
            "dense run's seed its first windows come first again and the model ends worse "
            "than converted (measured)"
        )
    flags = continue_flags(step, config_lr, from_our_run, dense_seed, config_seed)
    return (
        f"train on from it (a model-only load: a fresh optimizer and LR schedule; {data}; "
        f"{CONTINUE_STEPS} steps at the learning rate {lr:.3g}, the config's {config_lr:g} / "
        f"{CONTINUE_LR_DIVISOR}, after {CONTINUE_WARMUP} warm-up steps: measured in "
        "docs/from-dense.md, 'Training on from a converted model'):\n"
        f"  CONFIG_FILE={q(config_file)} NGPU={ngpu} ./run_train.sh "
        + " ".join(q(f) for f in flags)
    )
