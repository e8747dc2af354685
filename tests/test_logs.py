"""Logging set-up: JSON off a TTY, console on one, level filtering, bad levels rejected."""

import json

import pytest
import structlog

from gpushare.logs import configure_logging


def test_json_output_with_stable_event_name(capsys):
    configure_logging("info", json=True)
    structlog.get_logger().info("client_admitted", client_id="c1", gpu="GPU-x")
    line = capsys.readouterr().err.strip()
    record = json.loads(line)
    assert record["event"] == "client_admitted"
    assert record["client_id"] == "c1"
    assert record["level"] == "info"
    assert record["timestamp"].endswith("Z")


def test_level_filters(capsys):
    configure_logging("warning", json=True)
    log = structlog.get_logger()
    log.info("quiet")
    log.warning("loud")
    lines = capsys.readouterr().err.strip().splitlines()
    assert [json.loads(x)["event"] for x in lines] == ["loud"]


def test_console_renderer(capsys):
    configure_logging("debug", json=False)
    structlog.get_logger().debug("tick", gpu=0)
    err = capsys.readouterr().err
    assert "tick" in err
    assert "gpu=0" in err
    with pytest.raises(json.JSONDecodeError):
        json.loads(err)


def test_default_is_json_when_not_a_tty(capsys):
    configure_logging("info")
    structlog.get_logger().info("x")
    assert json.loads(capsys.readouterr().err)["event"] == "x"


def test_bad_level():
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure_logging("loud")


def test_exceptions_are_structured(capsys):
    configure_logging("info", json=True)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        structlog.get_logger().exception("tick_failed")
    record = json.loads(capsys.readouterr().err)
    assert record["exception"][0]["exc_type"] == "RuntimeError"
