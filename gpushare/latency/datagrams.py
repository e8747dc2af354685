"""The latency socket's datagram, the daemon side of :mod:`gpushare.client`'s encoders.

One JSON datagram, version 1, carries latency reports (``"s"``, seconds), an LLM server's times to
first token (``"t"``) and per output token (``"p"``, seconds), a count of requests in flight
(``"n"``), or several of these, with the id the sender claims (``"id"``): :func:`decode_message` parses
and checks it; :mod:`gpushare.latency.receiver` decides whom to credit.

Any local user can send anything to this socket, so parsing is bounded before JSON sees a byte:
the size (:data:`MAX_DATAGRAM_BYTES`), the nesting (:data:`MAX_NESTING`), the length of a number
(:data:`MAX_NUMBER_CHARS`) and of the id, and the count of values. Every way a datagram can be
wrong raises :class:`DatagramError` (a ``ValueError``) with a short ``reason`` to count it by; no
input makes the parser raise anything else (``tests/test_datagram_fuzz.py``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# A count above this is not a number of requests one process has in flight.
MAX_INFLIGHT_COUNT = 1_000_000
#: The client sends at most 32 values (``client.FLUSH_MAX_VALUES``, ~25 bytes each) and an id:
#: well under this. A longer datagram is refused unread.
MAX_DATAGRAM_BYTES = 4096
#: A good datagram is an object holding one list: depth 2.
MAX_NESTING = 2
#: Digits of one number, sign, point and exponent included (a float's repr needs at most 24).
MAX_NUMBER_CHARS = 32
#: Latency values in one datagram, all kinds (``"s"``, ``"t"``, ``"p"``) together.
MAX_VALUES = 256
#: The keys holding lists of seconds: request latency, time to first token, time per output token.
VALUE_KEYS = ("s", "t", "p")
#: Characters of the claimed client id.
MAX_ID_CHARS = 128


class DatagramError(ValueError):
    """A datagram that is refused; ``reason`` is a short, fixed label to count it by."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Message:
    """One datagram of the latency socket: latency reports and/or an in-flight count."""

    claimed_id: str
    latencies_s: tuple[float, ...]
    inflight: int | None
    ttft_s: tuple[float, ...] = ()
    tpot_s: tuple[float, ...] = ()


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of ``[``/``{`` outside JSON strings (for a bounded parse)."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _number(kind: type[int] | type[float]) -> Any:
    def parse(text: str) -> int | float:
        if len(text) > MAX_NUMBER_CHARS:
            raise DatagramError("number too long", f"{len(text)} characters")
        return kind(text)

    return parse


def _no_constant(name: str) -> None:
    raise DatagramError("not a finite number", name)


def _load(data: bytes) -> Any:
    if len(data) > MAX_DATAGRAM_BYTES:
        raise DatagramError("oversized", f"{len(data)} bytes, over {MAX_DATAGRAM_BYTES}")
    # Counting brackets is cheap; only a datagram with many is scanned for its real depth.
    if data.count(b"[") + data.count(b"{") > MAX_NESTING and nesting_depth(data) > MAX_NESTING:
        raise DatagramError("nested too deep", f"over {MAX_NESTING} levels")
    try:
        return json.loads(
            data,
            parse_int=_number(int),
            parse_float=_number(float),
            parse_constant=_no_constant,
        )
    except DatagramError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise DatagramError("not JSON", type(exc).__name__) from None


def _claimed_id(msg: dict[str, Any]) -> str:
    client_id = msg.get("id", "")
    if not isinstance(client_id, str):
        raise DatagramError("bad client id", "not a string")
    if len(client_id) > MAX_ID_CHARS or not client_id.isprintable():
        raise DatagramError("bad client id", "too long or not printable")
    try:
        client_id.encode("utf-8")
    except UnicodeEncodeError:
        raise DatagramError("bad client id", "a lone surrogate") from None
    return client_id


def decode_message(data: bytes) -> Message:
    """Parse a datagram of :func:`gpushare.client.encode_latency` or ``encode_inflight``.

    Raises:
        DatagramError: not a version-1 message, a bad value in it, or over a bound.
    """
    msg = _load(data)
    if not isinstance(msg, dict) or msg.get("v") != 1:
        raise DatagramError("not version 1", "not a version 1 gpushare datagram")
    client_id = _claimed_id(msg)
    if not any(key in msg for key in (*VALUE_KEYS, "n")):
        raise DatagramError("empty", 'neither latency ("s", "t", "p") nor requests in flight ("n")')
    lists = {key: _values(msg.get(key, [])) for key in VALUE_KEYS}
    total = sum(len(v) for v in lists.values())
    if total > MAX_VALUES:
        raise DatagramError("too many values", f"{total}, over {MAX_VALUES}")
    for values in lists.values():
        for v in values:
            # Bounded length, so int -> float cannot overflow; inf comes from a long exponent.
            ok = (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and math.isfinite(v)
                and v >= 0
            )
            if not ok:
                raise DatagramError("bad latency", f"must be a finite number >= 0, got {v!r}")
    count = msg.get("n")
    if count is not None and (
        not isinstance(count, int)
        or isinstance(count, bool)
        or not 0 <= count <= MAX_INFLIGHT_COUNT
    ):
        raise DatagramError(
            "bad in-flight count",
            f"requests in flight must be an integer in [0, {MAX_INFLIGHT_COUNT}], got {count!r}",
        )
    seconds = {key: tuple(float(v) for v in values) for key, values in lists.items()}
    return Message(client_id, seconds["s"], count, ttft_s=seconds["t"], tpot_s=seconds["p"])


def _values(raw: Any) -> list[Any]:
    """A value list of the message; one bare number counts as a list of one."""
    return raw if isinstance(raw, list) else [raw]


def decode_latency(data: bytes) -> tuple[str, list[float]]:
    """Parse one datagram of :func:`gpushare.client.encode_latency` (a batch of reports).

    Raises:
        ValueError: not a version-1 latency report.
    """
    msg = decode_message(data)
    if not msg.latencies_s and (msg.inflight is not None or msg.ttft_s or msg.tpot_s):
        raise ValueError("not a latency report (requests in flight only)")
    return msg.claimed_id, list(msg.latencies_s)
