"""The CLI's surface through its real entry point: -h, help text, exit codes, one-line errors.

Each command runs as a subprocess (``python -m gpushare``), as a user runs it; the ones that need
another user run as ``nobody`` through a Python that account can execute.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.support.daemon_helpers import python_for_others, site_for_others
from gpushare import protocol
from gpushare.cli.app import COMMANDS
from gpushare.cli.exitcodes import EXIT_CODES
from gpushare.paths import repo_root

REPO = repo_root()
NOBODY = 65534


def _cli(
    *args: str, env: dict[str, str] | None = None, **kw: object
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args], cwd=REPO, capture_output=True, text=True,
        timeout=60, check=False, env={**os.environ, **(env or {})}, **kw,  # type: ignore[call-overload]
    )  # fmt: skip


def _as_nobody(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    python = python_for_others()
    if python is None:
        pytest.skip("no Python interpreter that the nobody account may execute")
    # The same minor version as ours, so this environment's packages import there too; copied
    # where nobody can read them (the clone may be in a 0700 directory).
    site = site_for_others()
    return subprocess.run(
        [python, "-m", "gpushare", *args], cwd="/", capture_output=True, text=True, timeout=60,
        check=False, user=NOBODY, group=NOBODY, extra_groups=[],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), **(env or {})},
    )  # fmt: skip


def test_dash_h_is_help_for_the_root_and_every_command() -> None:
    root = _cli("-h")
    assert root.returncode == 0, root.stderr
    for name in COMMANDS:
        r = _cli(name, "-h")
        assert r.returncode == 0, (name, r.stderr)
        assert r.stdout.startswith(f"Usage: gpushare {name}"), (name, r.stdout[:200])


def test_help_has_no_type_placeholders_and_every_summary_is_whole() -> None:
    for name in ["", *COMMANDS]:
        out = _cli(*([name] if name else []), "--help").stdout
        assert not re.search(r"<(str|bool|int|float|path|list\[[a-z]+\])>", out, re.I), (name, out)
        assert "{" not in out.split("\n", 1)[0], out  # usage line: CMD..., not {cmd}...
    root = _cli("--help").stdout
    for name, (_, summary) in COMMANDS.items():
        # The summary shown without importing the module is the command's own first line.
        first = _cli(name, "--help").stdout.split("\n\n", 2)[1].strip()
        assert " ".join(first.split()) == summary, name
        assert name in root


def test_every_exit_code_is_in_the_help_epilog_and_the_readme() -> None:
    root = _cli("--help").stdout
    readme = (REPO / "README.md").read_text()
    for code, meaning in EXIT_CODES.items():
        assert re.search(rf"^\s+{code}\s+{re.escape(meaning)}$", root, re.M), code
        assert f"| {code} | {meaning} |" in readme, code


_PROBE = """
import sys, runpy
sys.argv = ['gpushare'] + sys.argv[1:]
try:
    runpy.run_module('gpushare', run_name='__main__')
except SystemExit:
    pass
heavy = ('pydantic', 'structlog', 'rich', 'gpushare.sim', 'gpushare.daemon', 'gpushare.cli.sim_run',
         'gpushare.cli.clients_cmd', 'gpushare.cli.doctor_cmd', 'gpushare.cli.env_cmd')
print(sorted(m for m in heavy if m in sys.modules), file=sys.stderr)
"""


def _loaded(*args: str) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=REPO, capture_output=True,
                       text=True, timeout=60, check=False)  # fmt: skip
    return list(json.loads(r.stderr.strip().splitlines()[-1].replace("'", '"')))


def test_help_imports_no_command_module_and_no_pydantic() -> None:
    # What a start costs is mostly imports: `gpushare -h` loads no command module, and a
    # command's -h loads its own module only: not Pydantic (Typer's converters), structlog, the
    # simulator or the daemon.
    assert _loaded("-h") == []
    assert _loaded("list", "-h") == ["gpushare.cli.clients_cmd"]
    assert _loaded("doctor", "-h") == ["gpushare.cli.doctor_cmd"]
    assert _loaded("env", "-h") == ["gpushare.cli.env_cmd"]
    assert _loaded("sim", "-h") == []
    assert _loaded("daemon", "-h") == []


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "5e-324", "lots"])
def test_numeric_options_refuse_nan_infinity_and_denormals_in_one_line(value: str) -> None:
    r = _cli("submit", "--offline", "--detach", "--sm", value, "--socket", "/nonexistent", "--",
             "true")  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"'{value}'" in r.stderr and "--sm" in r.stderr


def test_integer_options_are_bounded() -> None:
    r = _cli("events", "--since", str(1 << 70), "--socket", "/nonexistent")
    assert r.returncode == 2 and "out of range" in r.stderr and "Traceback" not in r.stderr


def test_a_socket_this_user_may_not_open_is_one_line_naming_the_fix(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    path = tmp_path / "gpushare.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        server.listen(1)
        path.chmod(0o600)
        for args in (["status"], ["list"], ["status", "--json"], ["events"]):
            r = _as_nobody(*args, "--socket", str(path))
            assert r.returncode == 4, (args, r.stderr)
            assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
            assert "socket_mode" in r.stderr and str(path) in r.stderr
    finally:
        server.close()


def test_an_unreadable_config_is_one_line(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    cfg = tmp_path / "gpushare.toml"
    cfg.write_text("version = 1\n")
    cfg.chmod(0o600)
    for args in (
        ["config", "check", str(cfg)],
        ["daemon", "--config", str(cfg)],
        ["env", "--offline", "--gpu", "0", "--config", str(cfg)],
    ):
        r = _as_nobody(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Permission denied" in lines[0], (args, r.stderr)


def _answering_server(path: Path) -> socket.socket:
    """A socket that answers every request with a minimal result (hello's and status's)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn, conn.makefile("rwb") as f:
                for line in f:
                    req = json.loads(line)
                    result = {"api_version": protocol.API_VERSION, "gpus": [], "clients": []}
                    f.write(protocol.encode({"id": req["id"], "result": result}))
                    f.flush()

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    # `gpushare ... | head -1` once head has gone: every write fails with EPIPE.
    path = tmp_path / "fake.sock"
    server = _answering_server(path)
    r_fd, w_fd = os.pipe()
    os.close(r_fd)
    try:
        for args in (["-h"], ["list", "-h"], ["status", "--json"], ["list", "--json"]):
            r = subprocess.run(
                [sys.executable, "-m", "gpushare", *args, *(["--socket", str(path)] if "-h" not in args else [])],
                cwd=REPO, stdout=w_fd, stderr=subprocess.PIPE, text=True, timeout=60,
                check=False,
            )  # fmt: skip
            assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, (args, r.stderr)
            assert r.returncode in (1, 141), (args, r.returncode)
    finally:
        os.close(w_fd)
        server.close()


def test_usage_errors_are_one_line_with_where_to_look() -> None:
    r = _cli("frobnicate")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "gpushare: No such command 'frobnicate'. (see 'gpushare -h')"
    ]
