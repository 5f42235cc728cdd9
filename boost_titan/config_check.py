"""Parse and check a training config: every bad value fails here, before a process
group or a weight exists, with an error naming the key, the value and what is valid.

It imports torchtitan: import it after ``boost_titan.cpu_runtime.activate()``
(torchtitan fixes its device type at import), as ``boost_titan.train`` does.

Two kinds of checks:

* **config checks** (always): types of every value (a TOML file is not type-checked by
  torchtitan), ranges, names, the [boost] options against the model's shapes, the
  tensor-parallel degree against the model's dimensions, pipeline split, batch sizes.
* **launch checks** (when ``WORLD_SIZE`` is set, as torchrun sets it for every
  training process, or when ``check_config(config, world_size=N)`` is given one): the
  product of the parallel degrees against the world size, and the files a run reads
  (tokenizer folder with tokenizer.json, corpus / dataset path, schedule csv). Tools
  that only parse a config (checkpoint export, tests) skip them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing

import boost_titan.specs  # noqa: F401  (registers the train specs checked below)
from boost_titan import config as boost_config
from boost_titan.compile import check_compile_config
from boost_titan.config_file import (
    ConfigFileError,
    config_file_arg,
    config_manager,
    load_config_toml,
)
from boost_titan.pipeline import check_pipeline_config

# Errors are plain ValueError (FileNotFoundError for a missing file or folder), as
# torchtitan's own and existing callers expect; the message carries the detail.
ConfigError = ValueError
ConfigPathError = FileNotFoundError


def bad(section: str, key: str, value, why: str, cls: type[Exception] = ValueError) -> Exception:
    """``[section] key = value <why>``: the one error format of this module."""
    return cls(f"[{section}] {key} = {value!r} {why}")


def config_class():
    from torchtitan.config import ConfigManager, JobConfig

    return ConfigManager._merge_configs(JobConfig, boost_config.JobConfig)


def _check_config_file(path: str) -> None:
    if not os.path.isfile(path):
        why = "is a folder, not a TOML file" if os.path.isdir(path) else "does not exist"
        raise bad("job", "config_file", path, f"{why} (cwd {os.getcwd()!r})", ConfigPathError)
    try:
        load_config_toml(path)  # the whole `extends` chain
    except ConfigFileError as e:
        raise bad("job", "config_file", path, str(e)) from None
    except tomllib.TOMLDecodeError as e:
        raise bad("job", "config_file", path, f"is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise bad("job", "config_file", path, f"is not a UTF-8 TOML file: {e}") from None


def _check_flag_values(args: list[str], cls) -> None:
    """``--section.flag true`` is not tyro syntax (tyro would say only "Unrecognized
    options: true"): name the flag and its two spellings."""
    hints = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            for g in dataclasses.fields(f.type):
                hints[f"{f.name}.{g.name}"] = g.type
    for i, arg in enumerate(args[:-1]):
        if not arg.startswith("--") or "=" in arg:
            continue
        dotted = arg[2:].replace("-", "_")
        if dotted.split(".", 1)[-1].startswith("no_"):
            continue
        nxt = args[i + 1]
        if hints.get(dotted) in (bool, "bool") and not nxt.startswith("--"):
            section, key = dotted.split(".", 1)
            raise ValueError(
                f"[{section}] {key} is a flag and takes no value (got {nxt!r}): write "
                f"--{section}.{key} to set it or --{section}.no-{key.replace('_', '-')} to clear it"
            )


def parse_config(args: list[str], *, layout: bool = True):
    """CLI + TOML -> checked JobConfig (``layout``: see :func:`check_config`)."""
    path = config_file_arg(args)
    if path is not None:
        _check_config_file(path)
    _check_flag_values(args, config_class())
    config = config_manager(config_class()).parse_args(args)
    check_config(config, layout=layout)
    return config


# ----------------------------------------------------------------------------- types
def _type_ok(value, tp) -> bool:
    """Whether ``value`` has the annotated type (TOML values are not converted)."""
    origin = typing.get_origin(tp)
    if tp is typing.Any:
        return True
    if tp is type(None):
        return value is None
    if origin is typing.Literal:
        return (
            value in typing.get_args(tp)
            and not isinstance(value, bool)
            or (isinstance(value, bool) and any(a is value for a in typing.get_args(tp)))
        )
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (typing.Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation this check does not model


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "unset"
    return getattr(tp, "__name__", None) if origin is None else str(tp).replace("typing.", "")


def _check_types(obj, section: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints.get(f.name, f.type)
        where = f"{section}.{f.name}" if section else f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_types(value, where)
        elif not _type_ok(value, tp):
            sec, _, key = where.rpartition(".")
            raise bad(
                sec, key, value, f"has type {type(value).__name__}; expected {_type_name(tp)}"
            )


# ----------------------------------------------------------------------------- helpers
def _world_size(world_size: int | None) -> int | None:
    if world_size is not None:
        return world_size
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return None
    try:
        ws = int(env)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE = {env!r} is not an integer") from None
    if ws < 1:
        raise ConfigError(f"environment WORLD_SIZE = {ws} must be >= 1")
    return ws


def _at_least(section: str, key: str, value, low, extra: str = "") -> None:
    if value < low:
        raise bad(section, key, value, f"must be >= {low}{extra}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _ours(config) -> bool:
    from torchtitan.protocols.train_spec import _extra_train_specs

    return config.model.name in _extra_train_specs


# ----------------------------------------------------------------------------- sections
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
    if o.name not in ("Adam", "AdamW"):
        raise bad("optimizer", "name", o.name, "is not valid; choose one of ['Adam', 'AdamW']")
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
    ck = config.checkpoint
    if ck.enable:
        _at_least("checkpoint", "interval", ck.interval, 1)
        _at_least("checkpoint", "keep_latest_k", ck.keep_latest_k, 0)
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


_DEGREES = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "context_parallel_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
)
_PP_SCHEDULES = (
    "1F1B",
    "GPipe",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


def _check_parallelism(config, world_size: int | None) -> dict[str, int]:
    """Degrees >= 1, their product against the world size, DDP's limits; returns the
    resolved degrees (data_parallel_shard_degree -1 filled in)."""
    p = config.parallelism
    for key in (*_DEGREES, "expert_parallel_degree", "expert_tensor_parallel_degree"):
        value = getattr(p, key)
        if key == "data_parallel_shard_degree" and value == -1:
            continue
        _at_least(
            "parallelism",
            key,
            value,
            1,
            " (data_parallel_shard_degree may be -1: the rest)"
            if key == "data_parallel_shard_degree"
            else "",
        )
    deg = {k: getattr(p, k) for k in _DEGREES}
    others = math.prod(v for k, v in deg.items() if k != "data_parallel_shard_degree")
    layout = " x ".join(f"{k} {v}" for k, v in deg.items())
    if world_size is not None:
        if deg["data_parallel_shard_degree"] == -1:
            if world_size % others:
                raise bad(
                    "parallelism",
                    "data_parallel_shard_degree",
                    -1,
                    f"cannot fill WORLD_SIZE {world_size}: the other degrees multiply to {others}, "
                    f"which does not divide it; launch a multiple of {others} processes "
                    f"or change the degrees",
                )
            deg["data_parallel_shard_degree"] = world_size // others
        elif math.prod(deg.values()) != world_size:
            raise ConfigError(
                f"[parallelism] degrees multiply to {math.prod(deg.values())} ({layout}) but "
                f"WORLD_SIZE = {world_size} processes were launched; launch "
                f"NGPU={math.prod(deg.values())} or set data_parallel_shard_degree = -1 (the rest)"
            )
    elif deg["data_parallel_shard_degree"] == -1:
        deg["data_parallel_shard_degree"] = 1
    if _ours(config):
        for key in (
            "context_parallel_degree",
            "expert_parallel_degree",
            "expert_tensor_parallel_degree",
        ):
            if getattr(p, key) != 1:
                raise bad(
                    "parallelism",
                    key,
                    getattr(p, key),
                    "is not supported by boost_titan models (dense blocks, no context "
                    "parallel attention, no experts); use 1",
                )
    rep, shard = deg["data_parallel_replicate_degree"], deg["data_parallel_shard_degree"]
    if rep > 1 and shard == 1 and math.prod(deg.values()) != rep:
        raise bad(
            "parallelism",
            "data_parallel_replicate_degree",
            rep,
            f"without sharding is plain DDP, which torchtitan cannot combine with other "
            f"parallelism ({layout}); use data_parallel_shard_degree > 1 (HSDP/FSDP) instead",
        )
    if p.pipeline_parallel_degree > 1:
        if p.pipeline_parallel_schedule_csv:
            if world_size is not None and not os.path.isfile(p.pipeline_parallel_schedule_csv):
                raise bad(
                    "parallelism",
                    "pipeline_parallel_schedule_csv",
                    p.pipeline_parallel_schedule_csv,
                    "does not exist",
                    ConfigPathError,
                )
        elif p.pipeline_parallel_schedule.lower() not in {s.lower() for s in _PP_SCHEDULES}:
            raise bad(
                "parallelism",
                "pipeline_parallel_schedule",
                p.pipeline_parallel_schedule,
                f"is not valid; choose one of {list(_PP_SCHEDULES)}",
            )
        _at_least(
            "parallelism",
            "pipeline_parallel_microbatch_size",
            p.pipeline_parallel_microbatch_size,
            1,
        )
        _at_least(
            "parallelism",
            "pipeline_parallel_first_stage_less_layers",
            p.pipeline_parallel_first_stage_less_layers,
            0,
        )
        _at_least(
            "parallelism",
            "pipeline_parallel_last_stage_less_layers",
            p.pipeline_parallel_last_stage_less_layers,
            0,
        )
        if p.pipeline_parallel_layers_per_stage is not None:
            _at_least(
                "parallelism",
                "pipeline_parallel_layers_per_stage",
                p.pipeline_parallel_layers_per_stage,
                1,
            )
    return deg


def _check_batches(config, deg: dict[str, int]) -> None:
    t = config.training
    dp = deg["data_parallel_replicate_degree"] * deg["data_parallel_shard_degree"]
    if t.global_batch_size > 0 and t.global_batch_size % (t.local_batch_size * dp):
        good = [t.local_batch_size * dp * k for k in (1, 2, 4)]
        raise bad(
            "training",
            "global_batch_size",
            t.global_batch_size,
            f"must be a multiple of local_batch_size {t.local_batch_size} x data-parallel degree "
            f"{dp} (gradient accumulation); e.g. {good}, or -1",
        )
    div = deg["tensor_parallel_degree"] * 2 * deg["context_parallel_degree"]
    sections = [("training", t.seq_len)] + (
        [("validation", config.validation.seq_len)] if config.validation.enable else []
    )
    for section, seq_len in sections:
        if seq_len % div:
            raise bad(
                section,
                "seq_len",
                seq_len,
                f"must be divisible by {div} (2 x tensor_parallel_degree "
                f"{deg['tensor_parallel_degree']} x context_parallel_degree "
                f"{deg['context_parallel_degree']}); e.g. {seq_len - seq_len % div or div}",
            )


def _check_model(config, deg: dict[str, int] | None) -> None:
    """Model name and flavor, the [boost] options against the flavor's shapes, the TP
    degree against the dimensions it splits, latent checkpointing, pipeline split
    (``deg`` None: the model alone, no layout)."""
    from torchtitan.models import _supported_models  # noqa: F401 (registers)
    from torchtitan.protocols.train_spec import _extra_train_specs

    from boost_titan.models.args import kron_factors
    from boost_titan.tp_plans import resolve_tp_plan, validate_tp_degree

    name, flavor = config.model.name, config.model.flavor
    ours = sorted(_extra_train_specs)
    if name not in _extra_train_specs and name not in _supported_models:
        raise ConfigError(
            f"unknown model name {name!r}; boost_titan models: {ours}, "
            f"torchtitan models: {sorted(_supported_models)} ([model] name)"
        )
    if name not in _extra_train_specs:
        return
    table = _extra_train_specs[name].model_args
    if flavor not in table:
        raise ConfigError(
            f"unknown flavor {flavor!r} for model {name!r}; "
            f"valid flavors: {sorted(table)} ([model] flavor)"
        )
    args = table[flavor]
    b = config.boost
    what = f"model {name!r} flavor {flavor!r}"
    if not args.low_rank:
        for key in ("rank", "rank_ratio", "kv_rank"):
            if getattr(b, key):
                raise bad(
                    "boost",
                    key,
                    getattr(b, key),
                    f"applies to low-rank models only; {what} is dense "
                    "(use svd_llama2, cola_llama2 or lax_llama2, or leave it 0)",
                )
        if b.latent_act != "default":
            raise bad(
                "boost",
                "latent_act",
                b.latent_act,
                f"applies to low-rank models only; {what} is dense",
            )
    else:
        max_rank = min(args.dim, args.ffn_dim)
        if b.rank > max_rank:
            raise bad(
                "boost",
                "rank",
                b.rank,
                f"is too large for {what} (dim {args.dim}, ffn_dim "
                f"{args.ffn_dim}); valid: 1 .. {max_rank} (0: the flavor's {args.rank})",
            )
        if b.rank_ratio and not 1 <= round(b.rank_ratio * args.dim) <= max_rank:
            raise bad(
                "boost",
                "rank_ratio",
                b.rank_ratio,
                f"gives rank {round(b.rank_ratio * args.dim)} for dim {args.dim}; "
                f"valid ranks: 1 .. {max_rank}",
            )
        if b.kv_rank > args.kv_dim:
            raise bad(
                "boost",
                "kv_rank",
                b.kv_rank,
                f"exceeds the k/v width {args.kv_dim} of {what}; "
                f"valid: 1 .. {args.kv_dim} (0: automatic)",
            )
    try:
        model_args = _updated_args(args, config)
    except ValueError as e:
        default = boost_config.Boost()
        changed = [
            f"{k} = {getattr(b, k)!r}"
            for k in ("rank", "rank_ratio", "kv_rank", "lax_gate", "latent_act")
            if getattr(b, k) != getattr(default, k)
        ]
        raise ConfigError(
            f"[boost] {', '.join(changed) or 'defaults'} with {what} are not valid: {e}"
        ) from None
    if model_args.low_rank and model_args.arch == "lax" and model_args.lax_gate == "kron":
        for key, r in (("rank", model_args.rank), ("kv_rank", model_args.effective_kv_rank)):
            if kron_factors(r)[0] == 1:
                raise bad(
                    "boost",
                    "lax_gate",
                    "kron",
                    f"needs {key} r = a*b with a, b > 1, but r = {r} is "
                    "prime; choose another rank or lax_gate = 'dense'",
                )
    if deg is None:
        return
    try:
        plan = resolve_tp_plan(b.tp_plan, model_args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    tp = deg["tensor_parallel_degree"]
    if tp > 1:
        try:
            validate_tp_degree(model_args, tp, plan)
        except ValueError as e:
            raise ConfigError(
                f"[parallelism] {e}; with {what}: valid degrees "
                f"{[d for d in _divisors(64) if _tp_ok(model_args, d, plan)]}"
            ) from None
    _check_latent_checkpoint(config, model_args, plan if tp > 1 else None)
    check_pipeline_config(config, model_args.n_layers)


def _tp_ok(args, tp: int, plan: str) -> bool:
    from boost_titan.tp_plans import validate_tp_degree

    try:
        validate_tp_degree(args, tp, plan)
    except ValueError:
        return False
    return True


def _updated_args(args, config):
    """The flavor's args as the trainer sets them (``update_from_config``), on a copy.
    The tokenizer's vocabulary check needs the tokenizer file: it runs with the files."""
    from dataclasses import replace

    from boost_titan.models import args as args_mod

    model_args = replace(args)
    saved = args_mod._check_tokenizer_vocab
    args_mod._check_tokenizer_vocab = lambda *a, **k: None
    try:
        model_args.update_from_config(config)
    finally:
        args_mod._check_tokenizer_vocab = saved
    return model_args


def _check_latent_checkpoint(config, model_args, plan: str | None) -> None:
    b = config.boost
    if b.latent_checkpoint == "none":
        return
    problems = []
    if not model_args.low_rank:
        problems.append(
            f"model {config.model.name!r} is dense (latent checkpointing needs bottleneck blocks)"
        )
    if plan not in (None, "btp"):
        problems.append(
            f"tp_plan {plan!r} communicates inside its chunks; use 'btp', or "
            "[activation_checkpoint] mode = 'full' for the baselines"
        )
    if plan == "btp" and b.rmsnorm != "online":
        problems.append("rmsnorm = 'sync' all-reduces inside the norm; use 'online'")
    ac = config.activation_checkpoint.mode
    if ac != "none":
        problems.append(
            f"[activation_checkpoint] mode = {ac!r} is also set; use one of the two "
            "(set mode = 'none')"
        )
    if problems:
        raise bad(
            "boost",
            "latent_checkpoint",
            b.latent_checkpoint,
            "cannot be used: " + "; ".join(problems),
        )


def _check_files(config) -> None:
    """What a launch reads from disk: tokenizer, datasets."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from boost_titan.datasets import _BUILD_HINT
    from boost_titan.models.args import _check_tokenizer_vocab

    m = config.model
    if not os.path.isdir(m.hf_assets_path):
        why = "is a file, not a folder" if os.path.exists(m.hf_assets_path) else "does not exist"
        raise bad(
            "model",
            "hf_assets_path",
            m.hf_assets_path,
            f"{why} (cwd {os.getcwd()!r}); it must be the tokenizer folder holding "
            f"tokenizer.json (the embedded corpus': ./data/boost_corpus/tokenizer, {_BUILD_HINT})",
            ConfigPathError,
        )
    if not os.path.isfile(os.path.join(m.hf_assets_path, "tokenizer.json")):
        raise bad(
            "model",
            "hf_assets_path",
            m.hf_assets_path,
            f"holds no tokenizer.json (found {sorted(os.listdir(m.hf_assets_path))[:10]}); "
            f"point it at a Hugging Face tokenizer folder ({_BUILD_HINT})",
            ConfigPathError,
        )
    if _ours(config):
        args = config_args(config)
        try:
            _check_tokenizer_vocab(m.hf_assets_path, args.vocab_size)
        except ValueError as e:
            raise ConfigError(
                f"[model] hf_assets_path = {m.hf_assets_path!r} with flavor {m.flavor!r}: {e}"
            ) from None
    sections = [("training", config.training)] + (
        [("validation", config.validation)] if config.validation.enable else []
    )
    for section, s in sections:
        entry = DATASETS[s.dataset]
        path = s.dataset_path or entry.path
        key = "dataset_path" if s.dataset_path else "dataset"
        value = s.dataset_path or s.dataset
        if s.dataset == "local_text" and not s.dataset_path:
            raise bad(
                section,
                "dataset_path",
                None,
                "must be set for dataset 'local_text' (a file or folder of "
                ".jsonl/.json/.txt/.parquet, or a saved dataset folder)",
            )
        local = (
            s.dataset in ("boost_corpus", "boost_corpus_val", "local_text")
            or os.path.isabs(path)
            or path.startswith(".")
        )
        if local and not os.path.exists(path):
            raise bad(
                section,
                key,
                value,
                f"reads {path!r}, which does not exist"
                + (f"; {_BUILD_HINT}" if s.dataset.startswith("boost_corpus") else ""),
                ConfigPathError,
            )
        offline = [
            v
            for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
            if os.environ.get(v, "0") not in ("", "0")
        ]
        if not os.path.exists(path) and offline:
            raise bad(
                section,
                key,
                value,
                f"reads {path!r}, neither a local path nor reachable: "
                f"{offline[0]}=1 (run_train.sh's default) forbids downloading it; use "
                f"'boost_corpus' or 'local_text' with dataset_path",
                ConfigPathError,
            )


def config_args(config):
    """The model args the trainer will build for this config (boost_titan models)."""
    from torchtitan.protocols.train_spec import _extra_train_specs

    return _updated_args(
        _extra_train_specs[config.model.name].model_args[config.model.flavor], config
    )


def check_config(config, world_size: int | None = None, *, layout: bool = True) -> None:
    """Fail early, with the valid choices; see the module docstring. ``world_size``:
    the launch's process count (default: ``WORLD_SIZE`` from the environment; absent:
    the launch checks are skipped). ``layout=False`` (tools that only build the model,
    e.g. checkpoint export): the parallel layout, plan and batch checks are skipped."""
    ws = _world_size(world_size)
    _check_types(config)
    boost_config.validate_boost_config(config.boost)
    _check_training(config)
    _check_optimizer(config)
    _check_lr_scheduler(config)
    _check_misc(config)
    if not layout:
        _check_model(config, None)
        return
    deg = _check_parallelism(config, ws)
    check_compile_config(config)
    _check_model(config, deg)
    _check_batches(config, deg)
    if ws is not None:
        _check_files(config)


__all__ = ["bad", "check_config", "config_args", "config_class", "parse_config"]
