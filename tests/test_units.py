import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.units import (
    format_duration,
    format_mps_size,
    format_size,
    parse_duration,
    parse_size,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512M", 512 << 20),
        ("10G", 10 << 30),
        ("1.5G", 1536 << 20),
        ("4K", 4096),
        ("2GiB", 2 << 30),
        ("100", 100),
        (2048, 2048),
        ("1t", 1 << 40),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "G", "-1G", "10X", "ten", True, -5, "1.2.3M"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="size such as"):
        parse_size(bad)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("50ms", 0.05), ("2s", 2.0), ("5m", 300.0), ("1h", 3600.0), ("250us", 250e-6), (3, 3.0)],
)
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("bad", ["", "ms", "-2s", "2 days", False, float("nan"), -1])
def test_parse_duration_rejects(bad):
    with pytest.raises(ValueError, match="duration such as"):
        parse_duration(bad)


@given(st.integers(min_value=0, max_value=1 << 50))
def test_size_round_trip(n):
    assert parse_size(format_size(n)) == n


@given(st.integers(min_value=0, max_value=10**7))
def test_duration_round_trip(ms):
    seconds = ms / 1000
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)


def test_mps_size_never_exceeds_request():
    assert format_mps_size(8 << 30) == "8G"
    assert format_mps_size(1536 << 20) == "1536M"
    assert parse_size(format_mps_size((3 << 20) + 5)) <= (3 << 20) + 5
