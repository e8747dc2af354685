"""Typed TOML tables: dataclasses whose fields say their key, unit and range, checked key by key.

The one validation machinery of the config (:mod:`gpushare.config`) and of the simulator's
scenarios (:mod:`gpushare.sim.scenario`): one clear error per bad key.

A field's TOML key is its name without the unit suffix its kind implies (``period_s`` with
``kind = "duration"`` is ``period = "100ms"``; ``mem_bytes`` with ``kind = "size"`` is
``mem = "4G"``), or ``metadata["key"]``. Metadata ``min``/``max`` (``above``: the minimum itself is
out) bound a number; ``read`` is a hook ``(reader, value, key)`` for a value no plain type
describes. A field without a default is required. Every bad value raises the reader's
:class:`TomlError` subclass naming the file, the key path and what would be valid.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any, Literal, NoReturn

from gpushare.units import (
    DURATION_HINT,
    SIZE_HINT,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)

_UNIT_SUFFIX = {"size": "_bytes", "duration": "_s"}


class TomlError(Exception):
    """A TOML file that cannot be used; says where and what would be valid."""

    #: How a source without a file name is named.
    unnamed = "<toml>"

    def __init__(self, file: Path | str | None, key: str, reason: str) -> None:
        self.file = str(file) if file is not None else self.unnamed
        self.key = key
        self.reason = reason
        where = f"{self.file}: {key}" if key else self.file
        super().__init__(f"{where}: {reason}")


def size(default: int, *, minimum: int = 0) -> Any:
    """A size field (``"4G"``, bytes in the name's ``_bytes`` field)."""
    return field(default=default, metadata={"kind": "size", "min": minimum})


def duration(default: float, *, minimum: float = 0.0, above: bool = False) -> Any:
    """A duration field (``"100ms"``, seconds in the name's ``_s`` field)."""
    return field(default=default, metadata={"kind": "duration", "min": minimum, "above": above})


def num(default: float | None, *, minimum: float, maximum: float, above: bool = False) -> Any:
    """A number field in ``[minimum, maximum]`` (``above``: the minimum itself is out)."""
    return field(default=default, metadata={"min": minimum, "max": maximum, "above": above})


def toml_key(f: dataclasses.Field[Any]) -> str:
    """The TOML key of a dataclass field: its name without the unit suffix."""
    if "key" in f.metadata:
        return str(f.metadata["key"])
    kind = f.metadata.get("kind")
    return f.name.removesuffix(_UNIT_SUFFIX.get(kind, "")) if kind else f.name


class Reader:
    """Reads TOML data into dataclasses, raising ``error`` (a :class:`TomlError`) on bad input."""

    def __init__(self, file: Path | str | None, error: type[TomlError]) -> None:
        self.file = file
        self.error = error

    def fail(self, key: str, reason: str) -> NoReturn:
        """Raise the reader's error for ``key``."""
        raise self.error(self.file, key, reason)

    def table(self, cls: type[Any], data: Any, prefix: str) -> Any:
        """Build ``cls`` from a TOML table whose keys sit under ``prefix`` (``"control."``)."""
        if not isinstance(data, Mapping):
            self.fail(prefix.rstrip("."), f"expected a table, got {type_name(data)}")
        fields_by_key = {toml_key(f): f for f in dataclasses.fields(cls)}
        for key in data:
            if key not in fields_by_key:
                valid = ", ".join(sorted(fields_by_key))
                self.fail(prefix + key, f"unknown key; valid keys here: {valid}")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, f in fields_by_key.items():
            if key in data:
                kwargs[f.name] = self.value(hints[f.name], f, data[key], prefix + key)
            elif _required(f):
                self.fail(prefix + key, f"missing; give {_expected(hints[f.name])}")
        return cls(**kwargs)

    def tables(self, cls: type[Any], value: Any, key: str) -> tuple[Any, ...]:
        """Build one ``cls`` per table of a ``[[key]]`` array."""
        if not isinstance(value, list) or not all(isinstance(x, Mapping) for x in value):
            self.fail(key, f"expected [[{key}]] tables, got {type_name(value)}")
        return tuple(self.table(cls, item, f"{key}[{i}].") for i, item in enumerate(value))

    def value(self, hint: Any, f: dataclasses.Field[Any], value: Any, key: str) -> Any:
        """One field's value, converted to its type and checked against its range."""
        origin = typing.get_origin(hint)
        args = typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            hint = next(a for a in args if a is not type(None))
            origin, args = typing.get_origin(hint), typing.get_args(hint)
        read: Callable[[Reader, Any, str], Any] | None = f.metadata.get("read")
        if read is not None:
            return read(self, value, key)
        if dataclasses.is_dataclass(hint):
            return self.table(typing.cast(type[Any], hint), value, key + ".")
        try:
            result = _convert(hint, origin, args, f.metadata.get("kind"), value)
        except _BadValueError as exc:
            self.fail(key, f"{exc}, got {show(value)}")
        except ValueError as exc:
            self.fail(key, str(exc))
        except OverflowError:
            self.fail(key, f"too large: {show(value)}")
        if isinstance(result, float) and not math.isfinite(result):
            # TOML spells nan and inf; a long enough digit string becomes inf too. Every comparison
            # with NaN is false, so a range check alone would let it through.
            self.fail(key, f"expected a finite number, got {show(value)}")
        self._check_range(f, result, key)
        return result

    def _check_range(self, f: dataclasses.Field[Any], value: Any, key: str) -> None:
        low, high, above = f.metadata.get("min"), f.metadata.get("max"), f.metadata.get("above")
        if low is None or not isinstance(value, int | float):
            return
        too_low = value <= low if above else value < low
        if too_low or (high is not None and value > high):
            lo_s = f"> {low}" if above else f">= {low}"
            hi_s = f" and <= {high}" if high is not None else ""
            self.fail(key, f"out of range: {value!r}; expected a value {lo_s}{hi_s}")


def _convert(hint: Any, origin: Any, args: tuple[Any, ...], kind: Any, value: Any) -> Any:
    if kind == "size":
        return parse_size(value) if isinstance(value, str | int) else _bad(SIZE_HINT)
    if kind == "duration":
        return (
            parse_duration(value) if isinstance(value, str | int | float) else _bad(DURATION_HINT)
        )
    if origin is Literal:
        return value if value in args else _bad("one of " + ", ".join(repr(a) for a in args))
    if hint is bool:
        return value if isinstance(value, bool) else _bad("true or false")
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return value if ok else _bad("an integer")
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return float(value) if ok else _bad("a number")
    if hint is str:
        return value if isinstance(value, str) else _bad("a string")
    if hint is Path:
        return Path(value) if isinstance(value, str) and value else _bad("a path string")
    # A new field type without a converter is a programming error.
    raise TypeError(f"no converter for {hint!r}")  # pragma: no cover


def _required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _expected(hint: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false"}.get(
        hint, "a value"
    )


class _BadValueError(ValueError):
    pass


def _bad(expected: str) -> Any:
    raise _BadValueError(f"expected {expected}")


def type_name(value: Any) -> str:
    """How an error names a TOML value's type."""
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def show(value: Any) -> str:
    """A value as an error quotes it, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as TOML-shaped data with human units (``config check``, ``--json``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        kind = f.metadata.get("kind")
        if value is None:
            continue
        if dataclasses.is_dataclass(value):
            out[toml_key(f)] = to_dict(value)
        elif kind == "strmap":
            if value:
                out[toml_key(f)] = dict(value)
        elif isinstance(value, Mapping):
            out[toml_key(f)] = {k: to_dict(v) for k, v in value.items()}
        elif isinstance(value, tuple):
            out[toml_key(f)] = [to_dict(v) for v in value]
        elif kind == "size":
            out[toml_key(f)] = format_size(value)
        elif kind == "duration":
            out[toml_key(f)] = format_duration(value)
        elif isinstance(value, Path):
            out[toml_key(f)] = str(value)
        else:
            out[toml_key(f)] = value
    return out


def toml_value(value: Any) -> str:
    """One value in TOML's spelling."""
    if value == []:
        return "[]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
