"""Training on from a converted step: the command ``from-dense`` prints after it writes one.

The step is model-only: the run starts with a fresh optimizer, LR schedule and data
position. Measured on the debug model (docs/from-dense.md, "Training on from a converted
model"): the debug configs' schedule (AdamW at lr 3e-3 after 4 warm-up steps) throws a
converted CoLA model 0.2-0.5 nats up at step 1 (Adam's first steps move every parameter by
about the learning rate); a third of it after 20 warm-up steps keeps step 1 at the
conversion's loss and ends 100 steps 0.09-0.12 nats below it. What decides whether the run
ends below the conversion at all is the data: from one of our dense runs' steps the data
restarts at its first sample, with the same seed the windows the dense model was trained on
first, and every learning rate measured then ends above the conversion's loss: the command
says to pass another ``[training] dataset_seed``. ``benchmarks/quality.py``'s converted
runs use the same settings.
"""

from __future__ import annotations

import shlex

CONTINUE_LR_DIVISOR = 3
CONTINUE_WARMUP = 20


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


def continue_command(
    config_file: str, step: str, config_lr: float, ngpu: int, from_our_run: bool
) -> str:
    """What to run to train on from the converted ``step``, and what the run starts with
    (``from_our_run``: the dense model was a step of our trainer, whose data this run
    reads again from the start)."""
    q = shlex.quote
    lr = continue_lr(config_lr)
    data = (
        "the data restarts from its first sample: with the dense run's [training] "
        "dataset_seed its first windows come first again and the model ends worse than "
        "converted (measured), so pass another --training.dataset_seed (a new order of "
        "the windows) or documents the dense run has not read"
        if from_our_run
        else "the data starts from its first sample"
    )
    return (
        f"train on from it (a model-only load: a fresh optimizer and LR schedule; {data}; the "
        f"learning rate {lr:.3g} is the config's {config_lr:g} / {CONTINUE_LR_DIVISOR}, with "
        f"{CONTINUE_WARMUP} warm-up steps: measured in docs/from-dense.md, 'Training on from a "
        "converted model'):\n"
        f"  CONFIG_FILE={q(config_file)} NGPU={ngpu} ./run_train.sh --model.flavor {q(step)} "
        f"--checkpoint.enable --checkpoint.initial_load_path {q(step)} "
        f"--optimizer.lr {lr:.3g} --lr_scheduler.warmup_steps {CONTINUE_WARMUP}"
    )
