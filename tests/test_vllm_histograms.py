"""TTFT and TPOT read from a vLLM server's own histograms (`--latency-from vllm:URL`, issue 33):
a real HTTP endpoint serving vLLM's metric names and buckets, windowed p99s from bucket deltas."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gpushare.latency.app import AppLatency
from gpushare.latency.p99 import TokenTrackers
from gpushare.latency.prometheus import VLLM_TPOT_REQUEST, VLLM_TTFT, parse_latency_from
from gpushare.stats import bucket_quantile
from tests.support.exposition import ExpositionServer

# vLLM's buckets (vllm/v1/metrics/loggers.py at commit 005a810b..., as bench/llm_histograms.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)  # fmt: skip


class VllmServer:
    """Serves a registry holding vLLM's two histograms, by the name the given version uses."""

    def __init__(self, tpot_name: str, *also: str) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(VLLM_TTFT, "TTFT", ["model_name"], registry=self.registry,
                              buckets=TTFT_BUCKETS).labels("llama")  # fmt: skip
        self.tpot = Histogram(tpot_name, "TPOT", ["model_name"], registry=self.registry,
                              buckets=TPOT_BUCKETS).labels("llama")  # fmt: skip
        #: Further TPOT histograms the server exports beside it (newer vLLM exports two).
        self.also = [Histogram(n, "TPOT", ["model_name"], registry=self.registry,
                               buckets=TPOT_BUCKETS).labels("llama") for n in also]  # fmt: skip
        self._server = ExpositionServer(lambda: generate_latest(self.registry))
        self.url = self._server.url

    def close(self) -> None:
        self._server.close()


@pytest.fixture(params=["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"])
def vllm(request: pytest.FixtureRequest) -> Iterator[VllmServer]:
    s = VllmServer(request.param)
    yield s
    s.close()


def test_ttft_and_tpot_p99_from_bucket_deltas_of_a_live_vllm_endpoint(vllm: VllmServer) -> None:
    now = [1000.0]
    tokens = TokenTrackers(20, ttft_window_s=120.0, tpot_window_s=10.0)
    app = AppLatency(2.0, 20, 1.0, clock=lambda: now[0], tokens=tokens)
    app.add_prometheus("llm", f"vllm:{vllm.url}")
    for _ in range(50):  # before the first scrape: not in any window
        vllm.ttft.observe(9.0)
    app.scrape_all()
    ttfts = [0.3] * 29 + [0.9]
    tpots = [0.02] * 290 + [0.06] * 10
    for v in ttfts:
        vllm.ttft.observe(v)
    for v in tpots:
        vllm.tpot.observe(v)
    now[0] += 5.0
    app.scrape_all()
    got = app.p99s()["llm"]
    assert got.source == "prometheus" and got.p99_ms is None
    assert got.ttft is not None and got.tpot is not None
    assert (got.ttft.samples, got.tpot.samples) == (30, 300)
    # PromQL's interpolation inside the bucket the rank falls in: how exact that is depends on
    # the buckets (docs/controller.md); here it is what bucket_quantile gives on the deltas.
    want_ttft = bucket_quantile(0.99, {le: float(sum(v <= le for v in ttfts))
                                       for le in (*TTFT_BUCKETS, float("inf"))})  # fmt: skip
    assert got.ttft.p99_ms == pytest.approx(want_ttft * 1000)
    assert 750.0 < got.ttft.p99_ms <= 1000.0  # the true p99, 900 ms, lies in (0.75, 1.0]
    assert 50.0 < got.tpot.p99_ms <= 75.0  # the true p99, 60 ms, lies in (0.05, 0.075]
    # The TPOT window is 10 s: 20 s later with no new tokens it holds no increase.
    now[0] += 20.0
    app.scrape_all()
    later = app.p99s()["llm"]
    assert later.tpot is not None and later.tpot.p99_ms is None
    assert later.ttft is not None and later.ttft.p99_ms == pytest.approx(got.ttft.p99_ms)


def test_the_per_request_tpot_is_read_first_over_the_ttft_window() -> None:
    """vLLM with the per-request TPOT histogram (one mean per finished request, the TPOT a TPOT
    SLO is scored on) exports the inter-token one beside it: the per-request one is read, and over
    ``ttft_window``, since a ``tpot_window`` sized for per-token values holds too few of them."""
    server = VllmServer(VLLM_TPOT_REQUEST, "vllm:inter_token_latency_seconds")
    try:
        now = [1000.0]
        tokens = TokenTrackers(20, ttft_window_s=120.0, tpot_window_s=10.0)
        app = AppLatency(2.0, 20, 1.0, clock=lambda: now[0], tokens=tokens)
        app.add_prometheus("llm", f"vllm:{server.url}")
        app.scrape_all()
        for _ in range(30):
            server.tpot.observe(0.03)
        for _ in range(3000):  # the gaps: what a per-token reader would have seen instead
            server.also[0].observe(0.2)
        now[0] += 5.0
        app.scrape_all()
        got = app.p99s()["llm"].tpot
        assert got is not None and got.samples == 30
        assert got.p99_ms is not None and 25.0 < got.p99_ms <= 50.0
        now[0] += 60.0  # past tpot_window, within ttft_window: the 30 requests still count
        app.scrape_all()
        later = app.p99s()["llm"].tpot
        assert later is not None and later.p99_ms == pytest.approx(got.p99_ms)
    finally:
        server.close()


def test_a_vllm_spec_is_checked_and_an_endpoint_without_the_histograms_says_so() -> None:
    src = parse_latency_from("vllm:http://127.0.0.1:8000/metrics")
    assert src.server == "vllm" and (src.port, src.path) == (8000, "/metrics")
    for bad, says in (
        ("vllm:http://10.0.0.1/metrics", "must be on this host"),
        ("vllm:http://127.0.0.1/m#x", "no '#METRIC'"),
        ("vllm:ftp://[::1]/", "only plain http"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_latency_from(bad)
    app = AppLatency(2.0, 20, 1.0, fetch=lambda source, timeout_s: "# nothing here\n")
    app.add_prometheus("llm", "vllm:http://127.0.0.1:8000/metrics")
    app.scrape_all()
    got = app.p99s()["llm"]
    assert got.reason is not None and "no vLLM histograms" in got.reason


def test_an_endpoint_that_keeps_changing_its_tpot_name_gives_no_tpot_p99() -> None:
    """Counts of one histogram are no deltas of another: a server answering under the per-request
    name and the inter-token one by turns restarts its TPOT window each time, so it makes up no
    p99 from the mix (and, its own client's signal being all it reaches, harms no one else)."""
    names = iter([VLLM_TPOT_REQUEST, "vllm:inter_token_latency_seconds"] * 10)
    counts = iter(range(0, 2000, 100))

    def answer(source: object, timeout_s: float) -> str:
        name, n = next(names), next(counts)
        return f'{name}_bucket{{le="0.05"}} {n}\n{name}_bucket{{le="+Inf"}} {n}\n'

    now = [1000.0]
    tokens = TokenTrackers(20, ttft_window_s=120.0, tpot_window_s=120.0)
    app = AppLatency(2.0, 20, 1.0, clock=lambda: now[0], fetch=answer, tokens=tokens)
    app.add_prometheus("llm", "vllm:http://127.0.0.1:8000/metrics")
    for _ in range(20):
        app.scrape_all()
        got = app.p99s()["llm"]
        assert got.tpot is None or got.tpot.p99_ms is None
        now[0] += 1.0


def test_a_hostile_vllm_endpoint_gives_no_p99_and_keeps_its_text_from_others() -> None:
    # The URL is the submitting user's: its answers may be anything. None may raise in the
    # poller, make up a p99, or put the endpoint's text into the public reason (docs/security.md).
    answers = iter([
        "<html>not metrics</html>\x00",
        f'{VLLM_TTFT}_bucket{{le="0.1"}} NaN\n{VLLM_TTFT}_bucket{{le="+Inf"}} NaN\n',
        f'{VLLM_TTFT}_bucket{{le="-1"}} 5\n{VLLM_TTFT}_bucket{{le="+Inf"}} 3\n',
        f'{VLLM_TTFT}_bucket{{le="0.1"}} 1e308\n{VLLM_TTFT}_bucket{{le="+Inf"}} -4\n',
    ])  # fmt: skip
    app = AppLatency(2.0, 20, 1.0, fetch=lambda source, timeout_s: next(answers))
    app.add_prometheus("llm", "vllm:http://127.0.0.1:8000/metrics")
    for _ in range(4):
        app.scrape_all()
        got = app.p99s()["llm"]
        assert got.p99_ms is None
        assert got.ttft is None or got.ttft.p99_ms is None
        assert got.tpot is None or got.tpot.p99_ms is None
        assert "html" not in (got.reason or "") and "NaN" not in (got.reason or "")
