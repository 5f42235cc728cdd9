"""Consolidated safetensors export / import of boost_titan checkpoints, and their
verification.

    python -m boost_titan.checkpoint export --job.config_file CONFIG [--section.key v ...] \\
        --from outputs/run/checkpoint/step-1000 --to outputs/exported/model.safetensors \\
        [--dtype bfloat16]
    python -m boost_titan.checkpoint import --job.config_file CONFIG [...] \\
        --from outputs/exported/model.safetensors --to outputs/imported/step-0
    python -m boost_titan.checkpoint verify outputs/run/checkpoint[/step-1000]

With ``--format hf`` export writes, and import reads, a Hugging Face model folder
instead of one safetensors file (``boost_titan.hf.convert``, docs/huggingface.md).

``verify`` checks every byte of a checkpoint against the checksums its save recorded
(``boost_titan.integrity``), without loading it or any config: exit 0 when it
verifies, 1 with one line per bad item.

``export`` reads the model weights of a DCP checkpoint written by any layout (1
process, TP/BTP, FSDP2, HSDP, PP: DCP stores global tensors, so the layout does not
matter) and writes them to one safetensors file. ``import`` writes a model-only DCP
checkpoint that training loads with ``--checkpoint.initial_load_path`` in any layout.
The config (model name, flavor, ``[boost]`` rank options) defines the model the weights
must fit: every parameter must be present with its exact shape, with nothing extra,
or the command fails naming the offending tensors, before writing anything.

File layout (documented in docs/checkpoints.md): one tensor per parameter under its model FQN
(``tok_embeddings.weight``, ``layers.{i}.attention.wq.down.weight`` = A [r, d],
``layers.{i}.attention.wq.up.weight`` = B [heads*head_dim, r], so W ~= B @ A, ...),
and string metadata: ``format`` (``boost_titan/1``), ``model_name``, ``flavor``,
``model_args`` (JSON), ``source`` and ``step``.

Both commands write to a temporary path in the target's folder and rename it into place
when complete: a failure never leaves a half-written file or checkpoint behind. What they
write has the permissions of any other file the user writes (0644 files, 0755 folders
under umask 022).
"""

from __future__ import annotations

from boost_titan import cpu_runtime

cpu_runtime.activate()  # before torchtitan is imported (via the config)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from boost_titan import integrity, safe_metadata  # noqa: E402

safe_metadata.install()  # .metadata is unpickled with an allowlist, never plain pickle
integrity.install()  # checksummed saves (import), verified loads (export)

FORMAT = "boost_titan/1"
# DCP warns that it runs without a process group: that is the point here
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)
# top-level DCP keys torchtitan stores next to the (flattened) model state
_TRAINING_STATE = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state")


def model_for(job_config):
    """(train spec's model args after the config's overrides, meta-device model)."""
    import copy

    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(job_config.model.name)
    args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    return args, model


def expected_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent state (parameters and persistent buffers) by FQN, on meta."""
    return dict(model.state_dict())


def _check_names_and_shapes(
    found: dict[str, torch.Size], expected: dict[str, torch.Tensor], where: str, model_desc: str
) -> None:
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    wrong = sorted(
        f"{k}: {tuple(found[k])} (model: {tuple(expected[k].shape)})"
        for k in set(found) & set(expected)
        if tuple(found[k]) != tuple(expected[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:5]}")
    if extra:
        problems.append(f"{len(extra)} tensors the model does not have, e.g. {extra[:5]}")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatches, e.g. {wrong[:5]}")
    if problems:
        raise ValueError(
            f"{where} does not fit {model_desc}: "
            + "; ".join(problems)
            + ". Use the config (model name, flavor, [boost] rank options) "
            "the weights were trained with."
        )


def _model_desc(job_config) -> str:
    return f"model {job_config.model.name!r} flavor {job_config.model.flavor!r}"


def read_dcp_model(
    checkpoint_dir: str | os.PathLike,
    expected: dict[str, torch.Tensor],
    model_desc: str = "the model",
) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint as full, plain CPU tensors (their stored dtype)."""
    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        hint = (
            ""
            if path.exists()
            else ": it does not exist. Checkpoints are written by runs with [checkpoint] "
            "enable = true (e.g. `./run_train.sh --checkpoint.enable`), as "
            "<dump_folder>/checkpoint/step-N"
        )
        raise FileNotFoundError(f"{str(path)!r} is not a DCP checkpoint (no .metadata file){hint}")
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    stored = {
        k: v
        for k, v in meta.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith(_TRAINING_STATE)
    }
    _check_names_and_shapes(
        {k: v.size for k, v in stored.items()}, expected, f"checkpoint {str(path)!r}", model_desc
    )
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in stored.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def _step_of(path: Path) -> str:
    m = re.fullmatch(r"step-(\d+)", path.name)
    return m[1] if m else ""


def _args_json(args) -> str:
    fields = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
    return json.dumps(
        {k: v for k, v in fields.items() if isinstance(v, (int, float, str, bool, type(None)))},
        sort_keys=True,
    )


def _new_tmp(target: Path, *, folder: bool) -> Path:
    """A new temporary file or folder beside ``target``, to be renamed onto it, created
    as a plain write creates one (0666 / 0777 less the umask): ``tempfile.mkstemp`` and
    ``mkdtemp`` make theirs 0600 / 0700, and the rename would carry that to the output."""
    while True:
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            if folder:
                os.mkdir(tmp, 0o777)
            else:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:  # another export's temporary name: draw again
            continue


def export_safetensors(
    job_config, checkpoint_dir: str, out: str, dtype: torch.dtype | None = None
) -> Path:
    from safetensors.torch import save_file

    args, model = model_for(job_config)
    state = read_dcp_model(checkpoint_dir, expected_tensors(model), _model_desc(job_config))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": FORMAT,
        "model_name": job_config.model.name,
        "flavor": job_config.model.flavor,
        "model_args": _args_json(args),
        "source": str(Path(checkpoint_dir).resolve()),
        "step": _step_of(Path(checkpoint_dir)),
    }
    tmp = _new_tmp(out_path, folder=False)
    plain_mode = tmp.stat().st_mode & 0o777  # the umask's, as the kernel applied it
    try:
        save_file(
            {k: v.contiguous() for k, v in sorted(state.items())}, str(tmp), metadata=metadata
        )
        os.chmod(tmp, plain_mode)  # safetensors' save_file leaves its file 0600
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path


def import_safetensors(job_config, path: str, out_dir: str) -> Path:
    from safetensors import safe_open

    src = Path(path)
    if not src.is_file():
        raise FileNotFoundError(f"safetensors file {path!r} does not exist")
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out_dir!r} exists; import writes a new checkpoint folder")
    args, model = model_for(job_config)
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{path!r} is not a boost_titan export (format {meta.get('format')!r}, "
                f"expected {FORMAT!r})"
            )
        for key, want in (
            ("model_name", job_config.model.name),
            ("flavor", job_config.model.flavor),
        ):
            if meta.get(key) != want:
                raise ValueError(
                    f"{path!r} holds {key} {meta.get(key)!r}, the config says {want!r}"
                )
        state = {k: f.get_tensor(k) for k in f.keys()}
    _check_names_and_shapes(
        {k: v.shape for k, v in state.items()},
        expected_tensors(model),
        f"file {path!r}",
        _model_desc(job_config),
    )
    return write_dcp_model(state, out)


def write_dcp_model(state: dict[str, torch.Tensor], out: Path) -> Path:
    """A model-only DCP checkpoint folder at ``out`` (which must not exist), atomically."""
    if out.exists():
        raise FileExistsError(f"{str(out)!r} exists; import writes a new checkpoint folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_tmp(out, folder=True)
    try:
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["verify"]:  # no config: it reads nothing but the checkpoint
        raise SystemExit(integrity.main(argv[1:]))
    from boost_titan.config_check import parse_config

    p = argparse.ArgumentParser(
        prog="python -m boost_titan.checkpoint",
        description="Export a DCP checkpoint to one safetensors file, or import one back. "
        "Other arguments (--job.config_file, --model.*, --boost.*) define the model. "
        "`verify PATH` checks a checkpoint's checksums instead (see `verify --help`).",
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
            from boost_titan.hf.convert import export_hf, import_hf

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


if __name__ == "__main__":
    main()
