"""Every default filesystem path gpushare uses, in one place.

systemd exports ``$RUNTIME_DIRECTORY``, ``$STATE_DIRECTORY`` and ``$CONFIGURATION_DIRECTORY`` for the
unit's ``RuntimeDirectory=``/``StateDirectory=``/``ConfigurationDirectory=``; the defaults below are
what those resolve to for ``gpushare.service``. Everything is overridable in the config file so a
whole daemon can run under a temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_FILE = Path("/etc/gpushare/gpushare.toml")
RUNTIME_DIR = Path("/run/gpushare")
STATE_DIR = Path("/var/lib/gpushare")
LOG_DIR = Path("/var/log/gpushare")

SOCKET_NAME = "gpushare.sock"
LATENCY_SOCKET_NAME = "latency.sock"
DATABASE_NAME = "gpushare.db"
MPS_SUBDIR = "mps"
CLIENT_LOG_SUBDIR = "clients"

ENV_CONFIG = "GPUSHARE_CONFIG"
ENV_SOCKET = "GPUSHARE_SOCKET"
ENV_CLIENT_ID = "GPUSHARE_CLIENT_ID"
ENV_LATENCY_SOCKET = "GPUSHARE_LATENCY_SOCKET"


def default_config_file() -> Path:
    """The config file to read: ``$GPUSHARE_CONFIG`` if set, else ``/etc/gpushare/gpushare.toml``."""
    return Path(os.environ.get(ENV_CONFIG, str(CONFIG_FILE)))


def repo_root() -> Path:
    """The source checkout this package runs from (used to find ``.cache/mps`` in development)."""
    return Path(__file__).resolve().parent.parent
