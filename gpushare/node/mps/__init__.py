"""NVIDIA MPS: the only package that runs ``nvidia-cuda-mps-control`` (design §3, one module per outside resource).

NVIDIA's MPS documentation (docs/sources.md) is the source of every format and message handled here.
Read it in this order:

* :mod:`~gpushare.node.mps.errors`: :class:`MpsError` and one subclass per kind of failure.
* :mod:`~gpushare.node.mps.parse`: pure parsers of command replies and ``-f`` output lines.
* :mod:`~gpushare.node.mps.commands`: the command adapter, :class:`MpsControl` (one typed
  method per control command, values checked before they are sent) and the binary's lookup.
* :mod:`~gpushare.node.mps.supervisor`: :class:`MpsSupervisor`, the ``-f`` daemon of one GPU
  (design D1): its events, health checks and restarts with backoff.
* :mod:`~gpushare.node.mps.recovery`: bringing a faulted server back (offline clients first).
* :mod:`~gpushare.node.mps.manager`: :class:`MpsNodeManager`, one supervisor per shared GPU, the
  :class:`gpushare.node.base.MpsNode` the daemon uses.

Everything public is re-exported here, so ``from gpushare.node.mps import MpsNodeManager`` works;
``tests/test_module_ownership.py`` checks that no module outside this package runs the binary.
"""

from __future__ import annotations

from gpushare.node.mps.commands import (
    DAEMON_ENV_DROP,
    HEALTH_COMMAND,
    SERVER_BINARY,
    MpsControl,
    binary_status,
    binary_version,
    check_device,
    check_mps_size,
    check_pct,
    check_pid,
    check_priority,
    expected_readback,
    find_binary,
    mps_size_bytes,
    supports_multiuser,
)
from gpushare.node.mps.errors import (
    CommandFailed,
    CommandTimeout,
    DaemonNotReachable,
    DaemonShuttingDown,
    InsufficientPrivileges,
    InvalidValue,
    MpsError,
    MpsParseError,
    MpsSetupError,
    ServerNotFound,
    UnknownCommand,
)
from gpushare.node.mps.manager import MpsNodeManager
from gpushare.node.mps.parse import (
    CHATTER,
    CHATTER_PREFIXES,
    GIB,
    LOG_LINE_RE,
    MIB,
    DeviceClients,
    LogLine,
    LspartRow,
    PsRow,
    ServerStatus,
    event_from_line,
    parse_device_client_list,
    parse_error,
    parse_log_line,
    parse_lspart,
    parse_mps_size,
    parse_pct,
    parse_pid_list,
    parse_priority,
    parse_ps,
    parse_server_status,
    parse_terminate_status,
)
from gpushare.node.mps.recovery import FaultRecord, ServerRecovery
from gpushare.node.mps.setup import EXCLUSIVE_PROCESS, PIPE_ENTRIES
from gpushare.node.mps.supervisor import EventCallback, MpsSupervisor

__all__ = [
    "CHATTER",
    "CHATTER_PREFIXES",
    "DAEMON_ENV_DROP",
    "EXCLUSIVE_PROCESS",
    "GIB",
    "HEALTH_COMMAND",
    "LOG_LINE_RE",
    "MIB",
    "PIPE_ENTRIES",
    "SERVER_BINARY",
    "CommandFailed",
    "CommandTimeout",
    "DaemonNotReachable",
    "DaemonShuttingDown",
    "DeviceClients",
    "EventCallback",
    "FaultRecord",
    "InsufficientPrivileges",
    "InvalidValue",
    "LogLine",
    "LspartRow",
    "MpsControl",
    "MpsError",
    "MpsNodeManager",
    "MpsParseError",
    "MpsSetupError",
    "MpsSupervisor",
    "PsRow",
    "ServerNotFound",
    "ServerRecovery",
    "ServerStatus",
    "UnknownCommand",
    "binary_status",
    "binary_version",
    "check_device",
    "check_mps_size",
    "check_pct",
    "check_pid",
    "check_priority",
    "event_from_line",
    "expected_readback",
    "find_binary",
    "mps_size_bytes",
    "parse_device_client_list",
    "parse_error",
    "parse_log_line",
    "parse_lspart",
    "parse_mps_size",
    "parse_pct",
    "parse_pid_list",
    "parse_priority",
    "parse_ps",
    "parse_server_status",
    "parse_terminate_status",
    "supports_multiuser",
]
