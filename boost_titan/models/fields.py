"""The model's fields as files give them: one check of their types and ranges for every
file that sets them (a step's ``model_args.json``, ``boost_titan.models.recorded``; a
Hugging Face ``config.json`` as its layout translates it,
``boost_titan.checkpoint.hf.llama_format``), and the strict JSON reader both are read
with.

A value no model runs with is refused when the file is read, in one line naming the
file, the key, the value and what is valid, before anything is written: not at launch
(issue 56: an RMSNorm eps of -1, a RoPE theta of -5 or a llama3 factor NaN were written
into a converted step and refused by a later run, or never), not as a traceback
(``hidden_size`` 64.0 or "64", a top-level array, 100,000 nested brackets) and not by
the kernel's OOM killer (10^12 layers: even a meta-device model builds every layer's
modules). Integers must be JSON integers (not 64.0, "64" or true), floats finite
(Python's ``json`` reads ``NaN`` and ``Infinity``, which are not JSON: refused), and
counts lie within :data:`INT_RANGES`, far beyond any model trained (Llama 3.1 405B:
dim 16,384, 126 layers, 128 heads, a 128,256-token vocabulary) and far below what a
process could hold.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

# LlamaArgs' integer fields -> (lowest, highest) value
INT_RANGES: dict[str, tuple[int, int]] = {
    "dim": (1, 1 << 17),
    "n_layers": (1, 1024),
    "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024),  # (or null: as many as n_heads)
    "vocab_size": (1, 1 << 24),
    "ffn_dim": (1, 1 << 20),
    "rope_original_max_positions": (1, 1 << 24),
    "max_positions": (0, 1 << 24),  # 0: unknown
    "rank": (0, 1 << 17),  # 0: a dense model's
    "kv_rank": (0, 1 << 17),  # 0: derived from rank
}
# LlamaArgs' float fields: each a finite number > 0
POSITIVE_FLOATS = (
    "norm_eps",
    "rope_theta",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "lax_norm_eps",
)
BOOLS = ("swiglu",)
STRINGS = ("arch", "latent_act", "lax_gate")


class FieldError(ValueError):
    """A model file refused: one line naming the file, the key, the value and what is
    valid."""


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, _Constant) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _invalid(field: str, value: Any) -> str | None:
    """What ``value`` of LlamaArgs' ``field`` must be, where it is not that."""
    if field in INT_RANGES:
        lo, hi = INT_RANGES[field]
        ok = isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi
        return None if ok or (field == "n_kv_heads" and value is None) else (
            f"a JSON integer in [{lo:,}, {hi:,}]"
        )  # fmt: skip
    if field in POSITIVE_FLOATS:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if number and math.isfinite(value) and value > 0 else "a finite number > 0"
    if field in BOOLS:
        return None if isinstance(value, bool) else "true or false"
    if field in STRINGS:
        return None if isinstance(value, str) else "a string"
    raise AssertionError(f"no rule for the model field {field!r}")  # a field added to LlamaArgs


def check_fields(values: dict[str, Any], where: str, keys: dict[str, str] | None = None) -> None:
    """``values`` (LlamaArgs field -> the value a file gives it) each of the type and
    in the range a model runs with; :class:`FieldError` naming ``where`` and the file's
    key for the field (``keys``: field -> key, e.g. ``dim`` -> ``hidden_size``)."""
    keys = keys or {}
    for field, value in values.items():
        valid = _invalid(field, value)
        if valid is not None:
            raise FieldError(f"{where}: {keys.get(field, field)} = {_shown(value)} is not {valid}")
    low, high = values.get("rope_low_freq_factor"), values.get("rope_high_freq_factor")
    scaled = values.get("rope_scaling_factor", 1.0) != 1.0
    if scaled and low is not None and high is not None and not low < high:
        lk, hk = (keys.get(f, f) for f in ("rope_low_freq_factor", "rope_high_freq_factor"))
        raise FieldError(
            f"{where}: {lk} = {_shown(low)} is not below {hk} = {_shown(high)} (llama3 RoPE "
            "scaling blends the frequencies between them, dividing by their difference)"
        )


class _Constant(str):
    """``NaN``, ``Infinity`` or ``-Infinity`` where a JSON file has one (Python's json
    reads them as floats; they are not JSON): refused with its key."""


def _no_constants(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    for key, value in pairs:
        todo = [value]
        while todo:
            item = todo.pop()
            if isinstance(item, _Constant):
                raise FieldError(f"{key} = {item} is not JSON (JSON numbers are finite)")
            if isinstance(item, list):
                todo.extend(item)
    return dict(pairs)


def read_json(path: str | os.PathLike, where: str) -> dict[str, Any]:
    """The JSON object in the file ``path``; :class:`FieldError` starting with ``where``
    (what the file is, its path in it) where the file cannot be read, is no JSON, nests
    deeper than Python's reader goes, holds a NaN or Infinity, or holds no object."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode()
        data = json.loads(text, parse_constant=_Constant, object_pairs_hook=_no_constants)
    except OSError as e:
        raise FieldError(f"{where} cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise FieldError(f"{where} is not UTF-8 text") from None
    except FieldError as e:
        raise FieldError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise FieldError(
            f"{where} is not JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    except RecursionError:
        raise FieldError(
            f"{where} is not JSON we read: its arrays or objects nest deeper than Python's "
            "JSON reader goes"
        ) from None
    if not isinstance(data, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
        raise FieldError(f"{where} holds {kind.get(type(data), 'a number')}, not a JSON object")
    return data
