"""Option values for the CLI: plain conversions, and numbers that are finite and in range.

Typer (0.29) converts every option through a Pydantic ``TypeAdapter``: importing Pydantic and
building the adapters costs about 60 ms on every command, and a float option takes ``nan``,
``inf``, ``1e999`` (infinity) and denormals such as ``5e-324``, which then fail deep inside a
command with a traceback. :func:`install` swaps the conversion of each parameter whose type is one
of :data:`CONVERTERS` (every option gpushare has) for the ones here; any other type keeps Typer's.
A bad value is a usage error: one line, exit 2 (:mod:`gpushare.cli.app`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin

import typer
import typer.core
from typer._coercion import RuntimeParam

INT_MAX = (1 << 63) - 1
"""Integers travel to the daemon as JSON and into SQLite: 64-bit signed at most."""

_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f", ""})


def to_float(text: Any) -> float:
    """A finite, normal (or zero) float; ``nan``, infinities, overflow and denormals are refused.

    Raises:
        ValueError: the message says why, for one line on stderr.
    """
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    if value != 0.0 and abs(value) < sys.float_info.min:
        raise ValueError(f"{text!r} is too small to be meaningful (a denormal)")
    return value


def to_int(text: Any) -> int:
    """A 64-bit signed integer written in decimal.

    Raises:
        ValueError: not an integer, or out of range.
    """
    try:
        value = int(str(text).strip(), 10)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None
    if abs(value) > INT_MAX:
        raise ValueError(f"{text!r} is out of range (at most {INT_MAX})")
    return value


def to_bool(text: Any) -> bool:
    """A flag's value (click passes a bool) or one of true/false, yes/no, 1/0, on/off.

    Raises:
        ValueError: anything else.
    """
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise ValueError(f"{text!r} is not true or false")


def to_str(text: Any) -> str:
    """The text as given."""
    return str(text)


def to_path(text: Any) -> Path:
    """A path as given (commands check that it exists and say so in one line)."""
    return text if isinstance(text, Path) else Path(str(text))


CONVERTERS: dict[Any, Callable[[Any], Any]] = {
    str: to_str,
    bool: to_bool,
    int: to_int,
    float: to_float,
    Path: to_path,
}
"""The option types converted here, by annotation (``list[T]`` of these too)."""


@dataclass(frozen=True)
class PlainRuntimeParam(RuntimeParam):
    """Typer's conversion contract, met with :data:`CONVERTERS` instead of Pydantic."""

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        convert, many = _converter(self.annotation)
        assert convert is not None  # install() only uses this class for known types
        try:
            if many:
                return [convert(v) for v in value]
            return convert(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), ctx=ctx, param=param) from None


def _converter(annotation: Any) -> tuple[Callable[[Any], Any] | None, bool]:
    if get_origin(annotation) is list:
        (inner,) = get_args(annotation) or (None,)
        return CONVERTERS.get(inner), True
    return CONVERTERS.get(annotation), False


def install(param: Any) -> None:
    """Use :class:`PlainRuntimeParam` for a Typer parameter of a known type."""
    if not isinstance(param, typer.core.TyperOption | typer.core.TyperArgument):
        return
    descriptor = param.type_descriptor
    info = descriptor.parameter_info
    if (
        descriptor.file_annotation is not None
        or descriptor.is_choice
        or descriptor.is_ranged
        or info.exists
        or info.resolve_path
        or _converter(descriptor.annotation)[0] is None
    ):
        return  # Typer's own conversion knows these; gpushare has none of them today
    param._runtime_param = PlainRuntimeParam(
        parameter_info=descriptor.parameter_info, annotation=descriptor.annotation
    )
