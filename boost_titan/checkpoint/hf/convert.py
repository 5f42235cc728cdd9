"""``boost-titan checkpoint export|import --format hf``: DCP <-> Hugging Face folder.

export: the model tensors of a DCP checkpoint (any layout wrote it), read a block at a
time, -> a complete folder (:func:`boost_titan.checkpoint.hf.folder.write_hf_folder_from`)
in the chosen layout, with the model's own tokenizer where it carries one (a converted
model: :mod:`boost_titan.checkpoint.model_tokenizer`), else the run's (``[model]
hf_assets_path``).

import: a folder -> a model-only DCP checkpoint (``step-0``) that training loads with
``--checkpoint.initial_load_path``. The folder must hold the run's model: its config.json
(layout by ``model_type``) describes the same architecture, shapes and ranks as the
config (else one error naming the differing fields; a dense ``llama2`` is imported at
the folder's own shapes instead, recorded in ``OUT/model_args.json``: ``--model.flavor
OUT``), its tensors are exactly the model's
(else one error naming the missing / extra / mis-shaped ones), and it carries a tokenizer
that fits the model's vocabulary; a folder a ``last_save_in_hf`` save sealed is verified
first. Nothing is written on any error.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from boost_titan.checkpoint.hf.folder import (
    DEFAULT_MAX_SHARD_SIZE,
    check_same_model,
    default_layout,
    format_for_config,
    get_format,
    read_hf_config,
    read_hf_tensors,
    read_tokenizer,
    write_hf_folder_from,
)
from boost_titan.checkpoint.hf.llama_format import untie


def export_hf(
    job_config,
    checkpoint_dir: str,
    out_dir: str,
    layout: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    from boost_titan.checkpoint.export import (
        DCPModelReader,
        expected_tensors,
        model_desc,
        model_for,
    )

    args, model = model_for(job_config)
    fmt = get_format(layout or default_layout(args.arch), args.arch)
    if Path(out_dir).exists():  # before reading anything
        raise FileExistsError(f"{out_dir!r} exists; export writes a new folder")
    from boost_titan.checkpoint.model_args import check_recorded
    from boost_titan.checkpoint.model_tokenizer import model_tokenizer

    check_recorded(checkpoint_dir, args, model_desc(job_config))
    # a converted model's own tokenizer (its step's, or its run's --model.flavor STEP's),
    # else the run's; checked before anything is read
    tokenizer = model_tokenizer(checkpoint_dir, job_config.model.flavor)
    if tokenizer is not None:
        tokenizer.check(args.vocab_size)
    else:
        tokenizer = job_config.model.hf_assets_path
        read_tokenizer(tokenizer, args.vocab_size)
    reader = DCPModelReader(checkpoint_dir, expected_tensors(model), model_desc(job_config))
    return write_hf_folder_from(
        reader.specs,
        reader.get,
        args,
        fmt,
        tokenizer,
        out_dir,
        dtype=dtype,
        max_shard_size=max_shard_size,
    )


def import_hf(job_config, folder: str, out_dir: str) -> Path:
    from boost_titan.checkpoint.export import (
        check_names_and_shapes,
        expected_tensors,
        model_desc,
        model_for,
        write_dcp_model,
    )

    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out_dir!r} exists; import writes a new checkpoint folder")
    where = f"folder {folder!r}"
    _verify_if_sealed(folder)
    config = read_hf_config(folder)
    fmt = format_for_config(config, f"{folder}/config.json")
    args, model = model_for(job_config)
    found = fmt.args_from_config(config)
    if args.arch == "dense" and found.arch == "dense":
        # a dense folder is imported at its own shapes (eps, RoPE, context included),
        # which the step records: later runs name it, --model.flavor OUT
        args = replace(found, max_seq_len=args.max_seq_len)
        with torch.device("meta"):
            model = type(model)(args)
    else:
        check_same_model(found, args, where, model_desc(job_config))
    read_tokenizer(folder, args.vocab_size)
    state = fmt.from_hf(untie(config, read_hf_tensors(folder)), args)
    check_names_and_shapes(
        {k: v.shape for k, v in state.items()},
        expected_tensors(model),
        where,
        model_desc(job_config),
    )
    return write_dcp_model(state, out, args if args.arch == "dense" else None)


def _verify_if_sealed(folder: str) -> None:
    """A folder sealed by a ``last_save_in_hf`` save is checked, every file, before any
    is read (one line on a mismatch); other folders (the Hub's) carry no seal."""
    import os

    from boost_titan.checkpoint import integrity

    if os.path.isfile(os.path.join(folder, integrity.MANIFEST)):
        problems = integrity.verify(folder)
        if problems:
            raise integrity.ChecksumMismatch(problems[0])
