"""TTFT and TPOT read from SGLang's and TGI's own histograms (`--latency-from sglang:URL` and
`tgi:URL`, issue 33), through the table and parser the vLLM path uses: real HTTP endpoints
serving each project's exposition, windowed p99s from bucket deltas, hostile answers.

The shapes are each project's own, at the versions gpushare/latency/prometheus.py cites:
- SGLang (python/sglang/srt/metrics/collector.py at sgl-project/sglang commit 93d04878...,
  TokenizerMetricsCollector): prometheus_client histograms labelled by `model_name`, as its
  docs/references/production_metrics.md shows them; the inter-token histogram had the name
  `sglang:time_per_output_token_seconds` before `sglang:inter_token_latency_seconds`.
- TGI (router/src/server.rs at huggingface/text-generation-inference commit db931fcf..., 3.3.6-dev0):
  the Rust metrics-exporter-prometheus renders unlabelled histograms whose bucket bounds are
  0.0001 * 1.5**k (k = 1..35, printed at full f64 precision), and only once a value was recorded.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gpushare.latency.app import AppLatency
from gpushare.latency.p99 import TokenTrackers
from gpushare.latency.prometheus import (
    MAX_SCRAPE_BYTES,
    SGLANG_TTFT,
    TGI_TPOT,
    parse_latency_from,
)
from gpushare.stats import bucket_quantile
from tests.support.exposition import ExpositionServer

INF = float("inf")
SGLANG_TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
SGLANG_ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
                      0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)  # fmt: skip
TGI_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))


class TgiHistogram:
    """TGI's TPOT histogram as metrics-exporter-prometheus renders it (absent until recorded)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def render(self) -> bytes:
        if not self.values:
            return b"# HELP tgi_request_success Number of successful requests\n"
        lines = [
            f"# HELP {TGI_TPOT} Mean time per token per request",
            f"# TYPE {TGI_TPOT} histogram",
        ]
        for le in TGI_BUCKETS:
            lines.append(f'{TGI_TPOT}_bucket{{le="{le!r}"}} {sum(v <= le for v in self.values)}')
        lines.append(f'{TGI_TPOT}_bucket{{le="+Inf"}} {len(self.values)}')
        lines.append(f"{TGI_TPOT}_sum {sum(self.values)!r}")
        lines.append(f"{TGI_TPOT}_count {len(self.values)}")
        return ("\n".join(lines) + "\n").encode()


def _app(now: list[float]) -> AppLatency:
    tokens = TokenTrackers(20, ttft_window_s=120.0, tpot_window_s=10.0)
    return AppLatency(2.0, 20, 1.0, clock=lambda: now[0], tokens=tokens)


def _want(values: list[float], bounds: tuple[float, ...]) -> float:
    """PromQL's interpolated p99 of these values in these buckets, in ms."""
    got = bucket_quantile(0.99, {le: float(sum(v <= le for v in values)) for le in (*bounds, INF)})
    assert got is not None
    return got * 1000.0


@pytest.mark.parametrize(
    "itl_name", ["sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"]
)
def test_sglang_ttft_and_tpot_p99_from_bucket_deltas_of_a_live_endpoint(itl_name: str) -> None:
    registry = CollectorRegistry()
    ttft = Histogram(SGLANG_TTFT, "TTFT", ["model_name"], registry=registry,
                     buckets=SGLANG_TTFT_BUCKETS).labels("meta-llama/Llama-3.1-8B-Instruct")  # fmt: skip
    itl = Histogram(itl_name, "ITL", ["model_name"], registry=registry,
                    buckets=SGLANG_ITL_BUCKETS).labels("meta-llama/Llama-3.1-8B-Instruct")  # fmt: skip
    server = ExpositionServer(lambda: generate_latest(registry))
    try:
        now = [1000.0]
        app = _app(now)
        app.add_prometheus("llm", f"sglang:{server.url}")
        for _ in range(50):  # before the first scrape: not in any window
            ttft.observe(30.0)
        app.scrape_all()
        ttfts, itls = [0.3] * 29 + [0.9], [0.02] * 290 + [0.07] * 10
        for v in ttfts:
            ttft.observe(v)
        for v in itls:
            itl.observe(v)
        now[0] += 5.0
        app.scrape_all()
        got = app.p99s()["llm"]
    finally:
        server.close()
    assert got.p99_ms is None and got.ttft is not None and got.tpot is not None
    assert (got.ttft.samples, got.tpot.samples) == (30, 300)
    assert got.ttft.p99_ms == pytest.approx(_want(ttfts, SGLANG_TTFT_BUCKETS))
    assert 800.0 < got.ttft.p99_ms <= 1000.0  # the true p99, 900 ms, lies in SGLang's (0.8, 1]
    assert got.tpot.p99_ms == pytest.approx(_want(itls, SGLANG_ITL_BUCKETS))
    assert 60.0 < got.tpot.p99_ms <= 80.0  # the true p99, 70 ms, lies in (0.06, 0.08]


def test_tgi_gives_tpot_from_its_histogram_and_leaves_ttft_to_datagrams() -> None:
    tgi = TgiHistogram()
    server = ExpositionServer(tgi.render)
    try:
        now = [1000.0]
        app = _app(now)
        app.add_prometheus("llm", f"tgi:{server.url}")
        app.scrape_all()  # no request served yet: TGI renders no histogram at all
        first = app.p99s()["llm"]
        assert first.reason is not None and f"no TGI histograms ({TGI_TPOT})" in first.reason
        tgi.values += [5.0] * 50  # before the first scrape that holds the histogram
        now[0] += 1.0
        app.scrape_all()
        tpots = [0.02] * 29 + [0.045]  # one per request: TGI's mean time per token
        tgi.values += tpots
        now[0] += 5.0
        app.scrape_all()
        got = app.p99s()["llm"]
        assert got.ttft is None  # TGI exports no TTFT histogram: none is made up
        assert got.tpot is not None and got.tpot.samples == 30
        assert got.tpot.p99_ms == pytest.approx(_want(tpots, TGI_BUCKETS))
        assert 43.789 < got.tpot.p99_ms <= 65.685  # 45 ms lies in TGI's (0.0438, 0.0657] bucket
        # A TTFT the server reports by datagram fills the gap the histogram leaves.
        app.tokens.ttft.add_many("llm", [(now[0], 0.25)] * 30)
        both = app.p99s()["llm"]
        assert both.ttft is not None and both.ttft.p99_ms == pytest.approx(250.0)
        assert both.tpot is not None and both.tpot.p99_ms == pytest.approx(got.tpot.p99_ms)
        # One TPOT per request: its window is the TTFT's (120 s), not tpot_window (10 s).
        now[0] += 60.0
        app.scrape_all()
        later = app.p99s()["llm"].tpot
        assert later is not None and later.p99_ms == pytest.approx(got.tpot.p99_ms)
    finally:
        server.close()


def test_sglang_and_tgi_specs_are_checked_with_one_clear_line() -> None:
    for prefix in ("sglang", "tgi"):
        src = parse_latency_from(f"{prefix}:http://127.0.0.1:30000/metrics")
        assert (src.server, src.port, src.path, src.metric) == (prefix, 30000, "/metrics", "")
        for bad, says in (
            (f"{prefix}:http://10.0.0.1/metrics", "must be on this host"),
            (f"{prefix}:http://127.0.0.1/m#{TGI_TPOT}", f"{prefix}:URL reads the server's own"),
            (f"{prefix}:https://[::1]/", "only plain http"),
            (f"{prefix}:http://127.0.0.1:99999/", "bad port"),
        ):
            with pytest.raises(ValueError, match=says) as info:
                parse_latency_from(bad)
            assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="sglang:, tgi:") as info:
        parse_latency_from("triton:http://127.0.0.1/metrics")


HOSTILE = {
    "sglang": (SGLANG_TTFT, "sglang:inter_token_latency_seconds"),
    "tgi": (TGI_TPOT, TGI_TPOT),
}


@pytest.fixture(params=sorted(HOSTILE))
def prefix(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_hostile_sglang_and_tgi_answers_give_no_p99_and_keep_their_text_out(prefix: str) -> None:
    # The URL is the submitting user's: its answers may be anything. None may raise in the
    # poller, make up a p99, or put the endpoint's text into the public reason (docs/security.md).
    a, b = HOSTILE[prefix]
    answers = [
        b"<html>not metrics</html>\x00",
        f'{a}_bucket{{le="0.1"}} NaN\n{a}_bucket{{le="+Inf"}} NaN\n'.encode(),
        f'{b}_bucket{{le="-1"}} 5\n{b}_bucket{{le="+Inf"}} 3\n'.encode(),
        f'{a}_bucket{{le="0.1"}} 1e308\n{a}_bucket{{le="+Inf"}} -4\n'.encode(),
        f'# TYPE {a} gauge\n{a} 7\n{b}_bucket{{le="zero"}} 1\n'.encode(),  # wrong types
        f'{a}_bucket{{le="0.1"}} "many"\n'.encode(),
        b"# " + b"x" * (MAX_SCRAPE_BYTES + 10) + b"\n",  # over the size limit
    ]
    served = iter(answers)
    server = ExpositionServer(lambda: next(served, answers[0]))
    try:
        now = [1000.0]
        app = _app(now)
        app.add_prometheus("llm", f"{prefix}:{server.url}")
        for _ in answers:
            app.scrape_all()
            now[0] += 1.0
            got = app.p99s()["llm"]
            reason = got.reason or ""
            assert got.p99_ms is None
            for part in (got.ttft, got.tpot):
                assert part is None or part.p99_ms is None, (prefix, part)
            assert reason and "\n" not in reason
            assert not any(s in reason for s in ("html", "NaN", "many", "zero", "xxx"))
    finally:
        server.close()
