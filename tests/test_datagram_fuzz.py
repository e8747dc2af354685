"""Latency datagrams from an attacker: bounded parsing, and no datagram can stop the receiver.

Any local user can write to the latency socket. On b0c0ecb ``b"[" * 60000`` (RecursionError) or
an integer of 400 digits (OverflowError in ``math.isfinite``) raised out of the receiving thread
and ended it for good: request gating and app latency stopped on the whole node. Here the parser
raises only :class:`DatagramError` for any input (hypothesis), and a real receiver on a real
socket still credits a good report after each of those datagrams.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpushare.latency import datagrams as wire
from gpushare.latency.datagrams import decode_message
from gpushare.latency.p99 import P99Tracker
from gpushare.latency.receiver import LatencyReceiver

KILLERS = [
    pytest.param(b"[" * 60000, id="deep-nesting-60000"),
    pytest.param(b"[" * 3000, id="deep-nesting-under-the-size-bound"),
    pytest.param(b'{"v":1,"id":"c1","s":[' + b"9" * 400 + b"]}", id="400-digit-latency"),
    pytest.param(b'{"v":1,"id":"c1","n":' + b"9" * 400 + b"}", id="400-digit-count"),
    pytest.param(b'{"v":1,"id":"c1","s":[1e400]}', id="float-overflow"),
    pytest.param(b'{"v":1,"id":"\\ud800","s":[0.1]}', id="lone-surrogate-id"),
    pytest.param(b'{"v":1,"id":"c1","s":[NaN]}', id="nan"),
    pytest.param(b"\xff\xfe" * 100, id="not-utf8"),
    pytest.param(b'{"v":1,"id":"c1","s":[' + b"0," * 2000 + b"0]}", id="many-values"),
]


def good(value_s: float = 0.01) -> bytes:
    return json.dumps({"v": 1, "id": "svc", "s": [value_s]}).encode()


@pytest.mark.parametrize("data", KILLERS)
def test_a_hostile_datagram_is_refused_with_a_reason(data: bytes) -> None:
    with pytest.raises(ValueError, match=".") as info:
        decode_message(data)
    assert getattr(info.value, "reason", "")  # a DatagramError, counted by its reason


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[LatencyReceiver, socket.socket]]:
    rx = LatencyReceiver(tmp_path / "lat.sock", P99Tracker(60.0, 1))
    rx.start()
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    tx.connect(str(rx.path))
    try:
        yield rx, tx
    finally:
        tx.close()
        rx.close()


def wait_accepted(rx: LatencyReceiver, n: int) -> None:
    deadline = time.monotonic() + 5.0
    while rx.accepted < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rx.accepted >= n, "a good report after the bad ones was not received"


@pytest.mark.parametrize("data", KILLERS)
def test_the_receiver_survives_each_hostile_datagram(
    live: tuple[LatencyReceiver, socket.socket], data: bytes
) -> None:
    rx, tx = live
    tx.send(data)
    tx.send(good())
    wait_accepted(rx, 1)
    assert rx.rejected == 1


def test_an_oversized_datagram_is_refused_unread(
    live: tuple[LatencyReceiver, socket.socket],
) -> None:
    rx, tx = live
    tx.send(b'{"v":1,"id":"svc","s":[0.01]}' + b" " * wire.MAX_DATAGRAM_BYTES)
    tx.send(good())
    wait_accepted(rx, 1)
    assert rx.drops == {"oversized": 1}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=20,
)


@st.composite
def datagrams(draw: st.DrawFn) -> bytes:
    """Random bytes, random JSON, and near-valid messages with hostile fields."""
    kind = draw(st.sampled_from(["bytes", "json", "message", "deep"]))
    if kind == "bytes":
        return draw(st.binary(max_size=512))
    if kind == "deep":
        opener = draw(st.sampled_from([b"[", b"{", b'{"v":1,"s":[', b'["\\"', b"[{"]))
        return opener * draw(st.integers(1, 5000))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    msg: dict[str, object] = {"v": draw(st.sampled_from([1, 1, 2, "1", None]))}
    if draw(st.booleans()):
        msg["id"] = draw(st.text(max_size=200) | st.integers() | json_values)
    if draw(st.booleans()):
        msg["s"] = draw(st.lists(st.integers() | st.floats(), max_size=40) | json_values)
    if draw(st.booleans()):
        msg["n"] = draw(st.integers() | st.floats() | json_values)
    text = json.dumps(msg)
    if draw(st.booleans()):
        text = text.replace("0", "9" * draw(st.integers(1, 600)), 1)
    return text.encode("utf-8", "surrogatepass")


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(datagrams())
def test_fuzzed_datagrams_only_ever_raise_datagram_error(data: bytes) -> None:
    reason = "accepted"
    try:
        decode_message(data)
    except ValueError as exc:
        reason = getattr(exc, "reason", "")  # a DatagramError, nothing else
    assert reason


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(datagrams())
def test_fuzzed_datagrams_never_raise_out_of_the_receiver(tmp_path_factory, data: bytes) -> None:  # type: ignore[no-untyped-def]
    rx = LatencyReceiver(
        tmp_path_factory.getbasetemp() / "unused.sock", P99Tracker(60.0, 1), on_inflight=None
    )
    rx.receive(data, [], 0)  # the per-datagram path the thread runs; raises nothing
    # Refused for a reason of its own, never because handling it failed.
    assert "internal error" not in rx.drops
