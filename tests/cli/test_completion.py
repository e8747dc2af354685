"""Shell completion through the real shells (bash, zsh, fish) against a real daemon."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.daemon_helpers import DaemonProc

BIN = Path(__file__).resolve().parents[2] / ".venv" / "bin"


def _gpushare_dir() -> Path:
    found = shutil.which("gpushare")
    if (BIN / "gpushare").exists():
        return BIN
    if found is None:
        pytest.skip("no gpushare console script (make test installs it into .venv)")
    return Path(found).parent


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=2).start()
    try:
        d.submit_detached(["sleep", "60"], name="trainer")
        d.submit_detached(["sleep", "60"], name="batch")
        yield d
    finally:
        d.cleanup()


def _env(sock: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("_GPUSHARE")}
    env["PATH"] = f"{_gpushare_dir()}:{env.get('PATH', '/usr/bin:/bin')}"
    env["GPUSHARE_SOCKET"] = str(sock)
    return env


def _sh(argv: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _ids(d: DaemonProc) -> set[str]:
    return {c["id"] for c in d.call("list", {"all": False})["clients"]}


def test_bash_completes_commands_client_ids_and_gpus(daemon: DaemonProc) -> None:
    env = _env(daemon.socket)

    def complete(*words: str) -> list[str]:
        script = (
            "source <(gpushare completion bash)\n"
            f"COMP_WORDS=({' '.join(repr(w) for w in words)})\n"
            f"COMP_CWORD={len(words) - 1}\n"
            "_gpushare_completion gpushare\n"
            'printf "%s\\n" "${COMPREPLY[@]}"\n'
        )
        return _sh(["bash", "-c", script], env).split()

    assert complete("gpushare", "sta") == ["status"]
    assert set(complete("gpushare", "cancel", "")) == _ids(daemon)
    gpus = daemon.call("status", {})["gpus"]
    want = {str(g["index"]) for g in gpus} | {g["uuid"] for g in gpus}
    assert set(complete("gpushare", "status", "--gpu", "")) == want
    assert "any" in complete("gpushare", "submit", "--gpu", "")
    assert complete("gpushare", "submit", "--queue", "") == ["shallow", "deep", "auto"]
    assert complete("gpushare", "submit", "--queue", "sh") == ["shallow"]
    assert "pairs/bert_2_fwd+bert_8_fb1" in complete("gpushare", "sim", "pairs/bert_2_fwd+b")


def test_zsh_script_feeds_the_daemons_client_ids_to_the_completion_system(
    daemon: DaemonProc,
) -> None:
    if shutil.which("zsh") is None:
        pytest.skip("zsh is not installed (scripts/get-test-packages.sh installs it as root)")
    env = _env(daemon.socket)
    # The completion system's own functions are stood in for, so the script's plumbing (words
    # -> gpushare -> the values handed to _arguments) runs in a real, non-interactive zsh.
    script = (
        "compdef() { :; }\n"
        '_arguments() { print -rl -- "$@"; }\n'
        "source <(gpushare completion zsh)\n"
        "words=(gpushare cancel '')\n"
        "CURRENT=3\n"
        "_gpushare_completion\n"
    )
    out = _sh(["zsh", "-f", "-c", script], env)
    for cid in _ids(daemon):
        assert f'"{cid}":' in out or f"{cid}:" in out, out


def test_fish_completes_client_ids_with_their_names(daemon: DaemonProc) -> None:
    if shutil.which("fish") is None:
        pytest.skip("fish is not installed (scripts/get-test-packages.sh installs it as root)")
    env = _env(daemon.socket)
    env["HOME"] = str(daemon.base)  # fish writes its history and config under $HOME
    out = _sh(
        [
            "fish",
            "--no-config",
            "-c",
            'gpushare completion fish | source; complete -C "gpushare cancel "',
        ],
        env,
    )
    got = {line.split("\t")[0]: line for line in out.splitlines()}
    assert set(got) == _ids(daemon)
    assert any("trainer" in line for line in got.values())


def test_no_daemon_completes_nothing_quickly_and_silently(tmp_path: Path) -> None:
    env = _env(tmp_path / "absent.sock")
    env.update(_GPUSHARE_COMPLETE="complete_bash", COMP_WORDS="gpushare cancel ", COMP_CWORD="2")
    t0 = time.monotonic()
    done = subprocess.run(
        [str(_gpushare_dir() / "gpushare")], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0
    assert done.stdout.strip() == "" and done.stderr == ""
    assert time.monotonic() - t0 < 10  # generous: bounded by the connect timeout, not a hang


def test_unknown_shell_is_a_usage_error() -> None:
    done = subprocess.run(
        [str(_gpushare_dir() / "gpushare"), "completion", "tcsh"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "bash, zsh, fish" in done.stderr
