"""The latency socket's datagram, the daemon side of :mod:`gpushare.client`'s encoders.

One JSON datagram, version 1, carries latency reports (``"s"``, seconds), a count of requests in
flight (``"n"``), or both, with the id the sender claims (``"id"``): :func:`decode_message` parses
and checks it; :mod:`gpushare.latency.receiver` decides whom to credit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# A count above this is not a number of requests one process has in flight.
MAX_INFLIGHT_COUNT = 1_000_000


@dataclass(frozen=True, slots=True)
class Message:
    """One datagram of the latency socket: latency reports and/or an in-flight count."""

    claimed_id: str
    latencies_s: tuple[float, ...]
    inflight: int | None


def decode_message(data: bytes) -> Message:
    """Parse a datagram of :func:`gpushare.client.encode_latency` or ``encode_inflight``.

    Raises:
        ValueError: not a version-1 message, or a bad value in it.
    """
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(msg, dict) or msg.get("v") != 1:
        raise ValueError("not a version 1 gpushare datagram")
    client_id = msg.get("id", "")
    if not isinstance(client_id, str):
        raise ValueError("the client id must be a string")
    if "s" not in msg and "n" not in msg:
        raise ValueError('neither latency ("s") nor requests in flight ("n")')
    values = msg.get("s", [])
    if not isinstance(values, list):
        values = [values]
    for v in values:
        ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        if not ok:
            raise ValueError(f"latency must be a finite number >= 0, got {v!r}")
    count = msg.get("n")
    if count is not None and (
        not isinstance(count, int)
        or isinstance(count, bool)
        or not 0 <= count <= MAX_INFLIGHT_COUNT
    ):
        raise ValueError(
            f"requests in flight must be an integer in [0, {MAX_INFLIGHT_COUNT}], got {count!r}"
        )
    return Message(client_id, tuple(float(v) for v in values), count)


def decode_latency(data: bytes) -> tuple[str, list[float]]:
    """Parse one datagram of :func:`gpushare.client.encode_latency` (a batch of reports).

    Raises:
        ValueError: not a version-1 latency report.
    """
    msg = decode_message(data)
    if msg.inflight is not None and not msg.latencies_s:
        raise ValueError("not a latency report (requests in flight only)")
    return msg.claimed_id, list(msg.latencies_s)
