"""Rendering of ``status`` and ``list`` answers as tables (no Typer: the fast path uses it too).

Values the daemon could not read are ``None`` in JSON and print as ``N/A``, never as 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpushare.units import format_duration

NA = "N/A"


def _gib(value: int | None) -> str:
    return NA if value is None else f"{value / (1 << 30):.1f}G"


def _pct(value: float | None) -> str:
    # One decimal at most: 33.3%, 50%, 15.9% (a reading is not more precise than that).
    return NA if value is None else f"{round(value, 1):g}%"


def _dur(value: float | None) -> str:
    return NA if value is None else format_duration(round(value))


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)  # fmt: skip


def render_clients(clients: Sequence[dict[str, Any]]) -> str:
    """The client table of ``status`` and ``list``."""
    rows = [["ID", "NAME", "USER", "CLASS", "GPU", "SM", "MEM LIMIT", "MEM USED", "STATE",
             "UPTIME", "PAUSE"]]  # fmt: skip
    for c in clients:
        rows.append([
            c["id"], c["name"] or "-", c["user"], c["class"],
            NA if c["gpu_index"] is None else str(c["gpu_index"]), _pct(c["sm_pct"]),
            _gib(c["mem_limit_bytes"]), _gib(c["mem_used_bytes"]),
            c["state"] + (" (held)" if c["held"] else ""), _dur(c["uptime_s"]),
            c["pause_mechanism"] or NA,
        ])  # fmt: skip
    return _table(rows) if clients else "no clients"


def _mps(gpu: dict[str, Any], simulated: bool) -> str:
    # On simulated GPUs MPS may be the real control daemon or simulated too: say which.
    state = gpu["mps_state"] or NA
    backend = gpu.get("mps_backend")
    if not simulated or backend is None:
        return state
    return f"{state} ({'real' if backend == 'real' else 'sim'})"


def _gate(gate: dict[str, Any] | None) -> tuple[str, str]:
    """Request gating of a GPU: off / open / closed, and the requests in flight."""
    if gate is None:
        return NA, NA  # a daemon without request gating
    state = "closed" if gate["closed"] else "open" if gate["enabled"] else "off"
    return state, str(gate["inflight"])


def render_status(status: dict[str, Any]) -> str:
    """The human ``status`` view: one row per GPU, then one per client."""
    rows = [["GPU", "UUID", "MEMORY USED/TOTAL", "UTIL", "MPS", "ONLINE SLO", "PROBE",
             "SLOTS", "DUTY", "OFFLINE SM", "GATE", "IN FLIGHT"]]  # fmt: skip
    simulated = bool(status["daemon"].get("simulated"))
    for g in status["gpus"]:
        probe = g["probe"]
        probe_text = (
            "off" if not probe["enabled"]
            else NA if probe["latency_ms"] is None
            else f"{probe['latency_ms']:.2f}ms"
        )  # fmt: skip
        rows.append([
            str(g["index"]), g["uuid"], f"{_gib(g['mem_used_bytes'])}/{_gib(g['mem_total_bytes'])}",
            _pct(g["gpu_util_pct"]), _mps(g, simulated), g["online_slo"]["state"], probe_text,
            f"{g['client_slots_used']}/{g['client_slots_max']}", f"{g['duty']:.2f}",
            _pct(g["offline_sm_pct"]), *_gate(g.get("gate")),
        ])  # fmt: skip
        if g["error"]:
            rows.append(["", f"error: {g['error']}", "", "", "", "", "", "", "", "", "", ""])
    node = " (simulated GPUs)" if simulated else ""
    head = f"gpushare {status['daemon']['version']}{node}: {status['daemon']['summary']}"
    return "\n".join([head, "", _table(rows), "", render_clients(status["clients"])])


def mps_down(status: dict[str, Any]) -> bool:
    """Whether a shared GPU's MPS is down or faulted (``gpushare status`` then exits 1)."""
    return any(g["shared"] and g["mps_state"] in ("down", "fault") for g in status["gpus"])
