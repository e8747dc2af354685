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


_EMIT = """
import structlog
from gpushare.logs import configure_logging
configure_logging("debug")
log = structlog.get_logger()
log.debug("d"); log.info("i"); log.warning("w"); log.error("e"); log.critical("c")
"""


def _emit_with(tmp_path, journal_stream):
    """Run a process whose stderr is a file, with $JOURNAL_STREAM as systemd would set it."""
    import os
    import subprocess
    import sys

    err = tmp_path / "stderr"
    with err.open("wb") as f:
        st = os.fstat(f.fileno())
        value = journal_stream(st)
        env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
        if value is not None:
            env["JOURNAL_STREAM"] = value
        subprocess.run([sys.executable, "-c", _EMIT], stderr=f, env=env, check=True, timeout=60)
    return err.read_text().splitlines()


def test_under_the_journal_each_line_carries_its_syslog_priority(tmp_path):
    # journald stores a stderr line at the priority of its "<N>" prefix (sd-daemon(3)): without
    # one, every line is "info" and `journalctl -p warning` shows nothing (issue 28.3).
    lines = _emit_with(tmp_path, lambda st: f"{st.st_dev}:{st.st_ino}")
    got = [(line[: line.index(">") + 1], json.loads(line[line.index(">") + 1 :])["event"])
           for line in lines]  # fmt: skip
    assert got == [("<7>", "d"), ("<6>", "i"), ("<4>", "w"), ("<3>", "e"), ("<2>", "c")]


def test_stderr_that_is_not_the_journal_stream_gets_plain_json(tmp_path):
    # The variable is inherited by a process that redirected its stderr: the fd decides.
    lines = _emit_with(tmp_path, lambda st: f"{st.st_dev}:{st.st_ino + 1}")
    assert [json.loads(line)["event"] for line in lines] == ["d", "i", "w", "e", "c"]
    lines = _emit_with(tmp_path, lambda st: None)
    assert [json.loads(line)["event"] for line in lines] == ["d", "i", "w", "e", "c"]
