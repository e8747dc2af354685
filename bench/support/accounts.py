"""Unprivileged test accounts that the harness creates and removes (the abuse suite's attackers).

Every local user of a shared host is a possible attacker, so the security tests act from real
second and third accounts, not from ``nobody`` alone: two accounts that are not each other and
not root show whether one user can reach another's clients. The accounts are system users with
no home and no login shell, named ``gpst<pid><letter>`` so that test runs in parallel (several
worktrees on one machine) never share one, and marked in the GECOS field with the creating
pid; an account left behind by a run that was killed is removed by the next run once that pid is
gone. Every process of an account is killed before the account is removed.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

MARK = "gpushare test account pid="
"""GECOS prefix of every account this module makes; the pid that made it follows."""


@dataclass(frozen=True)
class Account:
    """One unprivileged account made for a test run."""

    name: str
    uid: int
    gid: int


def skip_reason() -> str | None:
    """Why accounts cannot be made here (not root, no useradd), or None."""
    if os.geteuid() != 0:
        return "needs root to create test accounts (CI runs as root)"
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        return "useradd/userdel not found: apt-get install passwd"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_all(uid: int) -> None:
    # A uid's processes, found through /proc: pkill is not on every image.
    for _ in range(50):
        found = False
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != uid:
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
                found = True
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
        if not found:
            return
        time.sleep(0.02)


def remove(name: str) -> None:
    """Kill every process of account ``name`` and delete it (and its group); absent is fine."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    _kill_all(uid)
    subprocess.run(["userdel", "-f", name], capture_output=True, check=False, timeout=30)


def remove_stale() -> None:
    """Remove accounts left by earlier runs whose creating process is gone."""
    for entry in pwd.getpwall():
        if not entry.pw_gecos.startswith(MARK):
            continue
        try:
            owner = int(entry.pw_gecos[len(MARK) :])
        except ValueError:
            continue
        if not _pid_alive(owner):
            remove(entry.pw_name)


def create(letters: Sequence[str]) -> list[Account]:
    """Create one account per letter, named ``gpst<pid><letter>``, each in its own group."""
    made: list[Account] = []
    try:
        for letter in letters:
            name = f"gpst{os.getpid()}{letter}"
            remove(name)
            subprocess.run(
                ["useradd", "--system", "--no-create-home", "--user-group",
                 "--shell", "/usr/sbin/nologin", "--comment", f"{MARK}{os.getpid()}", name],
                capture_output=True, text=True, check=True, timeout=30,
            )  # fmt: skip
            entry = pwd.getpwnam(name)
            made.append(Account(name, entry.pw_uid, entry.pw_gid))
    except BaseException:
        for account in made:
            remove(account.name)
        raise
    return made


@pytest.fixture(scope="session")
def accounts() -> Iterator[tuple[Account, Account, Account]]:
    """Three unprivileged accounts for the whole session, removed at its end; skip without root."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    remove_stale()
    a, b, c = create("abc")
    try:
        yield a, b, c
    finally:
        for account in (a, b, c):
            remove(account.name)


def run_as(
    account: Account, argv: Sequence[str], *, timeout_s: float = 30, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``account`` (no supplementary groups, cwd /), capturing text output."""
    return subprocess.run(
        list(argv),
        cwd="/",
        user=account.uid,
        group=account.gid,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=check,
    )


__all__ = ["Account", "accounts", "create", "remove", "remove_stale", "run_as", "skip_reason"]
