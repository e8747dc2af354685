"""Rendering of ``status`` and ``list`` answers as tables (no Typer: the fast path uses it too).

Values the daemon could not read are ``None`` in JSON and print as ``N/A``, never as 0. Fields a
daemon of schema version 1 does not send (a CLI upgraded before the daemon was restarted) print as
``N/A`` too, rather than failing.
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


def _ms(value: float | None) -> str:
    # Latencies: three significant digits are what a p99 over a window can claim.
    return NA if value is None else f"{value:.3g}ms"


def _ratio(value: float | None) -> str:
    return NA if value is None else f"{value:.2f}"


def _count(value: int | None) -> str:
    return NA if value is None else str(value)


def _mem(c: dict[str, Any]) -> str:
    limit = c["mem_limit_bytes"]
    return f"{_gib(c['mem_used_bytes'])}/{'-' if limit is None else _gib(limit)}"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)  # fmt: skip


def _common(c: dict[str, Any]) -> list[str]:
    return [c["id"], c["name"] or "-", c["user"],
            NA if c["gpu_index"] is None else str(c["gpu_index"]), _pct(c["sm_pct"]), _mem(c)]  # fmt: skip


def _state(c: dict[str, Any]) -> str:
    return str(c["state"]) + (" (held)" if c["held"] else "")


def _online_table(clients: Sequence[dict[str, Any]]) -> str:
    rows = [["ID", "NAME", "USER", "GPU", "SM", "MEM USED/LIMIT", "P99", "SLO", "P99/SLO",
             "SOURCE", "STATE", "UPTIME"]]  # fmt: skip
    for c in clients:
        lat = c.get("latency") or {}
        rows.append([
            *_common(c), _ms(lat.get("p99_ms")), _ms(c["slo_p99_ms"]), _ratio(lat.get("ratio")),
            lat.get("source") or NA, _state(c), _dur(c["uptime_s"]),
        ])  # fmt: skip
    return _table(rows)


def _offline_table(clients: Sequence[dict[str, Any]]) -> str:
    rows = [["ID", "NAME", "USER", "GPU", "SM", "MEM USED/LIMIT", "THAWED 1M", "RESTARTS",
             "EVICTIONS", "STATE", "UPTIME", "PAUSE", "QUEUE"]]  # fmt: skip
    for c in clients:
        off = c.get("offline") or {}
        ratio = off.get("thawed_ratio_1m")
        rows.append([
            *_common(c), _pct(None if ratio is None else ratio * 100.0),
            _count(c.get("restarts")), _count(off.get("evictions")), _state(c),
            _dur(c["uptime_s"]), c["pause_mechanism"] or NA, _queue(off.get("queue")),
        ])  # fmt: skip
    return _table(rows)


def _queue(q: dict[str, Any] | None) -> str:
    """What an offline client asked for, and how its queue is kept while it runs.

    ``deep``, ``shallow (4 in flight)``, ``auto (blocking)``, ``auto (deep)`` (docs/controller.md,
    "Shallow offline queues").
    """
    if not q:
        return NA
    asked = q.get("asked") or "deep"
    now = q.get("shallow") or q.get("now")
    if now is None or (asked == "deep" and now == "deep"):
        return str(asked)
    return f"{asked} ({now})"


def render_clients(clients: Sequence[dict[str, Any]]) -> str:
    """The client tables of ``status`` and ``list``: online clients, then offline ones.

    Online rows show the p99 over the latency window against the SLO, their ratio and where the
    number came from; offline rows how much of the last minute the client was thawed, its restarts
    and evictions. Notes under the tables say who adopted a client and how it is paused, and why
    a queued job waits (its ``waiting``, clipped to :data:`WAITING_CHARS`).
    """
    online = [c for c in clients if c["class"] == "online"]
    offline = [c for c in clients if c["class"] != "online"]
    parts = []
    if online:
        parts.append("online clients\n" + _online_table(online))
    if offline:
        parts.append("offline clients\n" + _offline_table(offline))
    if not parts:
        return "no clients"
    notes: list[str] = []
    for c in clients:
        # Adopted clients (gpushare did not start them): who adopted them, and how they are
        # paused where they are (their own cgroup, or signals) and why.
        if c.get("adopted_by"):
            notes.append(
                f"{c['id']}: adopted by {c['adopted_by']}{_container(c.get('container'))}"
                + (f"; paused by {c['pause_reason']}" if c.get("pause_reason") else "")
            )
        # A queued job: why admission did not start it (memory, a slot, a backoff, another
        # user's MPS server), under the table so that a long reason does not widen it.
        if c.get("waiting"):
            notes.append(f"{c['id']}: queued: {_clip(c['waiting'])}")
    return "\n\n".join(parts) + "".join(f"\n{n}" for n in notes)


WAITING_CHARS = 200
"""The most of a queued job's reason a note shows (one GPU's reason is about 100 characters);
``--json`` has all of it."""


def _clip(text: str) -> str:
    if len(text) <= WAITING_CHARS:
        return text
    return text[: WAITING_CHARS - 3].rstrip() + "... (all of it: --json)"


def _container(found: dict[str, Any] | None) -> str:
    if not found:
        return ""
    where = f" in pod {found['pod_uid']}" if found.get("pod_uid") else ""
    if found.get("id"):
        where += f" (container {found['id'][:12]}" + (
            f", {found['runtime']})" if found.get("runtime") else ")"
        )
    return where


def _gate(gpu: dict[str, Any]) -> str:
    if not gpu.get("shared", True):
        return "-"  # gpushare does not manage this GPU
    gate = gpu.get("gate")
    duty = gpu["duty"]
    state = gate["state"] if gate else ("open" if duty >= 1.0 else "closed" if duty <= 0 else "")
    return f"duty {duty:.2f}" if state not in ("open", "closed") else state


def _why(gpu: dict[str, Any]) -> str | None:
    gate = gpu.get("gate") or {}
    last = gate.get("last_action")
    if not last:
        return None
    age = last.get("age_s")
    when = "" if age is None else f", {format_duration(max(0, round(age)))} ago"
    return f"GPU {gpu['index']} offline {_gate(gpu)}: {last['kind']}{when}: {last['reason']}"


def _mps(gpu: dict[str, Any], simulated: bool) -> str:
    # On simulated GPUs MPS may be the real control daemon or simulated too: say which.
    state = gpu["mps_state"] or NA
    backend = gpu.get("mps_backend")
    if not simulated or backend is None:
        return state
    return f"{state} ({'real' if backend == 'real' else 'sim'})"


def _request_gate(gpu: dict[str, Any]) -> tuple[str, str]:
    """Request gating of a GPU: off / open / closed (with its delay), and the requests in flight."""
    gate = gpu.get("request_gate")
    if gate is None:
        # Not shared, or a daemon without request gating.
        return ("-", "-") if not gpu.get("shared", True) else (NA, NA)
    state = "closed" if gate["closed"] else "open" if gate["enabled"] else "off"
    delay = gate.get("delay_ms") or 0.0  # absent from an older daemon's status
    if gate["enabled"] and delay > 0.0:
        # Offline work runs beside the first `delay` of each busy spell (docs/controller.md).
        state += f"+{delay:.3g}ms"
    return state, str(gate["inflight"])


def render_status(status: dict[str, Any]) -> str:
    """The human ``status`` view: one row per GPU, then one per client."""
    rows = [["GPU", "UUID", "MEMORY USED/TOTAL", "UTIL", "MPS", "ONLINE SLO", "PROBE",
             "SLOTS", "OFFLINE", "OFFLINE SM", "REQUESTS", "IN FLIGHT"]]  # fmt: skip
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
            f"{g['client_slots_used']}/{g['client_slots_max']}", _gate(g),
            _pct(g["offline_sm_pct"]), *_request_gate(g),
        ])  # fmt: skip
        if g["error"]:
            rows.append(["", f"error: {g['error']}", "", "", "", "", "", "", "", "", "", ""])
        if (drain := g.get("drain")) is not None:  # absent from an older daemon's status
            why = f": {drain['reason']}" if drain["reason"] else ""
            rows.append(["", f"draining (by {drain['by']}{why}): nothing new starts here",
                         "", "", "", "", "", "", "", "", "", ""])  # fmt: skip
    node = " (simulated GPUs)" if simulated else ""
    head = f"gpushare {status['daemon']['version']}{node}: {status['daemon']['summary']}"
    whys = [w for w in (_why(g) for g in status["gpus"]) if w]
    if refused := status["daemon"].get("trust_refusals"):
        # gpushare.trust: a file another user could change was not used; doctor names the fix.
        counts = ", ".join(f"{role} ({n}x)" for role, n in sorted(refused.items()))
        head += f"\nrefused as not trusted: {counts}; `gpushare doctor` names the fix"
    gpus = _table(rows) + ("\n" + "\n".join(whys) if whys else "")
    return "\n".join([head, "", gpus, "", render_clients(status["clients"])])


def mps_down(status: dict[str, Any]) -> bool:
    """Whether a shared GPU's MPS is down or faulted (``gpushare status`` then exits 1)."""
    return any(g["shared"] and g["mps_state"] in ("down", "fault") for g in status["gpus"])
