"""Rendering of ``status`` and ``list`` answers as tables (no Typer: the fast path uses it too).

Like nvidia-smi, squeue and kubectl: the default view fits 100 columns (GPU index and model;
per client its pid, state, restarts and age; long ids and names clipped), ``-o wide`` has every
column with UUIDs and names whole, and ``--json`` everything. States and readings that need
attention are coloured on a terminal only (:func:`gpushare.cli.term.use_colour`).

Values the daemon could not read are ``None`` in JSON and print as ``N/A``, never as 0. Fields a
daemon of schema version 1 does not send (a CLI upgraded before the daemon was restarted) print as
``N/A`` too, rather than failing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from gpushare import protocol
from gpushare.units import format_duration

NA = "N/A"
WIDTH = 100
"""The default view fits this many columns (``-o wide`` has no limit)."""
ID_CHARS = 8
NAME_CHARS = 10
USER_CHARS = 8
MODEL_CHARS = 14

Paint = Callable[[str, str], str]
"""Colours a padded cell by the kind of value it shows (``ok``, ``warn``, ``bad``, ``info``)."""

_ANSI = {"ok": "32", "warn": "33", "bad": "31", "info": "36", "dim": "2", "head": "1"}
_STATE_COLOUR = {
    "running": "ok", "throttled": "warn", "frozen": "warn", "restarting": "warn",
    "starting": "info", "queued": "info", "failed": "bad", "lost": "bad", "exited": "dim",
    "up": "ok", "down": "bad", "fault": "bad", "degraded": "bad", "ok": "ok",
    "closed": "warn", "cycling": "warn",
}  # fmt: skip


def painter(colour: bool) -> Paint:
    """A cell painter: ANSI colours when ``colour``, else the text unchanged."""

    def paint(text: str, kind: str) -> str:
        code = _ANSI.get(kind)
        return f"\x1b[{code}m{text}\x1b[0m" if colour and code and text.strip() else text

    return paint


def _plain(text: str, kind: str) -> str:
    return text


def _gib(value: int | None) -> str:
    return NA if value is None else f"{value / (1 << 30):.1f}G"


def _pct(value: float | None) -> str:
    # One decimal at most: 33.3%, 50%, 15.9% (a reading is not more precise than that).
    return NA if value is None else f"{round(value, 1):g}%"


def _dur(value: float | None) -> str:
    return NA if value is None else format_duration(round(value))


def age(seconds: float | None) -> str:
    """Kubectl's AGE: ``45s``, ``12m``, ``5h``, ``3d``."""
    if seconds is None:
        return NA
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size * (2 if unit != "m" else 1):
            return f"{s // size}{unit}"
    return f"{s}s"


def _ms(value: float | None) -> str:
    # Latencies: three significant digits are what a p99 over a window can claim.
    return NA if value is None else f"{value:.3g}ms"


def _ratio(value: float | None) -> str:
    return NA if value is None else f"{value:.2f}"


def _count(value: int | None) -> str:
    return NA if value is None else str(value)


def clip(text: str, n: int) -> str:
    """At most ``n`` characters, the cut marked with ``~`` (as kubectl and squeue shorten)."""
    return text if len(text) <= n else text[: n - 1] + "~"


def short_uuid(uuid: str | None) -> str:
    """``GPU-1a2b3c4d`` for ``GPU-1a2b3c4d-...`` (nvidia-smi -L's is whole: ``-o wide``)."""
    if not uuid:
        return "-"
    return uuid if len(uuid) <= 12 else uuid[:12] + "~"


def _mem(c: dict[str, Any]) -> str:
    limit = c["mem_limit_bytes"]
    # Nothing can be in use before it runs or after it ended: "-", not N/A (not read).
    used = (
        _gib(c["mem_used_bytes"])
        if c["state"] not in ("queued", "exited", "failed", "lost")
        else "-"
    )
    return f"{used}/{'-' if limit is None else _gib(limit)}"


def _table(
    rows: Sequence[Sequence[str]], paint: Paint = _plain, kinds: Sequence[Sequence[str]] = ()
) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        cells = [c.ljust(w) for c, w in zip(r, widths, strict=True)]
        cells[-1] = cells[-1].rstrip()  # no padding after the last column, painted or not
        if n == 0:
            cells = [paint(c, "head") for c in cells]
        elif n - 1 < len(kinds):
            kind = [*kinds[n - 1], *[""] * len(cells)]
            cells = [paint(c, k) if k else c for c, k in zip(cells, kind, strict=False)]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def _state(c: dict[str, Any]) -> str:
    state = str(c["state"])
    if state == "queued" and c.get("queue_position"):
        return f"queued({c['queue_position']})"
    return state + (" (held)" if c["held"] else "")


def _kind(state: str) -> str:
    words = state.split("(")[0].split()
    return _STATE_COLOUR.get(words[0], "") if words else ""


def _client_age(c: dict[str, Any], now: float) -> str:
    at = c.get("submitted_at")
    return age(now - at) if isinstance(at, int | float) else NA


def _gpu_cell(c: dict[str, Any]) -> str:
    if c["gpu_index"] is None:
        return "-" if c["state"] == "queued" else NA
    gang = c.get("gpus") or ()
    if len(gang) > 1:  # a gang: every GPU it uses, in rank order
        return ",".join(NA if g["index"] is None else str(g["index"]) for g in gang)
    return str(c["gpu_index"])


def _pid(c: dict[str, Any]) -> str:
    pid = c.get("pid")
    return "-" if pid is None else str(pid)


def _head(c: dict[str, Any], wide: bool) -> list[str]:
    ident, name, user = str(c["id"]), c["name"] or "-", str(c["user"])
    if not wide:
        ident, name, user = clip(ident, ID_CHARS), clip(name, NAME_CHARS), clip(user, USER_CHARS)
    sm = "-" if c["state"] == "queued" and c["sm_pct"] is None else _pct(c["sm_pct"])
    return [ident, name, user, _gpu_cell(c), _pid(c), sm, _mem(c)]


def _heads(wide: bool) -> list[str]:
    return ["ID", "NAME", "USER", "GPU", "PID", "SM", "MEM USED/LIMIT" if wide else "MEM"]


def _online_table(clients: Sequence[dict[str, Any]], wide: bool, paint: Paint, now: float) -> str:
    head = _heads(wide)
    if wide:
        head += ["P99", "SLO", "P99/SLO", "SOURCE", "STATE", "RESTARTS", "UPTIME", "AGE"]
    else:
        head += ["P99/SLO", "STATE", "RESTARTS", "AGE"]
    rows: list[list[str]] = [head]
    kinds = []
    for c in clients:
        lat = c.get("latency") or {}
        ratio = lat.get("ratio")
        p99, slo = _ms(lat.get("p99_ms")), _ms(c["slo_p99_ms"])
        if wide:
            mid = [p99, slo, _ratio(ratio), lat.get("source") or NA]
            tail = [_state(c), _count(c.get("restarts")), _dur(c["uptime_s"])]
        else:
            mid = [f"{p99}/{slo}"]
            tail = [_state(c), _count(c.get("restarts"))]
        rows.append([*_head(c, wide), *mid, *tail, _client_age(c, now)])
        over = "bad" if isinstance(ratio, float | int) and ratio > 1.0 else ""
        kinds.append([""] * (9 if wide else 7) + [over] + [""] * (1 if wide else 0)
                     + [_kind(_state(c))])  # fmt: skip
    if any(_tokens(c) for c in clients):
        # LLM servers (--slo-ttft-p99, --slo-tpot-p99): two more columns, only where one runs.
        rows[0] += ["TTFT/SLO", "TPOT/SLO"]
        for c, row, kind in zip(clients, rows[1:], kinds, strict=True):
            cells = [_token_cell(t) for t in _tokens(c) or (None, None)]
            kind += [""] * (len(row) - len(kind)) + [over for _, over in cells]
            row += [text for text, _ in cells]
    return _table(rows, paint, kinds)


def _tokens(c: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None] | None:
    """An LLM server's ``latency.ttft`` and ``latency.tpot`` objects; ``None`` for other clients."""
    lat = c.get("latency") or {}
    ttft, tpot = lat.get("ttft"), lat.get("tpot")
    return (ttft, tpot) if ttft is not None or tpot is not None else None


def _token_cell(t: dict[str, Any] | None) -> tuple[str, str]:
    """``612ms/500ms`` and whether it is over its SLO (painted ``bad``)."""
    if t is None:
        return NA, ""
    ratio = t.get("ratio")
    over = "bad" if isinstance(ratio, float | int) and ratio > 1.0 else ""
    return f"{_ms(t.get('p99_ms'))}/{_ms(t.get('slo_p99_ms'))}", over


def _offline_table(clients: Sequence[dict[str, Any]], wide: bool, paint: Paint, now: float) -> str:
    rows: list[list[str]] = [[*_heads(wide), "THAWED 1M" if wide else "THAWED", "RESTARTS"] + (
        ["EVICTIONS", "STATE", "UPTIME", "AGE", "PAUSE", "QUEUE", "RESTART COST"] if wide
        else ["STATE", "AGE"])]  # fmt: skip
    kinds = []
    for c in clients:
        off = c.get("offline") or {}
        ratio = off.get("thawed_ratio_1m")
        row = [*_head(c, wide), _pct(None if ratio is None else ratio * 100.0),
               _count(c.get("restarts"))]  # fmt: skip
        if wide:
            row += [_count(off.get("evictions")), _state(c), _dur(c["uptime_s"]),
                    _client_age(c, now), c["pause_mechanism"] or NA, _queue(off.get("queue")),
                    _restart_cost(off.get("restart_cost"))]  # fmt: skip
        else:
            row += [_state(c), _client_age(c, now)]
        rows.append(row)
        kinds.append([""] * (10 if wide else 9) + [_kind(_state(c))])
    return _table(rows, paint, kinds)


def _restart_cost(cost: dict[str, Any] | None) -> str:
    """What a restart costs the job and whence: ``90s (declared)``, ``12s (measured)`` (issue 32)."""
    if not cost or cost.get("s") is None:
        return NA
    s = float(cost["s"])
    return f"{f'{s:.1f}s' if s < 10 else _dur(s)} ({cost.get('source') or 'default'})"


def _queue(q: dict[str, Any] | None) -> str:
    """What an offline client asked for, and how its queue is kept while it runs.

    ``deep``, ``shallow (4 in flight)``, ``auto (blocking)``, ``auto (deep)`` (docs/controller.md,
    "Shallow offline queues").
    """
    if not q:
        return NA
    asked = q.get("asked") or protocol.DEFAULT_QUEUE_MODE
    now = q.get("shallow") or q.get("now")
    if now is None or (asked == "deep" and now == "deep"):
        return str(asked)
    return f"{asked} ({now})"


def render_clients(
    clients: Sequence[dict[str, Any]],
    *,
    wide: bool = False,
    colour: bool = False,
    now: float | None = None,
) -> str:
    """The client tables of ``status``: online clients, then offline ones (queued among them).

    Online rows show the p99 over the latency window against the SLO and their ratio; offline
    rows how much of the last minute the client was thawed and its restarts. Notes under the
    tables say who adopted a client and how it is paused, and why a queued job waits (its
    ``waiting``, clipped to :data:`WAITING_CHARS`).
    """
    paint = painter(colour)
    at = time.time() if now is None else now
    online = [c for c in clients if c["class"] == "online"]
    offline = [c for c in clients if c["class"] != "online"]
    parts = []
    if online:
        parts.append("online clients\n" + _online_table(online, wide, paint, at))
    if offline:
        parts.append("offline clients\n" + _offline_table(offline, wide, paint, at))
    if not parts:
        return "no clients"
    return "\n\n".join(parts) + "".join(f"\n{n}" for n in _notes(clients, wide))


def _notes(clients: Sequence[dict[str, Any]], wide: bool) -> list[str]:
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
            notes.append(f"{c['id']}: queued: {c['waiting']}")
    return notes if wide else [fit(n) for n in notes]


MORE = "... (-o wide)"


def fit(line: str, width: int = WIDTH) -> str:
    """A note or a reason line cut to ``width`` columns, saying where the rest is."""
    if len(line) <= width:
        return line
    return line[: width - len(MORE)].rstrip() + MORE


def _container(found: dict[str, Any] | None) -> str:
    if not found:
        return ""
    where = f" in pod {found['pod_uid']}" if found.get("pod_uid") else ""
    if found.get("id"):
        where += f" (container {found['id'][:12]}" + (
            f", {found['runtime']})" if found.get("runtime") else ")"
        )
    return where


def render_list(
    clients: Sequence[dict[str, Any]],
    *,
    wide: bool = False,
    colour: bool = False,
    now: float | None = None,
    width: int = WIDTH,
) -> str:
    """``gpushare list``: one row per client, like squeue: state, exit status, age and reason.

    The default view clips REASON so that a row fits ``width`` columns; ``-o wide`` has it all.
    """
    if not clients:
        return "no clients"
    paint = painter(colour)
    at = time.time() if now is None else now
    head = ["ID", "NAME", "USER", "CLASS", "GPU", "PID", "STATE", "EXIT", "AGE"]
    if wide:
        head[5:5] = ["GPU UUID", "SM", "MEM USED/LIMIT"]
        head[-1:-1] = ["RESTARTS"]
    rows = [[*head, "REASON"]]
    kinds = []
    for c in clients:
        ident, name, user = str(c["id"]), c["name"] or "-", str(c["user"])
        if not wide:
            ident, name, user = (
                clip(ident, ID_CHARS),
                clip(name, NAME_CHARS),
                clip(user, USER_CHARS),
            )
        code = c.get("exit_code")
        row = [ident, name, user, str(c["class"]), _gpu_cell(c), _pid(c), _state(c),
               "-" if code is None else str(code), _client_age(c, at)]  # fmt: skip
        if wide:
            row[5:5] = [c.get("gpu_uuid") or "-", _pct(c["sm_pct"]), _mem(c)]
            row[-1:-1] = [_count(c.get("restarts"))]
        reason = c.get("reason")
        if c["state"] == "queued" and c.get("waiting"):
            # What the admission round said; "cannot start:" is what queued means already.
            reason = str(c["waiting"]).removeprefix("cannot start: ")
        rows.append([*row, reason or "-"])
        kinds.append([""] * (9 if wide else 6) + [_kind(_state(c))])
    if not wide:
        # REASON is last: clipped to what is left of the width, like squeue's NODELIST(REASON).
        used = sum(max(len(r[i]) for r in rows) + 2 for i in range(len(head)))
        room = max(12, width - used)
        rows = [r[:-1] + [clip(r[-1], room)] for r in rows]
    return _table(rows, paint, kinds)


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
    age_s = last.get("age_s")
    when = "" if age_s is None else f", {format_duration(max(0, round(age_s)))} ago"
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


def _model(gpu: dict[str, Any]) -> str:
    name = str(gpu.get("name") or NA)
    return name.removeprefix("NVIDIA ")


def _equal_priority(g: dict[str, Any]) -> str:
    """`` p0`` where offline clients launch at the online clients' MPS priority (else nothing)."""
    return " p0" if g.get("offline_mps_priority") == 0 else ""  # absent from an older daemon


def _gpu_rows(status: dict[str, Any], wide: bool) -> tuple[list[list[str]], list[list[str]]]:
    simulated = bool(status["daemon"].get("simulated"))
    if wide:
        head = ["GPU", "NAME", "MEMORY USED/TOTAL", "UTIL", "MPS", "ONLINE SLO", "SLOTS", "OFFLINE",
                "OFFLINE SM", "REQUESTS"]  # fmt: skip
    else:
        head = ["GPU", "NAME", "MEMORY", "UTIL", "MPS", "SLO", "SLOTS", "OFFLINE", "SM", "GATE"]
    if wide:
        head[2:2] = ["UUID"]
        head[7:7] = ["PROBE"]
        head.append("IN FLIGHT")
    rows, kinds = [head], []
    for g in status["gpus"]:
        probe = g["probe"]
        probe_text = (
            "off" if not probe["enabled"]
            else NA if probe["latency_ms"] is None
            else f"{probe['latency_ms']:.2f}ms"
        )  # fmt: skip
        gate, inflight = _request_gate(g)
        slo = g["online_slo"]["state"]
        row = [str(g["index"]), _model(g) if wide else clip(_model(g), MODEL_CHARS),
               f"{_gib(g['mem_used_bytes'])}/{_gib(g['mem_total_bytes'])}",
               _pct(g["gpu_util_pct"]), _mps(g, simulated),
               slo if wide or slo != "no_online_clients" else "-",
               f"{g['client_slots_used']}/{g['client_slots_max']}", _gate(g),
               _pct(g["offline_sm_pct"]) + _equal_priority(g), gate]  # fmt: skip
        if wide:
            row[2:2] = [g["uuid"]]
            row[7:7] = [probe_text]
            row.append(inflight)
        rows.append(row)
        off = 8 if wide else 7
        kind = [""] * 4 + [_kind(str(g["mps_state"] or ""))] + [_kind(slo)]
        kind += [""] * (off - 6) + [_kind(_gate(g).split()[0])]
        kinds.append(kind)
        if g["error"]:
            rows.append(["", f"error: {g['error']}"] + [""] * (len(head) - 2))
            kinds.append(["", "bad"])
        if (drain := g.get("drain")) is not None:  # absent from an older daemon's status
            why = f": {drain['reason']}" if drain["reason"] else ""
            note = f"draining (by {drain['by']}{why}): nothing new starts here"
            rows.append(["", note] + [""] * (len(head) - 2))
            kinds.append(["", "warn"])
    return rows, kinds


def render_status(
    status: dict[str, Any], *, wide: bool = False, colour: bool = False, now: float | None = None
) -> str:
    """The human ``status`` view: one row per GPU, then one per client."""
    simulated = bool(status["daemon"].get("simulated"))
    rows, kinds = _gpu_rows(status, wide)
    node = " (simulated GPUs)" if simulated else ""
    head = f"gpushare {status['daemon']['version']}{node}: {status['daemon']['summary']}"
    if refused := status["daemon"].get("trust_refusals"):
        # gpushare.trust: a file another user could change was not used; doctor names the fix.
        counts = ", ".join(f"{role} ({n}x)" for role, n in sorted(refused.items()))
        head += f"\nrefused as not trusted: {counts}; `gpushare doctor` names the fix"
    whys = [w if wide else fit(w) for w in (_why(g) for g in status["gpus"]) if w]
    gpus = _table(rows, painter(colour), kinds) + ("\n" + "\n".join(whys) if whys else "")
    clients = render_clients(status["clients"], wide=wide, colour=colour, now=now)
    return "\n".join([head, "", gpus, "", clients])


def mps_down(status: dict[str, Any]) -> bool:
    """Whether a shared GPU's MPS is down or faulted (``gpushare status`` then exits 1)."""
    return any(g["shared"] and g["mps_state"] in ("down", "fault") for g in status["gpus"])
