"""``boost-titan checkpoint``: export / import a checkpoint's model weights, verify a
checkpoint, start a low-rank model from a dense one.

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

``boost-titan checkpoint --help`` lists the commands, ``boost-titan checkpoint <command>
--help`` shows the command's own options. Bad input is one line (:mod:`boost_titan.cli.args`):
exit 1 (a bad option, an unknown command: 2); nothing is written (every output is renamed into
place when complete). What the commands write has the permissions of any other file the
user writes (0644 files, 0755 folders under umask 022).
"""

from __future__ import annotations

import argparse
import os
import textwrap
import time

import torch

from boost_titan.checkpoint import integrity, safe_metadata
from boost_titan.checkpoint.export import export_safetensors, import_safetensors
from boost_titan.cli.args import Parser, fail
from boost_titan.parallel import cpu_runtime

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


PROG = "boost-titan checkpoint"
# command -> what it does (`boost-titan checkpoint --help`)
COMMANDS = {
    "export": "a DCP checkpoint step -> one safetensors file, or a Hugging Face folder "
    "(--format hf); needs --job.config_file",
    "import": "a safetensors file, or a Hugging Face folder (--format hf) -> a model-only "
    "DCP step; needs --job.config_file",
    "verify": "check checkpoint steps against their manifests, every byte (no config)",
    "from-dense": "a dense LLaMA (Hugging Face folder or llama2 DCP step) -> a low-rank "
    "DCP step; needs --job.config_file",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    indent = " " * (width + 4)
    return "\n".join(
        [
            f"usage: {PROG} {{{','.join(COMMANDS)}}} [options]",
            "",
            "Export / import a checkpoint's model weights, verify a checkpoint, start a",
            "low-rank model from a dense one.",
            "",
            "commands:",
            *(
                textwrap.fill(
                    what, 92, initial_indent=f"  {name:<{width}}  ", subsequent_indent=indent
                )
                for name, what in COMMANDS.items()
            ),
            "",
            f"{PROG} <command> --help: the command's options",
        ]
    )


def build_parser(command: str) -> Parser:
    """``export`` / ``import``: their own usage; options of the other are hidden, and
    refused in one line."""
    export = command == "export"

    def only_export(text: str) -> str:
        return text if export else argparse.SUPPRESS

    p = Parser(
        prog=f"{PROG} {command}",
        usage=f"%(prog)s --job.config_file CONFIG --from {'STEP' if export else 'FILE'} "
        f"--to {'FILE' if export else 'STEP'} [options] [--section.key VALUE ...]",
        description=(
            "Export a DCP checkpoint step's model weights to one safetensors file "
            "(--format hf: a Hugging Face model folder)."
            if export
            else "Import a safetensors file (--format hf: a Hugging Face model folder) "
            "as a model-only DCP checkpoint step."
        )
        + " The config (--job.config_file and any --model.* / --boost.* override) defines "
        "the model, as for training.",
    )
    p.add_argument(
        "--job.config_file",
        dest="config_file",
        metavar="CONFIG",
        required=True,
        help="the model's training config (TOML), required",
    )
    p.add_argument(
        "--from",
        dest="src",
        metavar="STEP" if export else "FILE",
        required=True,
        help="DCP step folder" if export else ".safetensors file, or HF folder with --format hf",
    )
    p.add_argument(
        "--to",
        dest="dst",
        metavar="FILE" if export else "STEP",
        required=True,
        help="new .safetensors file, or new HF folder with --format hf"
        if export
        else "new DCP step folder",
    )
    p.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="safetensors (default): one file in our layout; hf: a Hugging Face model folder "
        "(docs/huggingface.md)",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        help=only_export("cast every tensor (default: as stored)"),
    )
    p.add_argument(
        "--hf-layout",
        choices=["boost", "llama", "cola"],
        help=only_export(
            "--format hf: the folder's layout (default: llama for llama2, boost for the "
            "low-rank models; cola: the CoLA authors' ColaForCausalLM, their code needed)"
        ),
    )
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        help=only_export("--format hf: largest safetensors file before sharding (default 5GB)"),
    )
    return p


def _recorded_flavor(src: str) -> list[str]:
    """A step that records its model (from-dense, import) is exported as that model:
    ``--model.flavor STEP``, unless the command line names a flavor."""
    from boost_titan.models.recorded import MODEL_ARGS_FILE

    if os.path.isfile(os.path.join(src, MODEL_ARGS_FILE)):
        path = src.rstrip("/")
        return ["--model.flavor", path if "/" in path else f"./{path}"]  # a path flavor
    return []


def _carried_tokenizer(src: str, rest: list[str]) -> list[str]:
    """A converted model's own tokenizer is the export's (``checkpoint.model_tokenizer``):
    the config's ``[model] hf_assets_path`` becomes it, so that the model's vocabulary is
    checked against the tokenizer the folder will hold, not the run's."""
    from boost_titan.checkpoint.model_tokenizer import model_tokenizer

    flavor = None
    for i, a in enumerate(rest):
        if a == "--model.flavor" and i + 1 < len(rest):
            flavor = rest[i + 1]
        elif a.startswith("--model.flavor="):
            flavor = a.split("=", 1)[1]
    carried = model_tokenizer(src, flavor)
    return [] if carried is None else ["--model.hf_assets_path", str(carried.folder)]


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        raise SystemExit(0)
    if not argv or argv[0] not in COMMANDS:
        got = f"unknown command {argv[0]!r}" if argv else "no command"
        fail(PROG, f"{got}; valid: {', '.join(COMMANDS)} ({PROG} --help)")
    command, argv = argv[0], argv[1:]
    t0 = time.perf_counter()
    cpu_runtime.activate()  # before torchtitan is imported (via the config)
    safe_metadata.install()  # .metadata is unpickled with an allowlist, never plain pickle
    integrity.install()  # sealed saves (import), verified loads (export)
    if command == "verify":  # no config: it reads nothing but the checkpoint
        raise SystemExit(integrity.main(argv))
    if command == "from-dense":  # a dense LLaMA -> a low-rank model (its own options)
        from boost_titan.cli.from_dense import main as from_dense

        raise SystemExit(from_dense(argv))
    from boost_titan.train.config_check import parse_config

    p = build_parser(command)
    ours, rest = p.parse_known_args(argv)
    if ours.dtype and command == "import":
        p.error("--dtype applies to export only")
    if ours.hf_layout and (ours.format != "hf" or command != "export"):
        p.error("--hf-layout applies to export --format hf only")
    rest = ["--job.config_file", ours.config_file, *rest]
    if command == "export" and not any(a.startswith("--model.flavor") for a in rest):
        rest += _recorded_flavor(ours.src)
    if command == "export" and not any(a.startswith("--model.hf_assets_path") for a in rest):
        try:
            rest += _carried_tokenizer(ours.src, rest)
        except ValueError as e:  # a carried tokenizer's record that cannot be read
            fail(p.prog, str(e), 1)
    try:
        job_config = parse_config(rest, layout=False)  # the model only: any layout fits
        if ours.format == "hf":
            from boost_titan.checkpoint.hf.convert import export_hf, import_hf

            if command == "export":
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
        elif command == "export":
            out = export_safetensors(job_config, ours.src, ours.dst, _DTYPES.get(ours.dtype))
        else:
            out = import_safetensors(job_config, ours.src, ours.dst)
    except (
        FileNotFoundError,
        FileExistsError,
        ValueError,  # a damaged safetensors file too (checkpoint.safetensors_file)
        safe_metadata.UntrustedCheckpointError,
        integrity.ChecksumMismatch,
    ) as e:  # bad input: one line
        fail(p.prog, str(e), 1)
    except BaseException as e:  # DCP wraps a mismatch found while it reads
        if (bad := integrity.mismatch_in(e)) is None:
            raise
        fail(p.prog, str(bad), 1)
    if command == "export":  # as from-dense does: an export must fit where its conversion fit
        from boost_titan.observability.peak_rss import peak_rss_gib

        print(f"wrote {out} in {time.perf_counter() - t0:.1f} s, peak RSS {peak_rss_gib():.2f} GiB")
    else:
        print(f"wrote {out}")
