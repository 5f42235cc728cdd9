"""The model: name and flavor, the [boost] options against the flavor's shapes, the
tensor-parallel degree against the dimensions it splits, latent checkpointing, the
pipeline split and [model] converters (``converters``); also the model args the trainer
will build (``config_args``)."""

from __future__ import annotations

from boost_titan import config as boost_config
from boost_titan.parallel.pipeline import check_pipeline_config
from boost_titan.train.config_check.common import ConfigError, _divisors, bad
from boost_titan.train.config_check.converters import (
    check_converter_names,
    check_converters_for,
)


def _check_model(config, deg: dict[str, int] | None, shapes=None) -> None:
    """Model name and flavor, the [boost] options against the flavor's shapes, the TP
    degree against the dimensions it splits, latent checkpointing, pipeline split
    (``deg`` None: the model alone, no layout). ``shapes`` (where, args): a dense model
    whose shapes replace the flavor's (from-dense writes the config's model at the
    shapes of the model it converts, so every check is against those)."""
    from torchtitan.models import _supported_models  # noqa: F401 (registers)
    from torchtitan.protocols.train_spec import _extra_train_specs

    from boost_titan.models.args import kron_factors
    from boost_titan.tp_plans import resolve_tp_plan, validate_tp_degree

    check_converter_names(config)
    name, flavor = config.model.name, config.model.flavor
    ours = sorted(_extra_train_specs)
    if name not in _extra_train_specs and name not in _supported_models:
        raise ConfigError(
            f"unknown model name {name!r}; boost_titan models: {ours}, "
            f"torchtitan models: {sorted(_supported_models)} ([model] name)"
        )
    if name not in _extra_train_specs:
        if config.optimizer.name == "LORO":
            raise bad("optimizer", "name", "LORO", f"trains boost_titan's svd_llama2, not {name!r}")
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
    if shapes is not None:
        from boost_titan.checkpoint.from_dense.target import with_shapes

        where, dense = shapes
        args, what = with_shapes(args, dense), f"{what} at the shapes of {where}"
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
    _check_loro_model(config, model_args, what)
    check_converters_for(config, model_args, what)
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
    _check_sequence_parallel(config, model_args, plan, tp)
    _check_latent_checkpoint(config, model_args, plan if tp > 1 else None)
    check_pipeline_config(config, model_args.n_layers)


def _check_loro_model(config, model_args, what: str) -> None:
    if config.optimizer.name != "LORO":
        return
    if not model_args.low_rank or model_args.activation != "none":
        inside = "no factors" if not model_args.low_rank else f"{model_args.activation!r} inside"
        raise bad(
            "optimizer",
            "name",
            "LORO",
            f"needs W = B A (a bottleneck without activation), but {what} has {inside}; "
            "use svd_llama2 (latent_act 'default' or 'none'), or name = 'AdamW'",
        )


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


def _check_sequence_parallel(config, model_args, plan: str, tp: int) -> None:
    b = config.boost
    if b.sequence_parallel_keep_gathered and not b.sequence_parallel:
        raise bad(
            "boost",
            "sequence_parallel_keep_gathered",
            True,
            "needs sequence_parallel = true (it says what sequence-parallel latents save)",
        )
    if not b.sequence_parallel:
        return
    problems = []
    if plan != "btp":
        problems.append(
            f"tp_plan {plan!r}: sequence-parallel latents are a btp option (the fullrank "
            "plan already shards its norms and residual on the sequence)"
        )
    if tp < 2:
        problems.append("tensor_parallel_degree is 1 (there is nothing to shard on)")
    if model_args.arch == "lax":
        problems.append(
            "LaX carries whole latents across blocks next to the d/T residual; "
            "use it with svd_llama2 or cola_llama2"
        )
    if b.rmsnorm != "online":
        problems.append("rmsnorm = 'sync' normalises before the reduction; use 'online'")
    if problems:
        raise bad("boost", "sequence_parallel", True, "cannot be used: " + "; ".join(problems))


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


def config_args(config):
    """The model args the trainer will build for this config (boost_titan models)."""
    from torchtitan.protocols.train_spec import _extra_train_specs

    return _updated_args(
        _extra_train_specs[config.model.name].model_args[config.model.flavor], config
    )
