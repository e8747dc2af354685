"""Parsers of gpushare.node.mps on recorded output (R535 observed, documented formats, docs/sources.md).

Samples marked "R535" were recorded from nvidia-cuda-mps-control 535.261.03 on this machine; the
``ps``/``lspart`` tables are the documented formats of the MPS docs' tools reference (docs/sources.md).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.model import MpsEventKind
from gpushare.node import mps
from gpushare.node.mps import (
    DaemonNotReachable,
    DaemonShuttingDown,
    InsufficientPrivileges,
    InvalidValue,
    MpsError,
    MpsParseError,
    ServerNotFound,
    ServerStatus,
    UnknownCommand,
)

GPU = "GPU-74d43ed3-1234-5678-9abc-bf5b4f46ed65"
GIB = 1 << 30
MIB = 1 << 20

# R535: stdout of `terminate_client 12345 1` with no such server.
TERMINATE_MISSING = "Server 12345 not found\nServer 12345 not found!\n1\n"
# R535: `ps -p 12345`.
PS_P_MISSING = "Server 12345 not found\nServer 12345 not found\n\n"
# Documented ps (R5xx doc example), and the fixed-width layout of the binary's format string.
PS_DOC = "PID ID SERVER DEVICE NAMESPACE COMMAND\n9741 0 6472 GPU-cb1213a3-d6a4-be7f 4026531836 ./nbody\n"
PS_FIXED = (
    f"{'PID':<10}{'ID':<10}{'SERVER':<15}{'DEVICE':<24}{'NAMESPACE':<15}{'COMMAND':<15}\n"
    f"{9741:<10}{0:<10}{6472:<15}{'GPU-cb1213a3-d6a4-be7f':<24}{'4026531836':<15}"
    "python train.py --epochs 3\n"
    f"{9800:<10}{1:<10}{6472:<15}{'GPU-cb1213a3-d6a4-be7f':<24}{'4026531836':<15}{'./nbody':<15}\n"
)
PS_8COL = (
    "PID       ID        SERVER         DEVICE         NAMESPACE      COMMAND        STATUS\n"
    "9741      0         6472           GPU-cb1213a3   4026531836     python  serve.py  ACTIVE\n"
)
LSPART_DOC = (
    "GPU Partition free used free used clients\n"
    "chunk chunk SM SM\n"
    "GPU-74d43ed3 - 3 7 24 56 -\n"
    "GPU-74d43ed3 Dx4AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA - 7 - 56 -\n"
)
# R535 -f output of `start_server -uid 0` without a GPU.
LOG_START_SERVER = (
    "[2026-11-22 02:05:44.700 Control  7443] Cmd:start_server -uid 0\n"
    "[2026-11-22 02:05:44.700 Control  7443] Starting new server 7599 for user 0\n"
    "[2026-11-22 02:05:44.702 Control  7443] Server 7599 exited with status 1\n"
    "[2026-11-22 02:05:44.702 Control  7443] Removed Shm file at \n"
)


# Errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "cls"),
    [
        ('Unknown command "bogus_cmd"\n', UnknownCommand),
        ('Unknown command "get_server_status"\n', UnknownCommand),
        ("Server 12345 not found\n", ServerNotFound),
        (TERMINATE_MISSING, ServerNotFound),
        ("Server not found\n", ServerNotFound),
        ("A user id (UID) is required to start a new server\n", InvalidValue),
        ("A server PID is required\n", InvalidValue),
        ("Invalid priority value - must be 0 or 1!\n", InvalidValue),
        ("Invalid device ordinal!\n", InvalidValue),
        ("Invalid process 77!\n", InvalidValue),
        (
            "Insufficient privileges for UID 1000. Only the root user may start server for another user.\n",
            InsufficientPrivileges,
        ),
        ("Not enough privilege to execute quit command\n", InsufficientPrivileges),
        ("Cannot find MPS control daemon process\n", DaemonNotReachable),
        ("Cannot authenticate or connect to MPS control daemon process\n", DaemonNotReachable),
        ("Cannot send command to MPS control daemon process\n", DaemonNotReachable),
        ("The MPS control daemon is shutting down\n", DaemonShuttingDown),
    ],
)
def test_error_strings_are_typed(output: str, cls: type[MpsError]) -> None:
    err = mps.parse_error(output, "cmd")
    assert type(err) is cls
    assert err.command == "cmd"


def test_server_not_found_keeps_pid() -> None:
    err = mps.parse_error(TERMINATE_MISSING)
    assert isinstance(err, ServerNotFound)
    assert err.server_pid == 12345
    bare = mps.parse_error("Server not found\n")
    assert isinstance(bare, ServerNotFound)
    assert bare.server_pid is None
    assert isinstance(mps.parse_error(PS_P_MISSING), ServerNotFound)


@pytest.mark.parametrize("output", ["", "100.0\n", "2G\n", "0\n", "1234 5678\n", PS_DOC])
def test_normal_replies_are_not_errors(output: str) -> None:
    assert mps.parse_error(output) is None


# Values -----------------------------------------------------------------------------------


def test_pid_lists() -> None:
    assert mps.parse_pid_list("") == ()
    assert mps.parse_pid_list("30112 30119 30204\n") == (30112, 30119, 30204)
    assert mps.parse_pid_list("30112\n30119\n") == (30112, 30119)
    with pytest.raises(MpsParseError):
        mps.parse_pid_list("30112 abc")
    with pytest.raises(MpsParseError):
        mps.parse_pid_list("0")


def test_percentages() -> None:
    assert mps.parse_pct("100.0\n") == 100.0
    assert mps.parse_pct(" 33.3 ") == 33.3
    for bad in ("", "abc", "40.0 50.0", "101.0", "-1.0"):
        with pytest.raises(MpsParseError):
            mps.parse_pct(bad)


def test_sizes() -> None:
    assert mps.parse_mps_size("") is None
    assert mps.parse_mps_size("2G\n") == 2 * GIB
    assert mps.parse_mps_size("512M") == 512 * MIB
    for bad in ("2GB", "1.5G", "G", "512", "2G 3G"):
        with pytest.raises(MpsParseError):
            mps.parse_mps_size(bad)


def test_priority_status_terminate() -> None:
    assert mps.parse_priority("0\n") == 0
    assert mps.parse_priority("1") == 1
    with pytest.raises(MpsParseError):
        mps.parse_priority("2")
    assert mps.parse_server_status("ACTIVE\n") is ServerStatus.ACTIVE
    assert mps.parse_server_status("FAULT") is ServerStatus.FAULT
    with pytest.raises(MpsParseError):
        mps.parse_server_status("BROKEN")
    assert mps.parse_terminate_status("0\n") == 0
    assert mps.parse_terminate_status(TERMINATE_MISSING) == 1


# Tables -----------------------------------------------------------------------------------


def test_ps_doc_example() -> None:
    (row,) = mps.parse_ps(PS_DOC)
    assert row.client_pid == 9741
    assert row.client_id == 0
    assert row.server_pid == 6472
    assert row.device == "GPU-cb1213a3-d6a4-be7f"
    assert row.namespace == "4026531836"
    assert row.command == "./nbody"
    assert row.status is None


def test_ps_fixed_width_command_with_spaces() -> None:
    rows = mps.parse_ps(PS_FIXED)
    assert [r.client_pid for r in rows] == [9741, 9800]
    assert rows[0].command == "python train.py --epochs 3"
    assert rows[1].command == "./nbody"


def test_ps_command_in_the_middle() -> None:
    (row,) = mps.parse_ps(PS_8COL)
    assert row.command == "python  serve.py"
    assert row.status == "ACTIVE"
    assert dict(row.columns)["DEVICE"] == "GPU-cb1213a3"


def test_ps_bad_tables() -> None:
    assert mps.parse_ps("") == ()
    with pytest.raises(MpsParseError):
        mps.parse_ps("garbage\n")
    with pytest.raises(MpsParseError):
        mps.parse_ps("PID ID SERVER DEVICE NAMESPACE COMMAND\n9741 0\n")
    with pytest.raises(MpsParseError):
        mps.parse_ps("PID ID SERVER DEVICE NAMESPACE COMMAND\nx 0 1 d n c\n")


def test_lspart_doc_example() -> None:
    total, part = mps.parse_lspart(LSPART_DOC)
    assert total.gpu == "GPU-74d43ed3"
    assert total.partition is None
    assert (total.free_chunks, total.used_chunks, total.free_sm, total.used_sm) == (3, 7, 24, 56)
    assert total.clients is None
    assert part.partition == "Dx4AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
    assert part.free_chunks is None
    assert part.used_chunks == 7
    assert part.used_sm == 56
    with pytest.raises(MpsParseError):
        mps.parse_lspart("GPU Partition free used free used clients\nGPU-1 - 3\n")


def test_device_client_list() -> None:
    text = "[0] 01:00.0, Tesla V100-SXM2-16GB\n30112 30119\n[1] 02:00.0, Tesla V100\n"
    devs = mps.parse_device_client_list(text)
    assert [(d.ordinal, d.location, d.client_pids) for d in devs] == [
        (0, "01:00.0", (30112, 30119)),
        (1, "02:00.0", ()),
    ]
    assert devs[0].name == "Tesla V100-SXM2-16GB"
    assert mps.parse_device_client_list("") == ()
    with pytest.raises(MpsParseError):
        mps.parse_device_client_list("30112\n")


# Daemon output lines ----------------------------------------------------------------------


def test_log_lines_to_events() -> None:
    events = [mps.event_from_line(line, GPU, 1.0) for line in LOG_START_SERVER.splitlines()]
    kinds = [e.kind for e in events]
    assert kinds == [
        MpsEventKind.COMMAND,
        MpsEventKind.SERVER_STARTED,
        MpsEventKind.SERVER_EXITED,
        MpsEventKind.RAW,
    ]
    assert events[0].text == "start_server -uid 0"
    assert (events[1].server_pid, events[1].uid) == (7599, 0)
    assert (events[2].server_pid, events[2].status) == (7599, 1)
    assert all(e.gpu_uuid == GPU for e in events)


@pytest.mark.parametrize(
    ("line", "kind", "fields"),
    [
        (
            "[2024-04-23 06:04:59.415 Control    72] NEW SERVER 81: Ready",
            MpsEventKind.SERVER_READY,
            {"server_pid": 81},
        ),
        (
            "[2024-04-23 06:04:59.415 Control    72] NEW CLIENT 900 from user 1000: Server already exists",
            MpsEventKind.CLIENT_CONNECTED,
            {"client_pid": 900, "uid": 1000},
        ),
        (
            "[2024-04-23 06:04:59.415 Legacy Server  4242] Server encountered a fatal exception. Shutting down",
            MpsEventKind.FATAL_EXCEPTION,
            {"server_pid": 4242},
        ),
        (
            "[2024-04-23 06:04:59.415 Control    72] Server encountered a fatal exception. Shutting down",
            MpsEventKind.FATAL_EXCEPTION,
            {"server_pid": None},
        ),
        (
            "[2024-04-23 06:04:59.415 Control    72] Exit with status 1",
            MpsEventKind.DAEMON_EXITED,
            {"status": 1},
        ),
        (
            "[2024-04-23 06:04:59.415 Control    72] Failed to start server using uid 1000, error: x",
            MpsEventKind.SERVER_EXITED,
            {"uid": 1000},
        ),
        ("not a log line at all", MpsEventKind.RAW, {}),
    ],
)
def test_line_kinds(line: str, kind: MpsEventKind, fields: dict[str, object]) -> None:
    event = mps.event_from_line(line, GPU, 5.0)
    assert event.kind is kind
    for name, value in fields.items():
        assert getattr(event, name) == value
    assert event.at_s == 5.0


def test_log_line_split() -> None:
    parsed = mps.parse_log_line(
        "[2024-04-23 06:04:59.415 Control    72] Cmd:set_default_device_pinned_mem_limit 0 4096M"
    )
    assert parsed is not None
    assert (parsed.component, parsed.pid) == ("Control", 72)
    assert parsed.message == "Cmd:set_default_device_pinned_mem_limit 0 4096M"
    assert mps.parse_log_line("[bad] x") is None


# Validation -------------------------------------------------------------------------------


def test_validation() -> None:
    assert mps.check_pct(100) == 100.0
    assert mps.check_mps_size(2 * GIB) == "2G"
    assert mps.check_mps_size(1536 * MIB) == "1536M"
    assert mps.check_mps_size(1536 * MIB + 5) == "1536M"
    assert mps.check_mps_size("7G") == "7G"
    assert mps.expected_readback(1536 * MIB) == GIB
    assert mps.expected_readback(512 * MIB) == 512 * MIB
    assert mps.check_device(0) == "0"
    assert mps.check_device("MIG-1234abcd") == "MIG-1234abcd"
    for bad_pid in (0, -3, True, "12"):
        with pytest.raises(InvalidValue):
            mps.check_pid(bad_pid)  # type: ignore[arg-type]
    for bad_prio in (2, -1, True, "0"):
        with pytest.raises(InvalidValue):
            mps.check_priority(bad_prio)  # type: ignore[arg-type]


# Random text never crashes a parser -------------------------------------------------------

_PARSERS = [
    mps.parse_pid_list,
    mps.parse_pct,
    mps.parse_mps_size,
    mps.parse_priority,
    mps.parse_server_status,
    mps.parse_terminate_status,
    mps.parse_ps,
    mps.parse_lspart,
    mps.parse_device_client_list,
]
_TOKENS = st.sampled_from(
    ["PID", "ID", "SERVER", "COMMAND", "GPU", "chunk", "-", "Yes", "[0]", "01:00.0,", "12", "2G",
     "40.0", "ACTIVE", "Server", "not", "found", "\n", " ", "\t", "x", "-1", "99999999999999999999"]
)  # fmt: skip
_TEXT = st.one_of(st.text(max_size=300), st.lists(_TOKENS, max_size=40).map(" ".join))


@settings(max_examples=150, deadline=None)
@given(text=_TEXT)
def test_parsers_never_crash(text: str) -> None:
    for parser in _PARSERS:
        with contextlib.suppress(MpsParseError):
            parser(text)
    assert isinstance(mps.parse_error(text) or MpsError("none"), MpsError)
    event = mps.event_from_line(text, GPU, 0.0)
    assert event.gpu_uuid == GPU
    mps.parse_log_line(text)


# The front end's exit and output contract, with stand-in front ends -------------------------------


def _front_end(tmp_path: Path, body: str) -> mps.MpsControl:
    # tmp_path is trusted_tmp: root runs the front end only from a root-only directory.
    script = tmp_path / "fake-control"
    script.write_text("#!/bin/sh\ncat >/dev/null\n" + body + "\n")
    script.chmod(0o755)
    return mps.MpsControl(script, tmp_path, timeout_s=0.5)


def test_empty_reply_means_connection_broke(trusted_tmp: Path) -> None:
    ctl = _front_end(trusted_tmp, "exit 0")
    with pytest.raises(DaemonNotReachable, match="no reply"):
        ctl.get_default_active_thread_percentage()
    # Commands whose normal reply is empty still succeed.
    assert ctl.get_server_list() == ()


def test_nonzero_exit_and_stderr_message(trusted_tmp: Path) -> None:
    ctl = _front_end(trusted_tmp, "echo 'Cannot find MPS control daemon process' >&2; exit 1")
    with pytest.raises(DaemonNotReachable, match="Cannot find"):
        ctl.get_server_list()
    ctl = _front_end(trusted_tmp, "exit 3")
    with pytest.raises(DaemonNotReachable, match="exited 3"):
        ctl.get_server_list()


def test_timeout_is_typed(trusted_tmp: Path) -> None:
    ctl = _front_end(trusted_tmp, "exec sleep 5")
    with pytest.raises(mps.CommandTimeout):
        ctl.get_server_list()


def test_multiline_command_refused(trusted_tmp: Path) -> None:
    ctl = _front_end(trusted_tmp, "exit 0")
    with pytest.raises(InvalidValue, match="one line"):
        ctl.command("get_server_list\nquit")
