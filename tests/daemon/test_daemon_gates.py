"""The daemon and request gating: status shows why a gate is shut and the fraction thawed, the
gates hear of a client told to go at the next tick, and how a gate's delay is logged.

An in-process daemon driven tick by tick (tests/support/actions_daemon.py).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from structlog.testing import capture_logs

from gpushare.daemon.core import Daemon
from gpushare.model import SetDuty, SetGating
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import BUSY, GPU0, ROOT, _submit


def test_status_shows_gate_why_and_thawed_fraction(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    d, policy, _ = env
    r = _submit(d, BUSY)
    web = _submit(d, ["sleep", "30"], cls="online", slo_p99_ms=40.0)
    policy.pending = [SetDuty(GPU0, 0.5, "online burst: duty 0.5")]
    d.run(max_ticks=12)
    st = d.api.status(ROOT, {"gpu": "0"})
    assert st["schema_version"] == 2
    gate = st["gpus"][0]["gate"]
    assert (gate["state"], gate["duty"]) == ("cycling", 0.5)
    assert gate["last_action"]["kind"] == "set_duty"
    assert gate["last_action"]["reason"] == "online burst: duty 0.5"
    assert 0 <= gate["last_action"]["age_s"] < 5
    by_id = {c["id"]: c for c in st["clients"]}
    off = by_id[r["client_id"]]["offline"]
    # Thawed for half of each period after the first (a loaded machine stretches the thawed part
    # more often than the frozen one: the freeze at the edge is what runs late).
    assert 0.3 < off["thawed_ratio_1m"] < 0.9
    assert off["thawed_s"] > 0
    assert off["evictions"] == 0
    assert by_id[r["client_id"]]["latency"] is None
    lat = by_id[web["client_id"]]["latency"]
    assert by_id[web["client_id"]]["offline"] is None
    # No reports and no probe on this node: unknown, and it says why.
    assert (lat["p99_ms"], lat["ratio"], lat["source"]) == (None, None, None)
    assert (lat["slo_p99_ms"], lat["reason"]) == (40.0, "no latency reports")
    policy.pending = [SetDuty(GPU0, 0.0, "SLO violated")]
    d.run(max_ticks=1)
    gate = d.api.status(ROOT, {"gpu": "0"})["gpus"][0]["gate"]
    assert (gate["state"], gate["last_action"]["reason"]) == ("closed", "SLO violated")


def test_the_gates_hear_at_the_next_tick_of_a_client_told_to_go_without_a_record_change(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    # A tick with no record changed reuses the last tick's online and gated clients; a cancel
    # changes no record (the client runs out its grace), so that reuse must still see it.
    d, _, _ = env
    stubborn = [sys.executable, "-c", (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "while True: time.sleep(0.01)\n"
    )]  # fmt: skip
    cid = _submit(d, stubborn)["client_id"]
    time.sleep(0.3)  # its handler is installed
    seen: list[dict[str, list[str]]] = []
    real = d.state.gate.update_clients

    def spy(online: Any, gated: Any, now: float, online_pids: Any = None) -> None:
        seen.append({g: list(ids) for g, ids in gated.items()})
        real(online, gated, now, online_pids)

    d.state.gate.update_clients = spy  # type: ignore[method-assign]
    d.run(max_ticks=2)
    assert seen[-1] == {GPU0: [cid]}
    before = d.registry.get(cid)
    d.api.cancel(ROOT, {"client_id": cid})
    d.run(max_ticks=1)
    assert d.registry.get(cid) is before  # no record changed ...
    assert seen[-1] == {}  # ... and the client going away is no longer gated


def test_a_gate_delay_creeping_up_is_logged_at_debug_and_its_steps_at_info(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
) -> None:
    # Held to the room the SLO leaves, the delay moves a few percent every raise; operators see
    # gating turned on or off and steps of 25 % or more, and the rest at debug.
    d, _, _ = env
    delays = [0.0, 0.002, 0.00208, 0.00215, 0.0026, 0.0027, 0.0, 0.0]
    ons = [True, True, True, True, True, True, True, False]
    with capture_logs() as logs:
        for i, (on, delay) in enumerate(zip(ons, delays, strict=True)):
            d.loop.apply(SetGating(GPU0, on, "test", delay), float(i))
    got = [(e["log_level"], e["delay_s"], e["on"]) for e in logs if e["event"] == "gating_set"]
    assert got == [
        ("info", 0.0, True),  # gating on
        ("info", 0.002, True),  # a delay at all
        ("debug", 0.00208, True),
        ("debug", 0.00215, True),
        ("info", 0.0026, True),  # 30 % over the last one logged
        ("debug", 0.0027, True),
        ("info", 0.0, True),  # the delay dropped to 0
        ("info", 0.0, False),  # gating off
    ]
    assert d.state.gate.view(GPU0, 7.0).enabled is False  # every one was applied all the same
