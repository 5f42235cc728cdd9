"""The training sections: [training] (with its dataloader and dataset name),
[optimizer], [lr_scheduler], and the rest that needs no model or layout: [metrics],
[profiling], [validation], [activation_checkpoint]."""

from __future__ import annotations

import math

from boost_titan.config import LORO_EXACT_DTYPES, LORO_REFRESH, OPTIMIZERS
from boost_titan.train.config_check.common import _at_least, bad


def _check_training(config) -> None:
    t = config.training
    _at_least("training", "local_batch_size", t.local_batch_size, 1)
    if t.global_batch_size != -1:
        _at_least(
            "training",
            "global_batch_size",
            t.global_batch_size,
            1,
            " (or -1: local_batch_size x DP degree)",
        )
    _at_least("training", "seq_len", t.seq_len, 1)
    _at_least("training", "steps", t.steps, 1)
    if not t.max_norm > 0 or not math.isfinite(t.max_norm):
        raise bad(
            "training",
            "max_norm",
            t.max_norm,
            "must be a finite number > 0 (gradient clipping norm)",
        )
    _at_least("training", "gc_freq", t.gc_freq, 1)
    _check_dataloader("training", t.dataloader)
    _check_dataset_name("training", t.dataset)


def _check_dataloader(section: str, dl) -> None:
    _at_least(f"{section}.dataloader", "num_workers", dl.num_workers, 0)
    if dl.prefetch_factor is not None:
        if dl.num_workers == 0:
            raise bad(
                f"{section}.dataloader",
                "prefetch_factor",
                dl.prefetch_factor,
                "needs num_workers > 0; leave it unset with num_workers = 0",
            )
        _at_least(f"{section}.dataloader", "prefetch_factor", dl.prefetch_factor, 1)
    if dl.persistent_workers and dl.num_workers == 0:
        raise bad(f"{section}.dataloader", "persistent_workers", True, "needs num_workers > 0")


def _check_dataset_name(section: str, name: str) -> None:
    from torchtitan.hf_datasets.text_datasets import DATASETS

    if name not in DATASETS:
        raise bad(section, "dataset", name, f"is not a known dataset; valid: {sorted(DATASETS)}")


def _check_optimizer(config) -> None:
    o, pp = config.optimizer, config.parallelism.pipeline_parallel_degree
    if o.name not in OPTIMIZERS:
        raise bad("optimizer", "name", o.name, f"is not valid; choose one of {list(OPTIMIZERS)}")
    for key in ("lr", "eps", "weight_decay"):
        value = getattr(o, key)
        if not (value >= 0 and math.isfinite(value)):
            raise bad("optimizer", key, value, "must be a finite number >= 0")
    for key in ("beta1", "beta2"):
        value = getattr(o, key)
        if not 0 <= value < 1:
            raise bad("optimizer", key, value, "must be in [0, 1)")
    if o.early_step_in_backward and pp > 1:
        raise bad(
            "optimizer",
            "early_step_in_backward",
            True,
            f"does not work with pipeline parallelism (pipeline_parallel_degree {pp})",
        )
    if o.name == "LORO":
        _check_loro(config)


def _check_loro(config) -> None:
    o = config.optimizer
    _at_least("optimizer", "loro_freq", o.loro_freq, 1)
    _at_least("optimizer", "loro_restart_warmup", o.loro_restart_warmup, 0)
    if o.loro_refresh not in LORO_REFRESH:
        raise bad(
            "optimizer",
            "loro_refresh",
            o.loro_refresh,
            f"is not valid; choose one of {list(LORO_REFRESH)}",
        )
    if o.loro_exact_dtype not in LORO_EXACT_DTYPES:
        raise bad(
            "optimizer",
            "loro_exact_dtype",
            o.loro_exact_dtype,
            f"is not valid; choose one of {list(LORO_EXACT_DTYPES)}",
        )
    if not (o.loro_lr_scaler == -1 or (o.loro_lr_scaler >= 0 and math.isfinite(o.loro_lr_scaler))):
        raise bad(
            "optimizer",
            "loro_lr_scaler",
            o.loro_lr_scaler,
            "must be -1 (r / d) or a finite number >= 0",
        )
    if o.early_step_in_backward:
        raise bad(
            "optimizer",
            "early_step_in_backward",
            True,
            "does not work with LORO (its exact step updates both factors of a pair together)",
        )


def _check_lr_scheduler(config) -> None:
    s = config.lr_scheduler
    _at_least("lr_scheduler", "warmup_steps", s.warmup_steps, 0)
    steps = config.training.steps
    if s.total_steps is not None and s.total_steps < steps:
        raise bad(
            "lr_scheduler",
            "total_steps",
            s.total_steps,
            f"is below [training] steps = {steps}: the schedule would end (and its decay go "
            f"below 0) before training does; use a value >= {steps}, or leave it unset",
        )
    if s.decay_ratio is not None and not 0 <= s.decay_ratio <= 1:
        raise bad("lr_scheduler", "decay_ratio", s.decay_ratio, "must be in [0, 1] (or unset)")
    if not 0 <= s.min_lr_factor <= 1:
        raise bad("lr_scheduler", "min_lr_factor", s.min_lr_factor, "must be in [0, 1]")


def _check_misc(config) -> None:
    _at_least("metrics", "log_freq", config.metrics.log_freq, 1)
    if config.profiling.enable_profiling:
        _at_least("profiling", "profile_freq", config.profiling.profile_freq, 1)
    v = config.validation
    if v.enable:
        _at_least("validation", "local_batch_size", v.local_batch_size, 1)
        _at_least("validation", "seq_len", v.seq_len, 1)
        _at_least("validation", "freq", v.freq, 1)
        if v.steps != -1:
            _at_least("validation", "steps", v.steps, 1, " (or -1: the whole split)")
        _check_dataloader("validation", v.dataloader)
        _check_dataset_name("validation", v.dataset)
    ac = config.activation_checkpoint  # (the mode itself is a Literal: the parser checks it)
    if ac.mode == "selective" and not (
        ac.selective_ac_option == "op"
        or (ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1)
    ):
        raise bad(
            "activation_checkpoint",
            "selective_ac_option",
            ac.selective_ac_option,
            "is not valid; use 'op' or a positive integer (every n-th block)",
        )
