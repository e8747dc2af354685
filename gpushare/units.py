"""Parsing and printing of the sizes and durations users write (``512M``, ``10G``, ``50ms``, ``2s``).

Sizes are binary, as MPS writes them: ``1G`` is 1024**3 bytes. A bare number is bytes for a size and
seconds for a duration.
"""

from __future__ import annotations

import math
import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_SIZE_FACTORS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(us|ms|s|m|h)?\s*$")
_DURATION_FACTORS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

SIZE_HINT = "a size such as 512M, 10G or a number of bytes"
DURATION_HINT = "a duration such as 50ms, 2s, 5m or a number of seconds"


def parse_size(text: str | int) -> int:
    """Return the number of bytes ``text`` names.

    Raises:
        ValueError: ``text`` is not a size; the message says what would be valid.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected {SIZE_HINT}, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"expected {SIZE_HINT}, got a negative number")
        return text
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"expected {SIZE_HINT}, got {text!r}")
    number, unit = match.groups()
    return int(float(number) * _SIZE_FACTORS[unit.upper()])


def parse_duration(text: str | float) -> float:
    """Return the number of seconds ``text`` names.

    Raises:
        ValueError: ``text`` is not a duration; the message says what would be valid.
    """
    if isinstance(text, bool):
        raise ValueError(f"expected {DURATION_HINT}, got {text!r}")
    if isinstance(text, int | float):
        if text < 0 or math.isnan(text) or math.isinf(text):
            raise ValueError(f"expected {DURATION_HINT}, got {text!r}")
        return float(text)
    match = _DURATION_RE.match(text)
    if match is None:
        raise ValueError(f"expected {DURATION_HINT}, got {text!r}")
    number, unit = match.groups()
    return float(number) * _DURATION_FACTORS[unit]


def format_size(num_bytes: int) -> str:
    """Shortest exact spelling of ``num_bytes`` (``2G``, ``1536M``, ``100``)."""
    for unit in ("T", "G", "M", "K"):
        factor = _SIZE_FACTORS[unit]
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return str(num_bytes)


def format_mps_size(num_bytes: int) -> str:
    """The ``<int>M`` or ``<int>G`` form MPS accepts, rounded down to whole MiB (never above the cap)."""
    if num_bytes % _SIZE_FACTORS["G"] == 0 and num_bytes > 0:
        return f"{num_bytes // _SIZE_FACTORS['G']}G"
    return f"{max(1, num_bytes // _SIZE_FACTORS['M'])}M"


def format_duration(seconds: float) -> str:
    """Readable spelling of ``seconds`` that :func:`parse_duration` reads back (``50ms``, ``2s``)."""
    if seconds == 0:
        return "0s"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.12g}us"
    if seconds < 1:
        return f"{seconds * 1e3:.12g}ms"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:.12g}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:.12g}m"
    return f"{seconds:.12g}s"
