"""Protocol framing and parameter checking (the daemon-level behaviour is in test_daemon_*.py)."""

from __future__ import annotations

import socket

import pytest

from gpushare import protocol as P


def test_decode_request_roundtrip() -> None:
    line = P.encode({"id": 7, "method": "status", "params": {"gpu": "0"}}).rstrip(b"\n")
    assert P.decode_request(line) == (7, "status", {"gpu": "0"})


@pytest.mark.parametrize(
    ("line", "code"),
    [
        (b"{not json", P.ErrorCode.PARSE_ERROR),
        (b"\xff\xfe", P.ErrorCode.PARSE_ERROR),
        (b"[1, 2]", P.ErrorCode.BAD_REQUEST),
        (b'{"id": 1}', P.ErrorCode.BAD_REQUEST),
        (b'{"method": 5}', P.ErrorCode.BAD_REQUEST),
        (b'{"method": "status", "params": []}', P.ErrorCode.BAD_REQUEST),
        (b'{"id": [1], "method": "status"}', P.ErrorCode.BAD_REQUEST),
    ],
)
def test_decode_request_rejects(line: bytes, code: P.ErrorCode) -> None:
    with pytest.raises(P.ProtocolError) as info:
        P.decode_request(line)
    assert info.value.code is code


def test_from_params_checks_types() -> None:
    req = P.from_params(P.SubmitRequest, {"cls": "offline", "argv": ["a", "b"], "sm_pct": 30})
    assert req.sm_pct == 30.0
    assert isinstance(req.sm_pct, float)
    assert req.argv == ["a", "b"]
    for bad in (
        {"cls": "offline", "argv": "echo hi"},
        {"cls": "offline", "argv": ["a", 1]},
        {"cls": "offline", "argv": ["a"], "detach": "yes"},
        {"cls": "offline", "argv": ["a"], "mem_bytes": 1.5},
        {"cls": "offline", "argv": ["a"], "env": {"A": 1}},
        {"cls": "offline", "argv": ["a"], "bogus": 1},
        {"argv": ["a"]},
    ):
        with pytest.raises(P.ProtocolError) as info:
            P.from_params(P.SubmitRequest, bad)
        assert info.value.code is P.ErrorCode.INVALID_PARAMS


def test_error_codes_map_to_exit_codes() -> None:
    assert P.ErrorCode.INVALID_PARAMS.exit_code() == 2
    assert P.ErrorCode.NOT_FOUND.exit_code() == 2
    assert P.ErrorCode.PERMISSION_DENIED.exit_code() == 4
    assert P.ErrorCode.NO_CAPACITY.exit_code() == 5
    assert P.EXIT_UNREACHABLE == 3


def test_line_reader_splits_and_bounds() -> None:
    a, b = socket.socketpair()
    with a, b:
        reader = P.LineReader(a, max_bytes=16)
        b.sendall(b'{"x":1}\n{"y":2}\n')
        assert reader.read_line() == b'{"x":1}'
        assert reader.read_line() == b'{"y":2}'
        b.sendall(b"x" * 40 + b"\n")
        with pytest.raises(P.ProtocolError) as info:
            reader.read_line()
        assert info.value.code is P.ErrorCode.TOO_LARGE
        b.close()
        reader2 = P.LineReader(a, max_bytes=1 << 20)
        assert reader2.read_line() is None
