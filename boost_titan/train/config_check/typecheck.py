"""Types: every value of the parsed config against its field's annotation (a TOML
file is not type-checked by torchtitan, and TOML values are not converted)."""

from __future__ import annotations

import dataclasses
import types
import typing

from boost_titan.train.config_check.common import bad


def _type_ok(value, tp) -> bool:
    """Whether ``value`` has the annotated type (TOML values are not converted)."""
    origin = typing.get_origin(tp)
    if tp is typing.Any:
        return True
    if tp is type(None):
        return value is None
    if origin is typing.Literal:
        return (
            value in typing.get_args(tp)
            and not isinstance(value, bool)
            or (isinstance(value, bool) and any(a is value for a in typing.get_args(tp)))
        )
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is list:
        (item,) = typing.get_args(tp) or (typing.Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation this check does not model


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(tp))}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "unset"
    return getattr(tp, "__name__", None) if origin is None else str(tp).replace("typing.", "")


def _check_types(obj, section: str = "") -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints.get(f.name, f.type)
        where = f"{section}.{f.name}" if section else f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_types(value, where)
        elif not _type_ok(value, tp):
            sec, _, key = where.rpartition(".")
            raise bad(
                sec, key, value, f"has type {type(value).__name__}; expected {_type_name(tp)}"
            )
