"""A model's arguments written beside its weights: ``model_args.json`` in a step folder.

A conversion (``checkpoint from-dense``, ``checkpoint import --format hf``) takes the
model's shapes from the dense model it reads, not from a built-in flavor. It records
them, and the low-rank options it used (arch, rank, kv_rank, ...), in the step folder it
writes, so every later consumer reads the one record instead of repeating flags:
``[model] flavor = "<step folder>"`` (or the JSON file's path) makes the train spec's
flavor table return these arguments (``boost_titan.checkpoint.model_args``).

Only the fields that define the model's weights and function are written (not
``max_seq_len``: a run sizes its RoPE table by its own sequence length). Reading checks
each field's type and range (``boost_titan.models.fields``) and refuses an unknown field
in one line: a hand-edited record cannot silently become another model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .args import LlamaArgs
from .fields import check_fields, read_json

MODEL_ARGS_FILE = "model_args.json"
FORMAT_VERSION = 1
# what defines the weights and their function; not the run's choices (max_seq_len,
# group_linears, the attention kernel, the init rule)
RECORDED = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "norm_eps",
    "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_positions", "max_positions",
    "arch", "rank", "kv_rank", "swiglu", "latent_act", "lax_gate", "lax_norm_eps",
)  # fmt: skip


def args_record(args: LlamaArgs) -> dict:
    """The JSON object of ``args`` (``kv_rank`` and ``latent_act`` resolved, so the
    record needs none of ``LlamaArgs``' defaulting rules)."""
    record = {k: getattr(args, k) for k in RECORDED}
    if args.low_rank:
        record.update(kv_rank=args.effective_kv_rank, latent_act=args.activation)
    return {"format_version": FORMAT_VERSION, "model_args": record}


def write_model_args(folder: str | os.PathLike, args: LlamaArgs) -> Path:
    path = Path(folder) / MODEL_ARGS_FILE
    path.write_text(json.dumps(args_record(args), indent=1) + "\n")
    return path


def record_path(path: str | os.PathLike) -> Path | None:
    """The record a flavor path names: a ``.json`` file, or a folder's ``model_args.json``."""
    p = Path(path)
    if p.is_dir() and (p / MODEL_ARGS_FILE).is_file():
        return p / MODEL_ARGS_FILE
    if p.is_file() and p.suffix == ".json" and p.name != "config.json":
        return p
    return None


def read_model_args(path: str | os.PathLike) -> LlamaArgs:
    """The arguments recorded at ``path`` (validated: ``boost_titan.models.fields``, the
    checks a Hugging Face config.json's get too); one-line ``ValueError`` otherwise."""
    where = f"model arguments {str(path)!r}"
    data = read_json(path, where)
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{where}: format_version {data.get('format_version')!r}, this boost_titan reads "
            f"{FORMAT_VERSION}"
        )
    record = data.get("model_args")
    if not isinstance(record, dict):
        raise ValueError(f"{where} hold no 'model_args' object")
    unknown = sorted(set(record) - set(RECORDED))
    missing = [k for k in RECORDED if k not in record]
    if missing:
        raise ValueError(f"{where} lack fields {missing}")
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; valid: {RECORDED}")
    check_fields(record, where)
    args = LlamaArgs(**record)
    try:
        args.validate()
    except ValueError as e:
        raise ValueError(f"{where} describe no valid model: {e}") from None
    return args
