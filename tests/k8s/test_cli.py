"""``gpushare k8s device-plugin``: bad input gets one clear line and exit 2, before anything starts."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from gpushare.cli.app import app


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kubelet-dir", "/nonexistent-dir"], "/nonexistent-dir is not a directory"),
        (["--poll", "1h"], "--poll must be within 100ms and 5m"),
        (["--poll", "soon"], "soon"),
        (["--online-slo-p99", "-5ms"], "gpushare k8s device-plugin: "),
        (["--resource-prefix", "Bad_Prefix"], "--resource-prefix must be a DNS name"),
        (["--resource-prefix", "nodots"], "--resource-prefix must be a DNS name"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args: list[str], message: str) -> None:
    res = CliRunner().invoke(app, ["k8s", "device-plugin", "--kubelet-dir", str(tmp_path), *args])
    assert res.exit_code == 2
    assert message in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert "Traceback" not in res.output
