"""Request gating end to end below the daemon: gpushare.client's request boundaries over a real
Unix datagram socket, the latency receiver with kernel-verified credentials, the in-flight
rejections (end without start, not an online client, flood, malformed, bad gauge), and the
Gatekeeper freezing real cgroups without waiting for a control tick."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from gpushare import client, paths
from gpushare.config import GateConfig
from gpushare.daemon.gating import Gatekeeper
from gpushare.daemon.opstats import OpStats
from gpushare.latency.datagrams import decode_message
from gpushare.latency.inflight import (
    GaugePoller,
    Rejections,
    SenderLimiter,
    parse_gauge,
    parse_inflight_from,
)
from gpushare.latency.p99 import P99Tracker
from gpushare.latency.receiver import LatencyReceiver, Sender
from gpushare.node.cgroups.pauser import CgroupPauser
from tests.fakes.fake_pauser import FakePauser

CFG = GateConfig(hold_s=0.002, inflight_timeout_s=0.5, max_datagrams_per_s=1000)
GPU = "GPU-0"


def wait_for(pred, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.002)
    raise AssertionError("condition not met in time")


@pytest.fixture
def keeper() -> Iterator[tuple[Gatekeeper, FakePauser]]:
    pauser = FakePauser()
    gk = Gatekeeper(CFG, pauser)
    gk.update_clients({"web": GPU}, {GPU: ["train-1", "train-2"]}, 0.0)
    gk.set_enabled(GPU, True, 0.0)
    gk.start()
    yield gk, pauser
    gk.close()


# --------------------------------------------------------------------------- wire format


def test_boundary_datagrams_decode_and_bad_ones_are_refused() -> None:
    msg = decode_message(client.encode_inflight("web", 3))
    assert (msg.claimed_id, msg.latencies_s, msg.inflight) == ("web", (), 3)
    assert decode_message(client.encode_latency("web", [0.01])).inflight is None
    for bad, why in (
        (b'{"v":1,"id":"web"}', "neither latency"),
        (b'{"v":1,"n":-1}', "requests in flight must be"),
        (b'{"v":1,"n":1.5}', "requests in flight must be"),
        (b'{"v":1,"n":true}', "requests in flight must be"),
        (b'{"v":1,"n":10000001}', "requests in flight must be"),
        (b'{"v":2,"n":1}', "not a version 1"),
        (b"\xff", "not JSON"),
    ):
        with pytest.raises(ValueError, match=why):
            decode_message(bad)


def test_client_sends_edges_at_once_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "lat.sock"
    monkeypatch.setenv(paths.ENV_LATENCY_SOCKET, str(path))
    monkeypatch.setenv(paths.ENV_CLIENT_ID, "web")
    # No daemon: nothing raises, the boundaries are counted as dropped.
    dropped = client.request_boundaries_dropped()
    with client.request():
        assert client.requests_in_flight() == 1
    assert client.requests_in_flight() == 0
    assert client.request_boundaries_dropped() == dropped + 2
    client.request_ended()  # an end without a start: not sent, counted
    assert client.request_boundaries_dropped() == dropped + 3

    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(path))
    rx.settimeout(2.0)
    try:
        client.request_started()
        assert json.loads(rx.recv(4096)) == {"v": 1, "id": "web", "n": 1}
        client.request_started()  # 1 -> 2 within the flush interval: not sent
        client.request_ended()
        client.request_ended()  # -> 0: an edge, sent at once
        assert json.loads(rx.recv(4096))["n"] == 0
        rx.setblocking(False)
        with pytest.raises(BlockingIOError):
            rx.recv(4096)
    finally:
        rx.close()


# --------------------------------------------------------------------------- the gatekeeper


def test_a_request_start_freezes_gated_clients_and_the_end_thaws_after_the_hold(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    now = time.monotonic()
    assert gk.on_inflight("web", 100, 1, now) is None
    # Frozen before on_inflight returned: no tick, no timer.
    assert pauser.frozen == {"train-1", "train-2"}
    view = gk.view(GPU, now)
    assert view.closed and view.inflight == 1 and view.signalled_clients == 1
    assert gk.on_inflight("web", 100, 0, time.monotonic()) is None
    t_end = time.monotonic()
    wait_for(lambda: not pauser.frozen)
    assert time.monotonic() - t_end >= CFG.hold_s * 0.9
    assert not gk.view(GPU, time.monotonic()).closed


def test_with_a_delay_the_timer_thread_closes_the_gate_once_the_request_lasted_it(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    delay = 0.05
    gk.set_enabled(GPU, True, time.monotonic(), delay_s=delay)
    t0 = time.monotonic()
    assert gk.on_inflight("web", 100, 1, t0) is None
    # Not frozen by the datagram: offline work runs beside the first `delay` of the request...
    assert not pauser.frozen and not gk.view(GPU, t0).closed
    assert gk.view(GPU, t0).delay_s == delay
    # ...and the gate timer freezes it once the request has lasted the delay, with no signal.
    wait_for(lambda: pauser.frozen == {"train-1", "train-2"}, timeout_s=2.0)
    assert time.monotonic() - t0 >= delay * 0.9
    assert gk.view(GPU, time.monotonic()).closed
    gk.on_inflight("web", 100, 0, time.monotonic())
    wait_for(lambda: not pauser.frozen)
    # A request shorter than the delay never freezes anything.
    pauser.calls.clear()
    gk.on_inflight("web", 100, 1, time.monotonic())
    gk.on_inflight("web", 100, 0, time.monotonic())
    time.sleep(delay * 2)
    assert not pauser.frozen and not any(frozen for _, frozen in pauser.calls)


def test_a_shorter_delay_set_mid_request_closes_the_gate_on_the_new_time(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    gk.set_enabled(GPU, True, time.monotonic(), delay_s=30.0)
    gk.on_inflight("web", 100, 1, time.monotonic())
    time.sleep(0.02)
    assert not pauser.frozen
    rearmed: list[float | None] = []
    gk.on_rearm = rearmed.append
    # The controller cuts the delay (a breach): the request has lasted the new one already.
    gk.set_enabled(GPU, True, time.monotonic(), delay_s=0.01)
    wait_for(lambda: bool(pauser.frozen), timeout_s=1.0)
    assert rearmed, "a runner without the timer thread is told when to poll"


def test_rejections_end_without_start_and_not_an_online_client(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    now = time.monotonic()
    assert gk.on_inflight("web", 100, 0, now) == "request end without a start"
    assert "not a live online client" in (gk.on_inflight("train-1", 200, 1, now) or "")
    assert "not a live online client" in (gk.on_inflight("nobody", 300, 1, now) or "")
    assert not pauser.frozen


def test_a_client_dying_with_requests_in_flight_frees_the_gate(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    gk.on_inflight("web", 100, 4, time.monotonic())
    assert pauser.frozen
    gk.forget("web")  # the daemon saw it exit
    wait_for(lambda: not pauser.frozen, timeout_s=1.0)


def test_a_silent_source_times_out_without_any_tick(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    t0 = time.monotonic()
    gk.on_inflight("web", 100, 1, t0)  # and then never a word again (a hung process)
    wait_for(lambda: not pauser.frozen, timeout_s=3.0)
    assert time.monotonic() - t0 >= CFG.inflight_timeout_s * 0.9


def test_the_duty_cycle_and_the_gate_never_undo_each_other(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    gk.arbiter.set(["train-1"], "duty", True)
    gk.on_inflight("web", 100, 1, time.monotonic())
    gk.arbiter.set(["train-2"], "duty", False)  # the duty says run: the closed gate keeps it frozen
    assert pauser.frozen == {"train-1", "train-2"}
    gk.on_inflight("web", 100, 0, time.monotonic())
    wait_for(lambda: pauser.frozen == {"train-1"})  # the gate opens; the duty still holds one
    gk.arbiter.set(["train-1"], "duty", False)
    assert not pauser.frozen


def test_gating_off_never_freezes_and_turning_it_off_thaws(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    gk.on_inflight("web", 100, 1, time.monotonic())
    assert pauser.frozen
    gk.set_enabled(GPU, False, time.monotonic())
    assert not pauser.frozen
    gk.on_inflight("web", 101, 2, time.monotonic())
    assert not pauser.frozen
    assert gk.view(GPU, time.monotonic()).inflight == 3


def test_an_offline_client_joining_a_closed_gate_is_frozen_at_once(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    gk.on_inflight("web", 100, 1, time.monotonic())
    gk.update_clients({"web": GPU}, {GPU: ["train-1", "train-2", "train-3"]}, time.monotonic())
    assert "train-3" in pauser.frozen
    # An online client the daemon no longer lists (it exited) stops holding the gate.
    gk.update_clients({}, {GPU: ["train-1", "train-2", "train-3"]}, time.monotonic())
    wait_for(lambda: not pauser.frozen)


# --------------------------------------------------------------------------- over the socket


@pytest.fixture
def receiver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keeper: tuple[Gatekeeper, FakePauser]
) -> Iterator[tuple[LatencyReceiver, Rejections]]:
    gk, _ = keeper
    path = tmp_path / "lat.sock"
    monkeypatch.setenv(paths.ENV_LATENCY_SOCKET, str(path))
    monkeypatch.setenv(paths.ENV_CLIENT_ID, "")
    rejections = Rejections()
    limiter = SenderLimiter(CFG.max_datagrams_per_s)
    me = os.getpid()

    def identify(sender: Sender) -> str | None:
        # The kernel-verified pid, as the daemon's verified_identify does: only this test
        # process is the online client "web".
        return "web" if sender.pid == me else None

    rx = LatencyReceiver(
        path,
        P99Tracker(2.0, 1),
        identify=identify,
        on_inflight=gk.on_inflight,
        allow=limiter.allow,
        reject=rejections.reject,
    )
    rx.start()
    yield rx, rejections
    rx.close()


def test_request_boundaries_reach_the_gate_with_verified_credentials(
    receiver: tuple[LatencyReceiver, Rejections], keeper: tuple[Gatekeeper, FakePauser]
) -> None:
    rx, rejections = receiver
    _, pauser = keeper
    client.request_started()
    wait_for(lambda: pauser.frozen == {"train-1", "train-2"})
    client.request_ended()
    wait_for(lambda: not pauser.frozen)
    assert rejections.total() == 0
    # Another process, claiming to be "web", is not web: the kernel says who sent it.
    code = "from gpushare import client; client.request_started(); client.request_ended()"
    env = {**os.environ, paths.ENV_CLIENT_ID: "web"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=30)
    wait_for(lambda: rx.rejected >= 2)
    assert rejections.counts == {"sender is not a client of gpushare": 2}
    assert not pauser.frozen


def test_a_flood_is_rejected_unread_and_the_gate_still_works(
    receiver: tuple[LatencyReceiver, Rejections], keeper: tuple[Gatekeeper, FakePauser]
) -> None:
    rx, rejections = receiver
    _, pauser = keeper
    # 10^5 datagrams a second from one process for 0.3 s (the kernel drops what the queue
    # cannot hold; the rest are rejected before parsing, over the per-sender rate).
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tx.setblocking(False)
    junk = b'{"v":1,"id":"web","n":0}'
    sent = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.3:
        for _ in range(100):
            try:
                tx.sendto(junk, str(rx.path))
                sent += 1
            except BlockingIOError:
                pass
        time.sleep(0.001)
    tx.close()
    wait_for(lambda: rejections.counts.get("flood: over the per-sender datagram rate", 0) > 0)
    accepted_ends = rejections.counts.get("request end without a start", 0)
    assert accepted_ends <= CFG.max_datagrams_per_s * 0.5 + CFG.max_datagrams_per_s / 10
    # After the flood (its bucket refills), the gate still answers this process.
    time.sleep(0.2)
    client.request_started()
    wait_for(lambda: bool(pauser.frozen))
    client.request_ended()
    wait_for(lambda: not pauser.frozen)


def test_malformed_datagrams_are_counted(
    receiver: tuple[LatencyReceiver, Rejections],
) -> None:
    rx, rejections = receiver
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for bad in (b"nope", b'{"v":1,"n":-3}', b'{"v":1,"n":"1"}'):
        tx.sendto(bad, str(rx.path))
    tx.close()
    wait_for(lambda: rejections.counts.get("malformed datagram", 0) == 3)


# --------------------------------------------------------------------------- the gauge


def test_inflight_from_spec_and_gauge_parsing() -> None:
    src = parse_inflight_from("prometheus:http://127.0.0.1:8000/metrics#http_requests_in_flight")
    assert (src.port, src.metric) == (8000, "http_requests_in_flight")
    for spec, why in (
        ("prometheus:http://127.0.0.1:8000/metrics", "gauge's name"),
        ("prometheus:http://10.1.1.1:8000/metrics#g", "on this host"),
        ("http://127.0.0.1/metrics#g", "must start with"),
        ("sglang:http://127.0.0.1/metrics#g", "must start with 'prometheus:'"),
        ("prometheus:http://127.0.0.1/metrics#9g", "not a Prometheus metric name"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_inflight_from(spec)
    text = "# TYPE inflight gauge\n" 'inflight{handler="a"} 2\ninflight{handler="b"} 1\nother 7\n'
    assert parse_gauge(text, "inflight") == 3
    assert parse_gauge("inflight 0.2\n", "inflight") == 1
    for bad, why in (
        ("inflight -1\n", "not a count"),
        ("inflight NaN\n", "not a count"),
        ("other 1\n", "no gauge"),
        ("inflight 1e12\n", "over"),
        ("{{{", "."),
    ):
        with pytest.raises(ValueError, match=why):
            parse_gauge(bad, "inflight")


def test_gauge_polls_feed_the_gate_and_a_malformed_gauge_is_rejected(
    keeper: tuple[Gatekeeper, FakePauser],
) -> None:
    gk, pauser = keeper
    body = {"text": "inflight 2\n"}
    rejections = Rejections()
    poller = GaugePoller(0.01, gk.on_gauge, rejections, fetch=lambda _src, _t: body["text"])
    poller.add("web", "prometheus:http://127.0.0.1:9/metrics#inflight")
    poller.poll_all()
    assert pauser.frozen and gk.view(GPU, time.monotonic()).inflight == 2
    body["text"] = "inflight 0\n"
    poller.poll_all()
    wait_for(lambda: not pauser.frozen)
    body["text"] = "inflight oops\n"
    poller.poll_all()
    assert rejections.counts == {"bad gauge": 1}
    assert "web" in poller.last_error and not pauser.frozen


# --------------------------------------------------------------------------- real cgroups


@pytest.fixture
def cg_pauser() -> Iterator[CgroupPauser]:
    if (reason := cgroup_skip_reason()) is not None:
        pytest.skip(reason)
    base = unique_base("gpushare-gate-test")
    try:
        yield CgroupPauser(base)
    finally:
        remove_tree(base)


def test_the_fast_path_freezes_real_cgroups(cg_pauser: CgroupPauser) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(2)
    ]
    gk = Gatekeeper(CFG, cg_pauser)
    try:
        for i, p in enumerate(procs):
            cg_pauser.attach(f"off-{i}", p.pid)
        gk.update_clients({"web": GPU}, {GPU: ["off-0", "off-1"]}, time.monotonic())
        gk.set_enabled(GPU, True, time.monotonic())
        gk.start()
        gk.on_inflight("web", 1, 1, time.monotonic())
        # The write is done; the kernel confirms each task stopped within a little while.
        for cid in ("off-0", "off-1"):
            assert (cg_pauser.path(cid) / "cgroup.freeze").read_text().strip() == "1"
        wait_for(lambda: all(cg_pauser.is_frozen(c) for c in ("off-0", "off-1")))
        gk.on_inflight("web", 1, 0, time.monotonic())
        wait_for(lambda: not any(cg_pauser.is_frozen(c) for c in ("off-0", "off-1")))
    finally:
        gk.close()
        for p in procs:
            p.kill()
            p.wait()
        for cid in ("off-0", "off-1"):
            cg_pauser.release(cid)


def test_an_online_client_the_last_tick_did_not_list_is_asked_for() -> None:
    pauser = FakePauser()
    known = {"new-web": GPU}
    gk = Gatekeeper(CFG, pauser, online_gpu=known.get)
    try:
        gk.update_clients({}, {GPU: ["train-1"]}, time.monotonic())
        gk.set_enabled(GPU, True, time.monotonic())
        # Started after the last tick: its first request is not refused.
        assert gk.on_inflight("new-web", 5, 1, time.monotonic()) is None
        assert pauser.frozen == {"train-1"}
        assert gk.on_inflight("stranger", 6, 1, time.monotonic()) is not None
    finally:
        gk.close()


def test_the_thawed_time_operators_see_counts_request_gate_freezes_too() -> None:
    """Every real freeze and thaw reaches the operators' thaw log: the gate's as the duty's."""
    ops = OpStats()
    clock = [100.0]

    def edge(ids: Sequence[str], frozen: bool, now: float) -> None:
        for client_id in ids:
            ops.paused(client_id, frozen, now)

    gk = Gatekeeper(CFG, FakePauser(), clock=lambda: clock[0], on_edge=edge)
    gk.update_clients({"web": GPU}, {GPU: ["train-1"]}, clock[0])
    gk.set_enabled(GPU, True, clock[0])
    ops.paused("train-1", False, clock[0])  # tracked, thawed, from t=100
    clock[0] = 110.0
    assert gk.on_inflight("web", 100, 1, clock[0]) is None  # a request: the gate freezes train-1
    clock[0] = 140.0
    gk.arbiter.set(["train-1"], "duty", True)  # no edge: already frozen by the gate
    gk.on_inflight("web", 100, 0, clock[0])  # the request ends; the duty still holds it
    clock[0] = 150.0
    gk.poll(clock[0])  # past the hold: the gate opens, the duty keeps it frozen
    gk.arbiter.set(["train-1"], "duty", False)  # now it thaws, at t=150
    clock[0] = 160.0
    # Thawed 100-110 and 150-160 of the window: 20 s of 60.
    assert ops.thaw.total_s("train-1", clock[0]) == pytest.approx(20.0, abs=1.0)
    assert ops.thaw.thawed("train-1") is True


def test_a_tick_with_nothing_changed_still_keeps_an_idle_gates_busy_history() -> None:
    # The tick skips a settled gate (daemon/gating.py): the skip must end when a busy-time
    # checkpoint is due, or the busy fraction would lose its history after busy_window.
    t = [0.0]
    cfg = GateConfig(hold_s=0.002, inflight_timeout_s=0.5, busy_window_s=3.0)
    gk = Gatekeeper(cfg, FakePauser(), clock=lambda: t[0])
    try:
        while t[0] < cfg.busy_window_s + 2.0:
            gk.update_clients({"web": GPU}, {GPU: ["train-1"]}, t[0])
            t[0] += 0.1
        assert gk.view(GPU, t[0]).busy_fraction == 0.0
    finally:
        gk.close()


def test_a_tick_after_forget_lists_the_client_again_as_the_registry_does() -> None:
    # forget() changes the kept client sets between ticks: the next tick with the registry's
    # unchanged lists must restore them (compared with what is kept, not with the last call).
    pauser = FakePauser()
    gk = Gatekeeper(CFG, pauser)
    try:
        now = time.monotonic()
        gk.update_clients({"web": GPU}, {GPU: ["train-1", "train-2"]}, now)
        gk.set_enabled(GPU, True, now)
        gk.forget("train-1")
        gk.forget("web")
        gk.update_clients({"web": GPU}, {GPU: ["train-1", "train-2"]}, time.monotonic())
        assert gk.on_inflight("web", 100, 1, time.monotonic()) is None
        assert pauser.frozen == {"train-1", "train-2"}
    finally:
        gk.close()


def test_a_gang_stays_frozen_while_the_gate_of_any_of_its_gpus_is_closed() -> None:
    # A gang (submit --gpus) is gated by every GPU it uses: GPU 0's gate opening must not thaw it
    # while GPU 1's service still has a request in flight (its ranks would run against a frozen
    # peer's GPU and the service's request would share GPU 1 with it).
    pauser = FakePauser()
    gk = Gatekeeper(CFG, pauser)
    gk.update_clients({"web0": "GPU-0", "web1": "GPU-1"},
                      {"GPU-0": ["gang", "solo"], "GPU-1": ["gang"]}, 0.0)  # fmt: skip
    for gpu in ("GPU-0", "GPU-1"):
        gk.set_enabled(gpu, True, 0.0)
    gk.start()
    try:
        assert gk.on_inflight("web1", 101, 1, time.monotonic()) is None
        assert gk.on_inflight("web0", 100, 1, time.monotonic()) is None
        assert pauser.frozen == {"gang", "solo"}
        assert gk.on_inflight("web0", 100, 0, time.monotonic()) is None
        wait_for(lambda: "solo" not in pauser.frozen)  # GPU 0's gate opened after its hold
        time.sleep(CFG.hold_s * 5)
        assert pauser.frozen == {"gang"}, "one GPU's gate thawed a gang another GPU's holds"
        assert gk.on_inflight("web1", 101, 0, time.monotonic()) is None
        wait_for(lambda: not pauser.frozen)
    finally:
        gk.close()
