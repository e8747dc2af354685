"""How much of the API socket each uid may use: the ``[daemon]`` keys the server enforces.

:class:`gpushare.daemon.server.ApiServer` applies them (docs/security.md, "The API socket: fair
use"); a reload hands it new ones (``ApiServer.set_limits``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from gpushare.config import DaemonConfig


@dataclass(frozen=True, slots=True)
class Limits:
    """How much of the socket each uid may use (the ``[daemon]`` keys of the same names)."""

    max_connections: int = 1024
    """Connections in all beyond which only root and the admin group are accepted."""
    admin_reserve_connections: int = 64
    """Connections past ``max_connections`` kept for root and the admin group."""
    max_connections_per_uid: int = 64
    api_workers: int = 8
    """Threads running handlers, so requests in flight in all."""
    admin_reserve_workers: int = 2
    """Workers other users never occupy: root's and the admin group's requests always find one."""
    max_inflight_per_uid: int = 4
    idle_timeout_s: float = 600.0
    request_timeout_s: float = 10.0
    """Time to send a whole request once it is started, and to read a whole answer."""


def server_limits(cfg: DaemonConfig) -> Limits:
    """The socket's limits as the ``[daemon]`` table sets them."""
    # The fields are named as the config's keys; a new limit is a field in both.
    return Limits(**{f.name: getattr(cfg, f.name) for f in fields(Limits)})
