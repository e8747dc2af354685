"""Client ids unique for the life of the host: a high-water mark kept beside the database.

A client's id names its cgroup and its log file, and every API request that acts on a client
names it by id. Ids ``c<N>`` come from the database's sequence, which starts again at 1 when the
database is moved aside (damaged) or removed; a new ``c1`` would then be given the cgroup, log
and permissions of an old one whose processes may still run. So the highest number ever handed
out (rounded up to a block, to write the file rarely) is also kept in a small file in the state
directory, written atomically and fsynced before a number past it is committed, and a database
that starts anew continues after it. The file also counts the databases started over its life
(the epoch), so an event can say which registry a record came from.

The file is never moved aside with the database. Where it is lost too, the caller passes the
highest number still visible on the host (client log names, client cgroups) as a floor.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpushare.daemon.registry.records import RegistryError
from gpushare.daemon.registry.store import transient

log = structlog.get_logger(__name__)

MARK_NAME = "client-ids"
BLOCK = 64
"""Numbers reserved per write of the mark: the file is written once per this many clients."""

_LINE = re.compile(r"gpushare client ids: epoch (\d+) reserved (\d+)\n")
_ID = re.compile(r"c(\d+)")


@dataclass(frozen=True, slots=True)
class Mark:
    """What the mark file holds: the registry epoch and the highest number reserved."""

    epoch: int
    reserved: int


def number_of(name: str) -> int | None:
    """The number of an id ``c<N>`` (also as in ``c<N>.log``, ``client-c<N>``), else ``None``."""
    found = _ID.fullmatch(name)
    return int(found.group(1)) if found is not None else None


def highest_number(names: list[str]) -> int:
    """The highest id number among names of ids (0 when none is one)."""
    return max((n for n in map(number_of, names) if n is not None), default=0)


def read(state_dir: Path) -> Mark | None:
    """The mark, or ``None`` when the file does not exist.

    Raises:
        RegistryError: the file exists but cannot be read or is not a mark (it is not replaced:
            a guess could hand out an id that is still in use).
    """
    path = state_dir / MARK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RegistryError(f"cannot read the client id mark {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        data = f.read(4096)
    found = _LINE.fullmatch(data.decode("ascii", "replace"))
    if found is None:
        raise RegistryError(
            f"the client id mark {path} is not one gpushare wrote; fix it by hand (it must "
            "name a number above every client id used on this host)"
        )
    return Mark(int(found.group(1)), int(found.group(2)))


def write(state_dir: Path, mark: Mark) -> None:
    """Replace the mark atomically and durably (the new file, then the directory, fsynced).

    Raises:
        OSError: it could not be written (full disk, read-only); the old mark stays.
    """
    path = state_dir / MARK_NAME
    tmp = state_dir / f".{MARK_NAME}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    data = f"gpushare client ids: epoch {mark.epoch} reserved {mark.reserved}\n".encode()
    try:
        written = os.write(fd, data)
        if written == len(data):
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    if written != len(data):
        tmp.unlink()
        raise OSError(errno.ENOSPC, f"short write to {tmp}")
    os.replace(tmp, path)
    dir_fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class IdMark:
    """The mark of one state directory, as the registry uses it (see the module docstring)."""

    def __init__(self, state_dir: Path, mark: Mark) -> None:
        self.state_dir = state_dir
        self.epoch = mark.epoch
        self.reserved = mark.reserved
        #: The number every id of this registry's database must be above (set at open).
        self.floor = mark.reserved

    def cover(self, number: int) -> None:
        """Make sure ``number`` is reserved in the file before it is committed as an id.

        Raises:
            OSError: the file could not be written (the id must then not be used).
        """
        if number <= self.reserved:
            return
        mark = Mark(self.epoch, number + BLOCK - 1)
        write(self.state_dir, mark)
        self.reserved = mark.reserved


def for_database(
    conn: sqlite3.Connection, state_dir: Path, mark: Mark | None, id_floor: int
) -> IdMark:
    """The id mark for this database: numbers continue above every one used on the host."""
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'clients'").fetchone()
    db_seq = int(row[0]) if row is not None else 0
    fresh = db_seq == 0
    if mark is None:
        epoch = 1
        reserved = max(db_seq, id_floor)
    else:
        # A database that starts with no client while the mark exists is a new one: the registry
        # was reset (moved aside, removed); its epoch counts up.
        epoch = mark.epoch + 1 if fresh and mark.reserved > 0 else mark.epoch
        reserved = max(db_seq, id_floor, mark.reserved)
    id_mark = IdMark(state_dir, Mark(epoch, reserved))
    if mark is None or epoch != mark.epoch or reserved != mark.reserved:
        try:
            write(state_dir, Mark(epoch, reserved))
        except OSError as exc:
            # What the file holds is all that is reserved: the first new id writes it again.
            id_mark.reserved = mark.reserved if mark is not None else 0
            log.warning("client_id_mark_unwritten", dir=str(state_dir), error=str(exc))
    if db_seq < reserved:
        # Also written before the first new client (Registry._keep_above_floor) if this fails.
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("DELETE FROM sqlite_sequence WHERE name = 'clients'")
            conn.execute(
                "INSERT INTO sqlite_sequence (name, seq) VALUES ('clients', ?)", (reserved,)
            )
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if not transient(exc):
                raise
    return id_mark
