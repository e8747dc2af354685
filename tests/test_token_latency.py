"""An LLM server's token timings (issue 33): report_ttft/report_tpot over the real latency socket,
the bounded datagram, the windows sized for LLM request rates, and the controller's one signal."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from gpushare import client, config, paths
from gpushare.control.signals import client_signal, online_signals
from gpushare.latency.app import AppLatency
from gpushare.latency.datagrams import MAX_VALUES, DatagramError, decode_message
from gpushare.latency.p99 import P99Tracker, TokenTrackers
from gpushare.latency.receiver import LatencyReceiver, verified_identify
from gpushare.model import ClientClass, ClientState, ClientView, Limits


def wait_for(pred, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met in time")


@pytest.fixture
def sock_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "latency.sock"
    monkeypatch.setenv(paths.ENV_LATENCY_SOCKET, str(path))
    monkeypatch.setenv(paths.ENV_CLIENT_ID, "llm-1")
    return path


def _receiver(path: Path, tokens: TokenTrackers | None) -> LatencyReceiver:
    r = LatencyReceiver(path, P99Tracker(window_s=30, min_samples=20), tokens=tokens)
    r.start()
    return r


# ---------------------------------------------------------------------------- the datagram


def test_token_datagram_decodes_and_keeps_one_bound_over_all_kinds() -> None:
    msg = decode_message(b'{"v":1,"id":"x","t":[0.5],"p":[0.02,0.03]}')
    assert (msg.latencies_s, msg.ttft_s, msg.tpot_s) == ((), (0.5,), (0.02, 0.03))
    # The bound on values counts every kind together, so "t" and "p" do not multiply it.
    half = [0.01] * (MAX_VALUES // 2 + 1)
    with pytest.raises(DatagramError) as exc:
        decode_message(json.dumps({"v": 1, "id": "x", "t": half, "p": half}).encode())
    assert exc.value.reason == "too many values"
    for bad in ('"t":[-1]', '"p":[true]', '"t":["1"]', '"p":[1e999]'):
        with pytest.raises(DatagramError) as exc:
            decode_message(('{"v":1,"id":"x",' + bad + "}").encode())
        assert exc.value.reason in ("bad latency", "number too long"), bad


def test_report_ttft_and_tpot_never_block_or_raise_without_a_daemon(sock_path: Path) -> None:
    before = client.latency_reports_dropped()
    for _ in range(100):
        client.report_ttft(0.4)
        client.report_tpot(0.02)
    client.report_tpot(float("nan"))
    client.report_ttft("soon")  # type: ignore[arg-type]
    client.flush_latency()
    assert client.latency_reports_dropped() - before == 202


# ---------------------------------------------------------------------------- the receiver


def test_token_reports_reach_their_windows_over_the_real_socket(sock_path: Path) -> None:
    tokens = TokenTrackers(min_samples=20)
    r = _receiver(sock_path, tokens)
    try:
        for i in range(1, 31):
            client.report_ttft(0.1 * i)  # 0.1 .. 3.0 s
        for i in range(1, 201):
            client.report_tpot(i / 10_000)  # 0.1 .. 20 ms
        client.report_latency(0.05)
        client.flush_latency()
        wait_for(lambda: r.accepted == 231)
        now = time.monotonic()
        ttft, tpot = tokens.p99s("llm-1", now)
        assert ttft is not None and tpot is not None
        assert (ttft.samples, ttft.p99_ms) == (30, pytest.approx(3000.0))
        assert (tpot.samples, tpot.p99_ms) == (200, pytest.approx(19.8))
        assert len(r.tracker.clients()) == 1  # the request latency went where it always did
        assert r.drops == {}
    finally:
        r.close()


def test_a_receiver_without_token_windows_counts_what_it_drops(sock_path: Path) -> None:
    r = _receiver(sock_path, None)
    try:
        client.report_ttft(0.4)
        client.flush_latency()
        wait_for(lambda: r.rejected == 1)
        assert r.drops == {"token timings not served here": 1}
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with sender:
            sender.sendto(b'{"v":1,"id":"llm-1","t":[-3]}', str(sock_path))
            sender.sendto(b'{"v":1,"id":"llm-1","q":[1]}', str(sock_path))
        wait_for(lambda: r.rejected == 3)
        assert r.drops["malformed: bad latency"] == 1
        assert r.drops["malformed: empty"] == 1  # an unknown kind alone is an empty datagram
    finally:
        r.close()


# ---------------------------------------------------------------------------- the windows


def test_the_ttft_window_fills_at_llm_request_rates_where_the_request_window_never_does() -> None:
    """The finding: at 0.2 requests/s the 2 s, 20-sample window never has a p99."""
    request_window = P99Tracker(window_s=2.0, min_samples=20)
    tokens = TokenTrackers(min_samples=20)
    t = 1000.0
    for i in range(30):  # one request every 5 s for 150 s
        t += 5.0
        request_window.add("llm", 0.5 + i / 100, t)
        tokens.ttft.add("llm", 0.5 + i / 100, t)
    assert request_window.p99("llm", t).p99_ms is None
    ttft, _ = tokens.p99s("llm", t)
    assert ttft is not None and ttft.p99_ms is not None
    assert ttft.samples == 25  # 120 s at 0.2/s, both ends included: the last two minutes
    # A fast server's window is the last 200 first tokens, a few seconds, not two minutes.
    for i in range(1000):
        tokens.ttft.add("fast", 0.1, t + i / 100)
    assert tokens.ttft.p99("fast", t + 10).samples == 200


def test_the_default_tpot_window_holds_one_report_per_request_at_llm_rates() -> None:
    """report_tpot's advice is one TPOT per request (its mean): at 0.2 requests/s the default
    window (``[latency] tpot_window``, from the config's defaults) must hold ``min_samples`` of
    them, and a per-token reporter's window stays bounded by count."""
    lat = config.loads("").latency
    tokens = TokenTrackers(
        lat.min_samples, ttft_window_s=lat.ttft_window_s, ttft_max_samples=lat.ttft_max_samples,
        tpot_window_s=lat.tpot_window_s, tpot_max_samples=lat.tpot_max_samples,
    )  # fmt: skip
    t = 1000.0
    for i in range(30):  # one request every 5 s for 150 s
        t += 5.0
        tokens.tpot.add("llm", 0.030 + i / 1000, t)
    _, tpot = tokens.p99s("llm", t)
    assert tpot is not None and tpot.p99_ms is not None and tpot.samples == 25
    for i in range(20_000):  # 200 gaps a second for 100 s
        tokens.tpot.add("per-token", 0.02, t + i / 200)
    assert tokens.tpot.p99("per-token", t + 100).samples == lat.tpot_max_samples


def test_app_latency_reports_a_token_only_client() -> None:
    app = AppLatency(2.0, 20, 1.0, clock=lambda: 50.0)
    app.tokens.tpot.add_many("llm", [(49.0, 0.01)] * 30)
    got = app.p99s()["llm"]
    assert got.p99_ms is None and got.ttft is None
    assert got.tpot is not None and got.tpot.p99_ms == pytest.approx(10.0)
    app.forget("llm")
    assert app.p99s() == {}


# ---------------------------------------------------------------------------- the signal


def _view(**kw: object) -> ClientView:
    return ClientView(
        client_id="llm", cls=ClientClass.ONLINE, state=ClientState.RUNNING,
        limits=Limits(100.0, None, 0), uid=os.getuid(), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def test_the_controller_reads_the_worst_of_a_services_slos() -> None:
    llm = _view(slo_ttft_p99_ms=500.0, ttft_p99_ms=400.0, slo_tpot_p99_ms=50.0, tpot_p99_ms=75.0)
    assert client_signal(llm) == (pytest.approx(1.5), "TPOT p99 75.0ms")
    ttft_bad = _view(slo_ttft_p99_ms=500.0, ttft_p99_ms=1000.0, slo_tpot_p99_ms=50.0)
    assert client_signal(ttft_bad) == (pytest.approx(2.0), "TTFT p99 1000.0ms")
    # A declared SLO without a p99 yet, and a p99 without an SLO, give no signal.
    assert client_signal(_view(slo_ttft_p99_ms=500.0, tpot_p99_ms=9.0)) is None
    # A request SLO alone reads as before.
    assert client_signal(_view(slo_p99_ms=40.0, p99_ms=50.0)) == (1.25, "p99 50.0ms")


def test_online_signals_of_an_llm_server(make_observation) -> None:  # type: ignore[no-untyped-def]
    obs = make_observation(
        _view(slo_ttft_p99_ms=500.0, ttft_p99_ms=600.0, slo_tpot_p99_ms=50.0, tpot_p99_ms=40.0)
    )
    sig = online_signals(obs, probe_slo_ratio=2.0)
    assert sig.app_worst == pytest.approx(1.2)
    assert sig.app_complete
    assert sig.worst_source == "client llm TTFT p99 600.0ms"


@pytest.fixture
def make_observation() -> object:
    from gpushare.model import GpuSample, MpsState, Observation, ProbeReading

    def make(view: ClientView) -> Observation:
        sample = GpuSample(uuid="GPU-x", index=0, name="fake")
        return Observation(
            gpu_uuid="GPU-x", gpu_index=0, sample=sample, probe=ProbeReading(reason="off"),
            clients=(view,), mps_state=MpsState.UP,
        )  # fmt: skip

    return make


# ---------------------------------------------------------------------------- who may report

NOBODY = 65534
SEND = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
    "s.sendto(sys.argv[2].encode(), sys.argv[1])\n"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to send as another uid")
def test_another_user_cannot_report_token_timings_for_a_client() -> None:
    """Credited as request latency is: a TTFT claiming another user's client is dropped."""
    from bench.support.daemon_helpers import python_for_others

    python = python_for_others()
    if python is None:
        pytest.skip("no Python interpreter other uids may execute")
    where = Path(tempfile.mkdtemp(prefix="gs-tok-"))  # pytest's tmp_path is closed to nobody
    where.chmod(0o755)
    path = where / "latency.sock"
    tokens = TokenTrackers(min_samples=1)
    owners = {"llm-1": 1000}
    r = LatencyReceiver(
        path, P99Tracker(2.0, 1), tokens=tokens,
        identify=verified_identify(lambda pid: None, owners.get),
    )  # fmt: skip
    r.start()
    try:
        forged = '{"v":1,"id":"llm-1","t":[99.0],"p":[99.0]}'
        subprocess.run(
            [python, "-c", SEND, str(path), forged], user=NOBODY, group=NOBODY,
            cwd="/", check=True, timeout=30,
        )  # fmt: skip
        wait_for(lambda: r.rejected == 1)
        assert tokens.clients() == set()
        assert r.drops == {"sender is not a client of gpushare": 1}
    finally:
        r.close()
        shutil.rmtree(where, ignore_errors=True)
