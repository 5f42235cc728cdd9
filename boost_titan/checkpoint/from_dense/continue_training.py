"""Training on from a converted step: the command ``from-dense`` prints after it writes one.

A converted model starts close to the dense model's loss with a fresh optimizer (the step
is model-only). The debug configs' schedule (AdamW at lr 3e-3 after 4 warm-up steps) is a
from-scratch schedule: Adam's first steps move every parameter by about the learning rate,
which throws a converted model far from where the conversion put it (measured: +0.5 nats at
step 1, and after 100 steps still worse than straight after the conversion). The command
recommends a learning rate ``CONTINUE_LR_FACTOR`` times the config's and a warm-up of
``CONTINUE_WARMUP`` steps, the settings measured in docs/from-dense.md ("Training on from
a converted model"); ``benchmarks/quality.py``'s converted runs use the same.
"""

from __future__ import annotations

import shlex

CONTINUE_LR_FACTOR = 0.1
CONTINUE_WARMUP = 20


def continue_lr(config_lr: float) -> float:
    """The recommended learning rate for training on from a converted step."""
    return config_lr * CONTINUE_LR_FACTOR


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
        "the data restarts from its first window: the dense run's first documents come first again"
        if from_our_run
        else "the data starts from its first window"
    )
    return (
        f"train on from it (a model-only load: a fresh optimizer and LR schedule; {data}; the "
        f"learning rate {lr:.3g} is {CONTINUE_LR_FACTOR:g} x the config's {config_lr:g}, with "
        f"{CONTINUE_WARMUP} warm-up steps: measured in docs/from-dense.md, 'Training on from a "
        "converted model'):\n"
        f"  CONFIG_FILE={q(config_file)} NGPU={ngpu} ./run_train.sh --model.flavor {q(step)} "
        f"--checkpoint.enable --checkpoint.initial_load_path {q(step)} "
        f"--optimizer.lr {lr:.3g} --lr_scheduler.warmup_steps {CONTINUE_WARMUP}"
    )
