"""``boost-titan checkpoint``: export / import a checkpoint's model weights, verify a
checkpoint.

    boost-titan checkpoint export --job.config_file CONFIG [--section.key v ...] \\
        --from outputs/run/checkpoint/step-1000 --to outputs/exported/model.safetensors \\
        [--dtype bfloat16]
    boost-titan checkpoint import --job.config_file CONFIG [...] \\
        --from outputs/exported/model.safetensors --to outputs/imported/step-0
    boost-titan checkpoint verify outputs/run/checkpoint[/step-1000]
    boost-titan checkpoint from-dense --job.config_file CONFIG --from DENSE --to OUT/step-0

``from-dense`` converts a dense LLaMA (a Hugging Face folder or a ``llama2`` DCP step)
into the config's low-rank model (:mod:`boost_titan.cli.from_dense`, docs/from-dense.md).

With ``--format hf`` export writes, and import reads, a Hugging Face model folder
instead of one safetensors file (:mod:`boost_titan.checkpoint.hf.convert`,
docs/huggingface.md); plain export / import: :mod:`boost_titan.checkpoint.export`.

``verify`` checks a checkpoint step against its manifest, every byte
(:mod:`boost_titan.checkpoint.integrity`), without loading it or any config: exit 0 when
it verifies, 1 with one line per problem.

Bad input is one line and exit 1; nothing is written (every output is renamed into
place when complete). What the commands write has the permissions of any other file the
user writes (0644 files, 0755 folders under umask 022).
"""

from __future__ import annotations

import argparse

import torch

from boost_titan.checkpoint import integrity, safe_metadata
from boost_titan.checkpoint.export import export_safetensors, import_safetensors
from boost_titan.parallel import cpu_runtime

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    cpu_runtime.activate()  # before torchtitan is imported (via the config)
    safe_metadata.install()  # .metadata is unpickled with an allowlist, never plain pickle
    integrity.install()  # sealed saves (import), verified loads (export)
    if argv[:1] == ["verify"]:  # no config: it reads nothing but the checkpoint
        raise SystemExit(integrity.main(argv[1:]))
    if argv[:1] == ["from-dense"]:  # a dense LLaMA -> a low-rank model (its own options)
        from boost_titan.cli.from_dense import main as from_dense

        raise SystemExit(from_dense(argv[1:]))
    from boost_titan.train.config_check import parse_config

    p = argparse.ArgumentParser(
        prog="boost-titan checkpoint",
        description="Export a DCP checkpoint to one safetensors file, or import one back. "
        "Other arguments (--job.config_file, --model.*, --boost.*) define the model. "
        "`verify PATH` checks a checkpoint step against its manifest instead "
        "(see `verify --help`); `from-dense` converts a dense LLaMA into a low-rank model "
        "(see `from-dense --help`).",
    )
    p.add_argument("command", choices=["export", "import", "verify"])
    p.add_argument(
        "--from",
        dest="src",
        required=True,
        help="DCP step folder (export), or .safetensors / HF folder with --format hf (import)",
    )
    p.add_argument(
        "--to",
        dest="dst",
        required=True,
        help=".safetensors / new HF folder with --format hf (export), or new DCP folder (import)",
    )
    p.add_argument(
        "--dtype", choices=sorted(_DTYPES), help="export: cast every tensor (default: as stored)"
    )
    p.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="safetensors: one file in our layout; hf: a Hugging Face model folder "
        "(docs/huggingface.md)",
    )
    p.add_argument(
        "--hf-layout",
        choices=["boost", "llama", "cola"],
        help="export --format hf: the folder's layout (default: llama for llama2, cola for "
        "cola_llama2 where available, else boost); import reads config.json's model_type",
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help="export --format hf: largest safetensors file before sharding (default 5GB)",
    )
    ours, rest = p.parse_known_args(argv)
    if ours.dtype and ours.command == "import":
        p.error("--dtype applies to export only")
    if ours.hf_layout and (ours.format != "hf" or ours.command != "export"):
        p.error("--hf-layout applies to export --format hf only")
    try:
        job_config = parse_config(rest, layout=False)  # the model only: any layout fits
        if ours.format == "hf":
            from boost_titan.checkpoint.hf.convert import export_hf, import_hf

            if ours.command == "export":
                out = export_hf(
                    job_config,
                    ours.src,
                    ours.dst,
                    ours.hf_layout,
                    _DTYPES.get(ours.dtype),
                    ours.max_shard_size,
                )
            else:
                out = import_hf(job_config, ours.src, ours.dst)
        elif ours.command == "export":
            out = export_safetensors(job_config, ours.src, ours.dst, _DTYPES.get(ours.dtype))
        else:
            out = import_safetensors(job_config, ours.src, ours.dst)
    except (
        FileNotFoundError,
        FileExistsError,
        ValueError,
        safe_metadata.UntrustedCheckpointError,
        integrity.ChecksumMismatch,
    ) as e:  # bad input: one line
        p.exit(1, f"{p.prog} {ours.command}: error: {e}\n")
    except BaseException as e:  # DCP wraps a mismatch found while it reads
        if (bad := integrity.mismatch_in(e)) is None:
            raise
        p.exit(1, f"{p.prog} {ours.command}: error: {bad}\n")
    print(f"wrote {out}")
