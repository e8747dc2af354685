"""The man pages: man(1) renders them without a warning, gpushare(8) describes every command,
and gpushare.toml(5) is what the documented config generates."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from gpushare import shipped
from gpushare.cli.app import COMMANDS, app
from gpushare.paths import repo_root

needs_man = pytest.mark.skipif(shutil.which("man") is None, reason="man-db is not installed")


def _render(path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MANWIDTH": "100", "LC_ALL": "C.UTF-8"}
    return subprocess.run(
        ["man", "--warnings", "-l", str(shipped.path(path))],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


@needs_man
@pytest.mark.parametrize("page", shipped.MAN_PAGES)
def test_man_renders_the_page_without_warnings(page: str):
    done = _render(page)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "NAME" in done.stdout and "DESCRIPTION" in done.stdout


@needs_man
def test_a_broken_page_would_warn(tmp_path):
    # Guards the test above: groff's warnings do reach stderr here.
    bad = tmp_path / "bad.8"
    bad.write_text(".TH BAD 8\n.SH NAME\nbad \\- x\n.BOGUS macro\n")
    done = subprocess.run(["man", "--warnings", "-l", str(bad)], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.stderr != ""


@needs_man
def test_gpushare_8_describes_every_command():
    text = _render(shipped.MAN_PAGES[0]).stdout
    # Commands load lazily (gpushare.cli.app.COMMANDS); the eager ones are registered on app.
    names = [c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands]
    names += [n for n in COMMANDS if n != "config"] + ["config check"]
    missing = [n for n in names if not re.search(rf"^ {{7}}{re.escape(n)}\b", text, re.M)]
    assert missing == []
    assert {"drain", "undrain"} <= set(names)


def test_gpushare_toml_5_is_what_the_config_generates():
    done = subprocess.run(
        [sys.executable, str(repo_root() / "scripts" / "gen-config-manpage.py"), "--check"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = shipped.text(shipped.MAN_PAGES[1])
    assert '\\fBon_stop\\fR = "thaw"' in page
