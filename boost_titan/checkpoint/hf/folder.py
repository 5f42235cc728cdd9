"""A complete Hugging Face model folder, written atomically, and read back.

What :func:`write_hf_folder` writes (the files ``save_pretrained`` and a tokenizer's
``save_pretrained`` would, so ``AutoModelForCausalLM`` / ``AutoTokenizer`` load the folder
offline):

- ``config.json``: the layout's config (:meth:`HFFormat.config`) plus ``bos_token_id``,
  ``eos_token_id`` and ``torch_dtype`` (and ``dtype``, its transformers-5 name);
- ``generation_config.json``: bos/eos ids, greedy decoding;
- ``model.safetensors``, or above ``max_shard_size`` (default 5GB, ``save_pretrained``'s)
  ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json``, each written
  a tensor at a time (``checkpoint.safetensors_stream``: memory holds what the caller's
  ``fetch`` holds, an export's reader one block);
- the layout's remote code (``boost``: ``configuration_boost_llama.py``,
  ``modeling_boost_llama.py``, named by config.json's ``auto_map``);
- the tokenizer: ``tokenizer.json`` (copied byte for byte), ``tokenizer_config.json``
  (``PreTrainedTokenizerFast``, bos/eos tokens, ``model_max_length`` = config.json's
  ``max_position_embeddings``) and ``special_tokens_map.json``; a converted model's own
  tokenizer (``checkpoint.model_tokenizer``) instead: every file its source had, byte
  for byte (``generation_config.json`` too), and config.json's special ids the source's.

The folder is written under a temporary name beside the target and renamed into place
when complete (never half a folder under the target's name), its files with the
permissions of a plain write (the umask's), like ``boost_titan.cli.checkpoint``'s outputs.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from boost_titan.checkpoint.files import load_safetensors
from boost_titan.checkpoint.hf import FORMATS, HFFormat, HFFormatError
from boost_titan.models.args import LlamaArgs, _check_tokenizer_vocab
from boost_titan.models.fields import FieldError, read_json

# the modules that register a layout in FORMATS
_FORMAT_MODULES = ("boost_format", "llama_format", "cola_format")
# config.json's model_type -> the layout that reads it
MODEL_TYPES = {"boost_llama": "boost", "llama": "llama", "cola": "cola"}
# the layout an export writes when none is asked for: one that AutoModelForCausalLM opens
# with transformers alone: its own LlamaForCausalLM for dense, else ours (trust_remote_code;
# the CoLA authors' layout needs their package installed: --hf-layout cola)
_PREFERRED = {"dense": "llama"}

DEFAULT_MAX_SHARD_SIZE = "5GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_REMOTE_DIR = Path(__file__).parent / "remote"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ----------------------------------------------------------------------------- layouts
def formats() -> dict[str, HFFormat]:
    """Every layout (importing the modules that register them)."""
    for module in _FORMAT_MODULES:
        importlib.import_module(f"boost_titan.checkpoint.hf.{module}")
    return FORMATS


def get_format(name: str, arch: str | None = None) -> HFFormat:
    """The layout ``name``; with ``arch``, one that can hold that architecture."""
    table = formats()
    if name not in table:
        raise HFFormatError(f"unknown Hugging Face layout {name!r}; valid: {sorted(table)}")
    fmt = table[name]
    if arch is not None and arch not in fmt.archs:
        valid = sorted(n for n, f in table.items() if arch in f.archs)
        raise HFFormatError(
            f"the {name!r} layout cannot hold a {arch!r} model; layouts for {arch!r}: {valid}"
        )
    return fmt


def default_layout(arch: str) -> str:
    """llama for dense, boost for every low-rank model (CoLA included)."""
    return _PREFERRED.get(arch, "boost")


def format_for_config(config: dict[str, Any], where: str = "config.json") -> HFFormat:
    """The layout that reads a config.json, by its ``model_type``."""
    model_type = config.get("model_type")
    name = MODEL_TYPES.get(model_type)
    if name is None:
        known = sorted(MODEL_TYPES)
        raise HFFormatError(f"{where} has model_type {model_type!r}; readable: {known}")
    return formats()[name]


def model_identity(args: LlamaArgs) -> dict[str, Any]:
    """What defines a model's weights and function (not how it runs): two models with
    equal identities load each other's tensors and compute the same thing."""
    ident: dict[str, Any] = {
        "arch": args.arch,
        "vocab_size": args.vocab_size,
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.kv_heads,
        "ffn_dim": args.ffn_dim,
        "norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
    }
    if args.rope_scaled:
        ident.update(
            rope_scaling_factor=args.rope_scaling_factor,
            rope_low_freq_factor=args.rope_low_freq_factor,
            rope_high_freq_factor=args.rope_high_freq_factor,
            rope_original_max_positions=args.rope_original_max_positions,
        )
    if args.low_rank:
        ident.update(
            rank=args.rank,
            kv_rank=args.effective_kv_rank,
            swiglu=args.swiglu,
            latent_act=args.activation,
        )
    if args.arch == "lax":
        ident.update(lax_gate=args.lax_gate, lax_norm_eps=args.lax_norm_eps)
    return ident


def check_same_model(found: LlamaArgs, expected: LlamaArgs, where: str, model_desc: str) -> None:
    """One error naming every field in which ``found`` differs from ``expected``."""
    a, b = model_identity(found), model_identity(expected)
    diff = [
        f"{k} {a.get(k)!r} (config: {b.get(k)!r})"
        for k in dict.fromkeys([*b, *a])
        if a.get(k) != b.get(k)
    ]
    if diff:
        raise HFFormatError(
            f"{where} holds another model than {model_desc}: {', '.join(diff)}. Use the "
            "config (model name, flavor, [boost] rank options) the weights were trained with."
        )


# ----------------------------------------------------------------------------- sizes
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """Bytes of ``5GB`` (10^9, as ``save_pretrained``), ``5GiB`` (2^30) or an int."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, re.I)
        if m is None:
            raise ValueError(f"size {size!r}: use bytes or e.g. '5GB', '500MB', '2GiB'")
        n = int(float(m[1]) * _UNITS[(m[2] or "").upper()])
    if n <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return n


def _shards(names: list[str], nbytes: dict[str, int], limit: int) -> list[list[str]]:
    """Tensors in name order, a new shard whenever the next would pass ``limit`` (a tensor
    larger than ``limit`` gets a shard of its own, as in ``save_pretrained``)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if shards[-1] and size + nbytes[name] > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


# ----------------------------------------------------------------------------- tokenizer
def read_tokenizer(tokenizer_dir: str | os.PathLike, vocab_size: int) -> dict[str, Any]:
    """The tokenizer of ``tokenizer_dir`` (tokenizer.json, and tokenizer_config.json for
    its bos/eos tokens): checked to fit a model of ``vocab_size``."""
    path = Path(tokenizer_dir or "")
    if not (path / "tokenizer.json").is_file():
        raise HFFormatError(
            f"no tokenizer in {str(path)!r} (no tokenizer.json): a Hugging Face folder "
            "carries its tokenizer; [model] hf_assets_path names the run's"
        )
    _check_tokenizer_vocab(str(path), vocab_size)  # ValueError naming both sizes
    tok = json.loads((path / "tokenizer.json").read_text())
    ids = dict(tok.get("model", {}).get("vocab", {}))
    ids.update({t["content"]: t["id"] for t in tok.get("added_tokens", [])})
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    special = {}
    for role in ("bos_token", "eos_token"):
        token = cfg.get(role)
        if isinstance(token, dict):  # AddedToken's serialised form
            token = token.get("content")
        if token is None:
            continue
        if token not in ids:
            raise HFFormatError(
                f"{cfg_path}: {role} {token!r} is not a token of {path / 'tokenizer.json'}"
            )
        special[role] = token
    return {
        "dir": path,
        "special": special,
        "ids": {role: ids[token] for role, token in special.items()},
        "add_bos_token": bool(cfg.get("add_bos_token", False)),
        "add_eos_token": bool(cfg.get("add_eos_token", False)),
    }


def _tokenizer_files(tok: dict[str, Any], model_max_length: int) -> dict[str, dict]:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tok["special"],
        "add_bos_token": tok["add_bos_token"],
        "add_eos_token": tok["add_eos_token"],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer_config.json": config, "special_tokens_map.json": dict(tok["special"])}


# ----------------------------------------------------------------------------- write
def write_hf_folder(
    state_dict: dict[str, torch.Tensor],
    args: LlamaArgs,
    fmt: str | HFFormat,
    tokenizer_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``state_dict`` (our FQNs) as a complete Hugging Face folder at ``out_dir``
    (which must not exist) in layout ``fmt``; see the module docstring. ``tokenizer_dir``:
    a tokenizer folder, or a converted model's own tokenizer
    (:class:`~boost_titan.checkpoint.model_tokenizer.CarriedTokenizer`: its files copied
    byte for byte, its source's special ids in config.json)."""
    specs = {k: (tuple(v.shape), v.dtype) for k, v in state_dict.items()}
    return write_hf_folder_from(
        specs, state_dict.__getitem__, args, fmt, tokenizer_dir, out_dir, dtype, max_shard_size
    )


def write_hf_folder_from(
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    fetch: Callable[[str], torch.Tensor],
    args: LlamaArgs,
    fmt: str | HFFormat,
    tokenizer_dir,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """:func:`write_hf_folder` of the tensors ``specs`` names (our FQN -> (shape, dtype)),
    each asked of ``fetch`` when its bytes are written and converted to the layout on its
    own (every layout maps one tensor to one): memory holds what ``fetch`` holds."""
    from boost_titan.checkpoint.files import new_tmp

    fmt = get_format(fmt, args.arch) if isinstance(fmt, str) else fmt
    if args.arch not in fmt.archs:
        raise HFFormatError(f"the {fmt.name!r} layout cannot hold a {args.arch!r} model")
    limit = parse_size(max_shard_size)
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{str(out)!r} exists; export writes a new folder")
    carried = tokenizer_dir if hasattr(tokenizer_dir, "ids") else None  # CarriedTokenizer
    if carried is not None:
        carried.check(args.vocab_size)
        tokenizer_dir = carried.folder
    tok = read_tokenizer(tokenizer_dir, args.vocab_size)
    # a converted model's ids are its source config.json's; else the tokenizer's bos/eos
    ids = (
        carried.ids
        if carried is not None and carried.ids
        else {f"{role}_id": i for role, i in tok["ids"].items()}
    )
    verbatim = carried.files() if carried is not None else ["tokenizer.json"]

    ours_of: dict[str, str] = {}
    hf_specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, stored) in specs.items():  # the layout's names and shapes, on meta
        meta = torch.empty(shape, dtype=stored, device="meta")
        ((hf, t),) = fmt.to_hf({name: meta}, args).items()
        ours_of[hf] = name
        hf_specs[hf] = (tuple(t.shape), dtype or t.dtype)
    dtypes = {d for _, d in hf_specs.values()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPE_NAMES:
        raise HFFormatError(
            f"tensors of dtypes {sorted(map(str, dtypes))}: export one of "
            f"{sorted(_DTYPE_NAMES.values())} (--dtype)"
        )

    def fetch_hf(hf: str) -> torch.Tensor:
        name = ours_of[hf]
        t = fmt.to_hf({name: fetch(name)}, args)[hf]
        return t if dtype is None else t.to(dtype)

    dtype_name = _DTYPE_NAMES[dtypes.pop()]
    config = {**fmt.config(args), **ids, "torch_dtype": dtype_name, "dtype": dtype_name}
    written = {
        "generation_config.json": {**ids, "do_sample": False},
        **_tokenizer_files(tok, args.context_length),
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_tmp(out, folder=True)
    try:
        _write_json(tmp / "config.json", config)
        _write_weights(tmp, hf_specs, fetch_hf, limit)
        for name in getattr(fmt, "remote_code", ()):
            _copy(_REMOTE_DIR / name, tmp / name)
        for name in verbatim:  # a converted model's: its source's files, byte for byte
            _copy(tok["dir"] / name, tmp / name)
        for name, content in written.items():
            if name not in verbatim:
                _write_json(tmp / name, content)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _plain_file(path: Path) -> int:
    """Create ``path`` as a plain write would (0666 less the umask); return that mode."""
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    return path.stat().st_mode & 0o777


def _write_json(path: Path, content: dict) -> None:
    _plain_file(path)
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def _copy(src: Path, dst: Path) -> None:
    _plain_file(dst)
    dst.write_bytes(src.read_bytes())


def _write_weights(
    folder: Path,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    fetch: Callable[[str], torch.Tensor],
    limit: int,
) -> None:
    """The shards, planned from the specs, each written a tensor at a time."""
    from boost_titan.checkpoint.safetensors_stream import nbytes as spec_bytes
    from boost_titan.checkpoint.safetensors_stream import write_safetensors

    names = sorted(specs)
    nbytes = {k: spec_bytes(specs[k]) for k in names}
    shards = _shards(names, nbytes, limit)
    files = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, shard in zip(files, shards):
        path = folder / file
        _plain_file(path)  # (writing into it keeps a plain write's mode)
        write_safetensors(path, {k: specs[k] for k in shard}, fetch, metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(nbytes.values())},
            "weight_map": {k: file for file, shard in zip(files, shards) for k in shard},
        }
        _write_json(folder / INDEX_FILE, index)


# ----------------------------------------------------------------------------- read
def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder)
    if not (path / "config.json").is_file():
        hint = "it does not exist" if not path.exists() else "no config.json"
        raise FileNotFoundError(f"{str(path)!r} is not a Hugging Face model folder: {hint}")
    config = path / "config.json"
    try:
        return read_json(config, str(config))
    except FieldError as e:
        raise HFFormatError(str(e)) from None


def read_hf_tensors(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weights (one file, or the shards its index names),
    by Hugging Face name, as stored."""
    path = Path(folder)
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (path / f).is_file()]
        if absent:
            raise HFFormatError(f"{str(path)!r}: {INDEX_FILE} names missing shards {absent}")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            shard = load_safetensors(path / file)
            stray = sorted(k for k in shard if weight_map.get(k) != file)
            if stray:
                raise HFFormatError(
                    f"{str(path / file)!r} holds tensors its index puts elsewhere: {stray[:5]}"
                )
            state.update(shard)
        unlisted = sorted(set(weight_map) - set(state))
        if unlisted:
            raise HFFormatError(
                f"{str(path)!r}: tensors in the index but in no shard: {unlisted[:5]}"
            )
        return state
    if (path / SINGLE_FILE).is_file():
        return load_safetensors(path / SINGLE_FILE)
    raise HFFormatError(f"{str(path)!r} has no weights ({SINGLE_FILE} or {INDEX_FILE})")


def read_hf_folder(folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, the tensors by Hugging Face name)."""
    return read_hf_config(folder), read_hf_tensors(folder)
