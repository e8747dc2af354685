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


def _handler_that_fails(env):
    secret = env["SECRET"]
    raise RuntimeError(f"failed after reading {len(secret)} characters")


@pytest.mark.parametrize("as_json", [True, False])
def test_tracebacks_show_no_local_variables(capsys, as_json):
    """A handler's locals hold what a user submitted (its environment, with passwords)."""
    configure_logging("info", json=as_json)
    secret = "-".join(["xyz", "do", "not", "log"])  # made at run time: not in any source line
    try:
        _handler_that_fails({"SECRET": secret})
    except RuntimeError:
        structlog.get_logger().exception("api_handler_failed")
    err = capsys.readouterr().err
    assert "_handler_that_fails" in err  # the traceback is there...
    assert secret not in err  # ...without the frames' variables
