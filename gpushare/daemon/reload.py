"""What a config reload (``systemctl reload``, SIGHUP) may apply, and what it must refuse.

A reload applies every key of the new file or none: a file that is invalid, that is not trusted
(:mod:`gpushare.trust`: a user who can change it would choose the binaries root runs), or that
changes a key the daemon reads only at start is refused as a whole with one line, and the old
config stays in force. Refusing is chosen over applying those keys live because each of them
rebuilds something that running clients depend on (the API socket, the MPS control daemons, the
probe, the latency receiver, the exporter), and over applying the rest silently because an
operator who changed ``socket_mode`` must not be told "config reloaded" while the socket keeps
its old mode.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpushare import config as config_mod
from gpushare import trust
from gpushare.config import Config

RESTART_KEYS = (
    "paths",
    "daemon.log_level",
    "daemon.socket_mode",
    "daemon.socket_group",
    "daemon.max_request",
    "mps",
    "probe",
    "latency",
    "metrics",
    "gate.gauge_period",
    "gate.max_datagrams_per_s",
    "gate.realtime_threads",
)
"""Keys (or whole tables) the daemon reads once, at start: the socket, the MPS supervisors, the
probe, the latency receiver, the exporter and the gates' threads are built from them. Also
``gpus.<key>.shared``: the MPS control daemons run for the GPUs shared at start."""

LIVE_KEYS = ("mps.max_clients",)
"""Exceptions inside a :data:`RESTART_KEYS` table: read at each admission, so a reload applies."""

_GPU_SHARED = re.compile(r"^gpus\.[^.]+\.shared$")
"""``gpus.<key>.shared``: MPS is started at start for the shared GPUs only."""


class ReloadRefusedError(Exception):
    """The new config is not applied; the message is the one line the event and log carry."""


def restart_keys(old: Config, new: Config) -> list[str]:
    """The keys that differ between ``old`` and ``new`` and take effect only after a restart."""
    before, after = _flat(config_mod.to_dict(old)), _flat(config_mod.to_dict(new))
    changed = {k for k in before.keys() | after.keys() if _get(before, k) != _get(after, k)}
    return sorted(
        k
        for k in changed
        if _GPU_SHARED.match(k)
        or (k not in LIVE_KEYS and any(k == p or k.startswith(p + ".") for p in RESTART_KEYS))
    )


def _get(flat: Mapping[str, Any], key: str) -> Any:
    # A GPU without a table of its own is shared (GpuOverride's default).
    return flat.get(key, True if _GPU_SHARED.match(key) else None)


def load_for_reload(path: Path, current: Config) -> Config:
    """The config to apply from ``path``, checked against the one in force.

    Raises:
        ReloadRefusedError: the file is invalid, not trusted, or changes a key that needs a restart.
    """
    try:
        new = config_mod.load(path)
    except config_mod.ConfigError as exc:
        raise ReloadRefusedError(str(exc)) from None
    untrusted = untrusted_config(path)
    if untrusted is not None:
        raise ReloadRefusedError(untrusted)
    keys = restart_keys(current, new)
    if keys:
        raise ReloadRefusedError(
            f"{path}: these keys need a restart of gpushare: {', '.join(keys)} "
            "(restore them and reload, or restart: workloads keep running)"
        )
    return new


def untrusted_config(path: Path) -> str | None:
    """Why the daemon may not take its orders from ``path`` (:mod:`gpushare.trust`); None: it may.

    The config names the binaries root runs (``mps.control_binary``) and where root writes, so a
    file, or a directory above it, that a user other than root can change is refused at start
    and at every reload.
    """
    return trust.refusal(path, what=config_mod.CONFIG_ROLE)


def _flat(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
