"""A flavor named by a path: the model arguments a conversion recorded, or a Hugging Face
folder's own shapes.

``[model] flavor`` is either a built-in flavor name (``boost_titan.models.flavors``, runs
from scratch) or a path (it holds a ``/`` or ends in ``.json``):

- a step folder written by ``checkpoint from-dense`` / ``checkpoint import --format hf``,
  or its ``model_args.json`` (``boost_titan.models.recorded``): the model exactly as
  converted, shapes, RMSNorm eps, RoPE and ranks (so no ``--boost.rank`` is repeated);
- a Hugging Face folder (config.json, any layout we read): its shapes; a low-rank model
  then takes its rank from ``[boost] rank`` / ``rank_ratio``.

The train spec's flavor table resolves both (``boost_titan.train.specs.FlavorTable``), so
training, resuming, ``export``, ``eval``, ``plan`` and the dry run read the same record.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from boost_titan.models.args import LlamaArgs
from boost_titan.models.recorded import MODEL_ARGS_FILE, read_model_args, record_path


def is_flavor_path(flavor: str) -> bool:
    """Built-in flavor names hold no ``/`` and do not end in ``.json``."""
    return "/" in flavor or flavor.endswith(".json")


def flavor_at(path: str, arch: str, model_name: str) -> LlamaArgs:
    """The model arguments ``path`` names, for a ``model_name`` model (architecture
    ``arch``); one-line ``ValueError`` when it names none or another architecture."""
    where = f"[model] flavor = {path!r}"
    record = record_path(path)
    if record is not None:
        args = read_model_args(record)
        if args.arch != arch:
            raise ValueError(
                f"{where} records a {args.arch!r} model; [model] name {model_name!r} is "
                f"{arch!r}: name the model it was converted to"
            )
        return args
    config = Path(path) / "config.json"
    if not config.is_file():
        raise ValueError(
            f"{where}: no such step folder ({MODEL_ARGS_FILE}), model arguments file (.json) "
            "or Hugging Face folder (config.json); a built-in flavor name holds no '/'"
        )
    from boost_titan.checkpoint.hf import HFFormatError
    from boost_titan.checkpoint.hf.folder import format_for_config, read_hf_config

    try:
        hf = read_hf_config(path)
        args = format_for_config(hf, str(config)).args_from_config(hf)
    except (HFFormatError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: {config} describes no model we run: {e}") from None
    if args.arch == arch:
        return args
    if args.arch != "dense":
        raise ValueError(
            f"{where} holds a {args.arch!r} model; [model] name {model_name!r} is {arch!r}"
        )
    # a dense folder's shapes for a low-rank model trained from scratch: the rank is
    # the run's ([boost] rank / rank_ratio); low-rank reference code uses eps 1e-6, but
    # the folder's own eps is kept: the shapes are the folder's, all of them
    return replace(args, arch=arch, rank=0)


def recorded_in(step: str | None) -> LlamaArgs | None:
    """The model arguments a step folder records, if it records any."""
    if not step or not Path(step).is_dir():
        return None
    record = record_path(step)
    return None if record is None else read_model_args(record)


def check_recorded(step: str | None, args: LlamaArgs, what: str) -> None:
    """Refuses, in one line, to read a step whose recorded model is not ``args``
    (``what``: the config's model, e.g. "model 'svd_llama2' flavor 'debugmodel'")."""
    from boost_titan.checkpoint.hf.folder import model_identity

    recorded = recorded_in(step)
    if recorded is None:
        return
    a, b = model_identity(recorded), model_identity(args)
    diff = [f"{k} {a.get(k)!r} (config: {b.get(k)!r})" for k in dict.fromkeys([*a, *b])
            if a.get(k) != b.get(k)]  # fmt: skip
    if diff:
        raise ValueError(
            f"step {step!r} records another model than {what}: {', '.join(diff)}; name "
            f"its own: --model.flavor {step}"
        )
