"""Users and groups: the login name of a uid, its login groups, and group membership."""

from __future__ import annotations

import grp
import os
import pwd


def user_name(uid: int) -> str:
    """The login name of ``uid``, or the number as text when it has no passwd entry."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def user_groups(uid: int, gid: int) -> list[int]:
    """The groups ``uid`` gets at login (primary ``gid`` first); just ``[gid]`` without an entry."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return [gid]
    groups = os.getgrouplist(name, gid)
    return [gid, *sorted(set(groups) - {gid})]


def user_in_group(uid: int, group_name: str) -> bool:
    """Whether ``uid`` belongs to ``group_name``, as primary or supplementary group.

    An unknown group or a uid without a passwd entry is not a member.
    """
    try:
        group = grp.getgrnam(group_name)
        entry = pwd.getpwuid(uid)
    except KeyError:
        return False
    if entry.pw_gid == group.gr_gid or entry.pw_name in group.gr_mem:
        return True
    # getgrouplist also asks NSS sources that do not list members in the group entry.
    return group.gr_gid in os.getgrouplist(entry.pw_name, entry.pw_gid)
