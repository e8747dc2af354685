"""User names and group membership (gpushare.node.procs.users), read from this machine's files."""

from __future__ import annotations

import grp
import os
import pwd

import pytest

from gpushare.node.procs.users import user_groups, user_in_group, user_name


def test_user_name_and_groups() -> None:
    root = pwd.getpwuid(0)
    assert user_name(0) == root.pw_name
    unused = max(e.pw_uid for e in pwd.getpwall()) + 12345
    assert user_name(unused) == str(unused)
    primary = grp.getgrgid(root.pw_gid).gr_name
    assert user_in_group(0, primary)
    assert not user_in_group(0, "no-such-group-xyz")
    assert not user_in_group(unused, primary)
    assert user_groups(unused, 4242) == [4242]
    assert user_groups(0, root.pw_gid)[0] == root.pw_gid


def test_user_in_group_supplementary_only() -> None:
    # Find a real (user, group) pair where the group is supplementary, from this machine's files.
    for group in grp.getgrall():
        for member in group.gr_mem:
            try:
                entry = pwd.getpwnam(member)
            except KeyError:
                continue
            if entry.pw_gid != group.gr_gid:
                assert user_in_group(entry.pw_uid, group.gr_name)
                others = [
                    g.gr_name
                    for g in grp.getgrall()
                    if g.gr_gid not in os.getgrouplist(member, entry.pw_gid)
                ]
                if others:
                    assert not user_in_group(entry.pw_uid, others[0])
                return
    pytest.skip("no user on this machine has a supplementary group listed in /etc/group")
