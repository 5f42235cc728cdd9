"""The tokenizer a converted model carries: its source folder's, kept in the step folder.

A model converted from a Hugging Face folder (``checkpoint from-dense``) has that
folder's embeddings and LM head, one row per token id of that folder's tokenizer: with
any other tokenizer its ids stand for other tokens. So the conversion copies the
source's tokenizer files, byte for byte, into ``STEP/tokenizer/`` (``tokenizer.json``,
``tokenizer_config.json``, ``special_tokens_map.json``, ``generation_config.json``: those
the source has), and writes there ``special_ids.json``: the special token ids of the
source's config.json (``bos_token_id``, ``eos_token_id``, ``pad_token_id``, an id or a
list of ids, as there) and the folder they came from. The folder is a tokenizer folder
like any other: ``--model.hf_assets_path STEP/tokenizer``, ``data tokenize --tokenizer
STEP/tokenizer``.

- ``checkpoint export --format hf`` of the step, or of any step of a run whose model is
  the step (``--model.flavor STEP``), writes these files and ids (config.json's and
  generation_config.json's), not the run's tokenizer;
- a training run whose model is such a step (``[model] flavor`` or ``[checkpoint]
  initial_load_path``) must tokenize with it (``boost_titan.train.config_check.files``);
- a conversion of a step that carries one (a dense step) carries it on.

Not sealed (as ``model_args.json``): read strictly, each id checked against the
vocabulary, the files as any tokenizer folder's (``hf.folder.read_tokenizer``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKENIZER_DIR = "tokenizer"
COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
IDS_FILE = "special_ids.json"
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
FORMAT_VERSION = 1


class ModelTokenizerError(ValueError):
    """A source or step tokenizer that cannot be carried: one line naming the file."""


@dataclass
class CarriedTokenizer:
    """A model's own tokenizer: the folder holding its files, its special ids."""

    folder: Path  # the files (a Hugging Face folder, or STEP/tokenizer)
    ids: dict[str, Any] = field(default_factory=dict)  # config.json's special ids
    source: str = ""  # the folder the model was converted from

    def files(self) -> list[str]:
        return [n for n in COPIED if (self.folder / n).is_file()]

    def check(self, vocab_size: int) -> CarriedTokenizer:
        """The files fit a model of ``vocab_size`` and every id is a token id of it."""
        from boost_titan.checkpoint.hf.folder import read_tokenizer

        read_tokenizer(self.folder, vocab_size)  # one line naming the folder
        _check_ids(self.ids, vocab_size, str(self.folder))
        return self

    def write(self, step: str | os.PathLike) -> Path:
        """``STEP/tokenizer/``: the files, byte for byte, and the ids."""
        out = Path(step) / TOKENIZER_DIR
        out.mkdir()
        for name in self.files():
            (out / name).write_bytes((self.folder / name).read_bytes())
        record = {"format_version": FORMAT_VERSION, "source": self.source, "ids": self.ids}
        (out / IDS_FILE).write_text(json.dumps(record, indent=1) + "\n")
        return out


def _check_ids(ids: dict[str, Any], vocab_size: int, where: str) -> None:
    for key, value in ids.items():
        values = value if isinstance(value, list) else [value]
        ok = (
            key in ID_KEYS
            and values
            and all(
                isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size
                for v in values
            )
        )
        if not ok:
            raise ModelTokenizerError(
                f"{where}: {key} = {value!r} is not a token id (an integer in [0, "
                f"{vocab_size}) or a list of them; keys: {list(ID_KEYS)})"
            )


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelTokenizerError(f"{path} cannot be read as JSON: {e}") from None


def carried_by(path: str | os.PathLike | None) -> CarriedTokenizer | None:
    """The tokenizer a step folder (or its ``model_args.json``) carries, or a Hugging
    Face model folder holds (config.json and tokenizer.json); None for anything else."""
    if not path:
        return None
    p = Path(path)
    if p.is_file() and p.suffix == ".json":  # a flavor naming the record itself
        p = p.parent
    if not p.is_dir():
        return None
    ids_file = p / TOKENIZER_DIR / IDS_FILE
    if ids_file.is_file():
        record = _read_json(ids_file)
        ok = isinstance(record, dict) and record.get("format_version") == FORMAT_VERSION
        if not ok or not isinstance(record.get("ids"), dict):
            raise ModelTokenizerError(
                f"{ids_file}: not a record of this boost_titan (format_version "
                f"{FORMAT_VERSION} with an 'ids' object)"
            )
        return CarriedTokenizer(ids_file.parent, record["ids"], str(record.get("source", "")))
    if (p / "config.json").is_file() and (p / "tokenizer.json").is_file():
        config = _read_json(p / "config.json")
        config = config if isinstance(config, dict) else {}
        ids = {k: config[k] for k in ID_KEYS if config.get(k) is not None}
        return CarriedTokenizer(p, ids, str(p.resolve()))
    return None


def model_tokenizer(step: str | None, flavor: str | None) -> CarriedTokenizer | None:
    """The tokenizer of the model a step holds: the step's own, else that of the step
    its run's ``[model] flavor`` names (a run's own steps carry none)."""
    from boost_titan.checkpoint.model_args import is_flavor_path

    for path in (step, flavor if flavor and is_flavor_path(flavor) else None):
        if path and not (Path(path) / "config.json").is_file():  # a step, not a HF folder
            carried = carried_by(path)
            if carried is not None:
                return carried
    return None


def for_conversion(src: str | os.PathLike, vocab_size: int) -> CarriedTokenizer | None:
    """The tokenizer a conversion of ``src`` carries into its step (checked to fit): a
    Hugging Face folder's own (refused in one line without one: its embeddings' rows
    are ids of a tokenizer it does not name), a step's carried one, else None (one of
    our trainer's dense steps: the run's tokenizer, as for the dense run)."""
    carried = carried_by(src)
    if carried is not None:
        return carried.check(vocab_size)
    if (Path(src) / "config.json").is_file():
        raise ModelTokenizerError(
            f"folder {str(src)!r} holds no tokenizer.json: the converted model keeps its "
            "source's tokenizer (the embeddings' rows are its token ids); put the model's "
            "tokenizer files (tokenizer.json, tokenizer_config.json) beside its config.json"
        )
    return None
