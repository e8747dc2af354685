"""The test accounts harness: real, distinct, unprivileged accounts, and nothing left behind."""

from __future__ import annotations

import pwd
import subprocess

from bench.support.accounts import MARK, Account, create, remove, remove_stale, run_as


def test_accounts_are_distinct_unprivileged_users(
    accounts: tuple[Account, Account, Account],
) -> None:
    uids = {a.uid for a in accounts}
    assert len(uids) == 3 and 0 not in uids
    for account in accounts:
        out = run_as(account, ["id", "-u"], check=True)
        assert int(out.stdout) == account.uid
        # no supplementary groups: an account is nobody's admin
        groups = run_as(account, ["id", "-G"], check=True).stdout.split()
        assert groups == [str(account.gid)]


def test_stale_accounts_of_a_dead_run_are_removed(
    accounts: tuple[Account, Account, Account],
) -> None:
    (made,) = create("z")
    try:
        # Pretend a killed run made it: a pid that cannot exist.
        subprocess.run(["usermod", "--comment", f"{MARK}{2**22 + 1}", made.name], check=True)
        # a process of the account must not survive its removal
        proc = subprocess.Popen(["sleep", "30"], user=made.uid, group=made.gid, extra_groups=[])
        remove_stale()
        assert made.name not in {e.pw_name for e in pwd.getpwall()}
        assert proc.wait(timeout=5) != 0
        # this run's own accounts stay
        assert all(pwd.getpwnam(a.name).pw_uid == a.uid for a in accounts)
    finally:
        remove(made.name)
