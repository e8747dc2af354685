"""An LLM server's TTFT and TPOT SLOs end to end (issue 33): `submit --slo-ttft-p99/--slo-tpot-p99`,
the registry (and its migration), token datagrams from a real client process to a real daemon,
`status` (JSON and `-o wide`) and the metrics."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from gpushare.client import ApiError
from gpushare.daemon.registry import Registry, store
from gpushare.metrics import Exporter, NodeMetrics
from gpushare.model import (
    ClientClass,
    ClientState,
    ClientView,
    GpuSample,
    Limits,
    MpsState,
    Observation,
    ProbeReading,
)
from gpushare.protocol import ErrorCode


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc().start()
    yield d
    d.cleanup()


def run_cli(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args], cwd=REPO,
        env={**os.environ, "GPUSHARE_SOCKET": str(d.socket)},
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


# TTFT 600 ms (over a 500 ms SLO), TPOT 30 ms (inside 50 ms), from the served process itself.
LLM_SERVER = (
    "import time; from gpushare.client import report_ttft, report_tpot, flush_latency\n"
    "for _ in range(30):\n"
    "    report_ttft(0.6)\n"
    "    for _ in range(10): report_tpot(0.03)\n"
    "    flush_latency()\n"
    # The kernel queues 10 datagrams per Unix socket: a burst of 30 would be partly dropped.
    "    time.sleep(0.05)\n"
    "time.sleep(30)\n"
)


def test_llm_server_slos_reach_status_and_the_verdict(daemon: DaemonProc) -> None:
    r = run_cli(
        daemon, "submit", "--online", "--gpu", "1", "--slo-ttft-p99", "500ms",
        "--slo-tpot-p99", "50ms", "--detach", "--", sys.executable, "-c", LLM_SERVER,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cid = next(c["id"] for c in daemon.call("list", {})["clients"] if c["slo_ttft_p99_ms"])

    def latency() -> dict | None:  # type: ignore[type-arg]
        st = daemon.call("status", {"gpu": "1"})
        lat = next(c for c in st["clients"] if c["id"] == cid)["latency"]
        both = lat["ttft"] and lat["ttft"]["p99_ms"] and lat["tpot"] and lat["tpot"]["p99_ms"]
        return lat if both else None

    lat = wait_for(latency, timeout_s=30, what="TTFT and TPOT p99 in status")
    assert lat["ttft"]["p99_ms"] == pytest.approx(600.0)
    assert lat["ttft"]["slo_p99_ms"] == 500.0
    assert lat["ttft"]["ratio"] == pytest.approx(1.2)
    assert 20 <= lat["ttft"]["samples"] <= 30  # min_samples; a datagram may still be dropped
    assert lat["tpot"]["p99_ms"] == pytest.approx(30.0)
    assert lat["tpot"]["ratio"] == pytest.approx(0.6)
    assert lat["tpot"]["samples"] >= 200
    assert lat["p99_ms"] is None  # no request latency reported: that SLO was never asked for
    slo = daemon.call("status", {"gpu": "1"})["gpus"][0]["online_slo"]
    assert (slo["state"], slo["violating_clients"]) == ("degraded", [cid])
    wide = run_cli(daemon, "status", "--gpu", "1", "-o", "wide")
    assert "TTFT/SLO" in wide.stdout and "TPOT/SLO" in wide.stdout
    row = next(line for line in wide.stdout.splitlines() if line.startswith(cid + " "))
    assert "600ms/500ms" in row and "30ms/50ms" in row
    daemon.call("cancel", {"client_id": cid})
    wait_for(lambda: daemon.client(cid)["state"] == "exited", timeout_s=20, what="cancel")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--online", "--slo-ttft-p99", "soon"], "--slo-ttft-p99"),
        (["--online", "--slo-tpot-p99", "-5ms"], "--slo-tpot-p99"),
        (["--online", "--slo-tpot-p99", "2h"], "at most 1h"),
        (["--offline", "--slo-ttft-p99", "500ms"], "applies to --online clients only"),
    ],
)
def test_bad_token_slos_get_one_line_and_change_nothing(
    daemon: DaemonProc, args: list[str], says: str
) -> None:
    before = len(daemon.call("list", {"all": True})["clients"])
    r = run_cli(daemon, "submit", *args, "--detach", "--", "true")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], r.stderr
    assert len(daemon.call("list", {"all": True})["clients"]) == before


def test_the_daemon_refuses_bad_token_slos_from_any_caller(daemon: DaemonProc) -> None:
    for params, says in (
        ({"cls": "offline", "slo_tpot_p99_ms": 50.0}, "--slo-tpot-p99 applies to --online"),
        ({"cls": "online", "slo_ttft_p99_ms": 1e300}, "--slo-ttft-p99 must be"),
        ({"cls": "online", "slo_ttft_p99_ms": -1.0}, "--slo-ttft-p99 must be"),
    ):
        with pytest.raises(ApiError) as exc:
            daemon.call("submit", {"argv": ["true"], "detach": True, "cwd": "/", **params})
        assert exc.value.code is ErrorCode.INVALID_PARAMS and says in str(exc.value), exc.value


def test_old_registry_records_are_migrated(tmp_path: Path) -> None:
    """A database written before the token SLOs gains their columns; its records read None."""
    db = tmp_path / "state.db"
    old_schema = store.SCHEMA
    for column in store._ADDED_REAL_COLUMNS:
        old_schema = old_schema.replace(f"    {column} REAL,\n", "")
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.executescript(old_schema)
        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(store.SCHEMA_VERSION),))
        conn.execute(
            "INSERT INTO clients (id, cls, argv, uid, gid, user, priority, restartable,"
            " checkpoint_signal, detach, env, state, submitted_at, slo_p99_ms)"
            " VALUES ('c1', 'online', '[\"serve\"]', 1000, 1000, 'alice', 0, 0, 10, 0, '{}',"
            " 'running', 1.0, 40.0)"
        )
        conn.commit()
        have = {row[1] for row in conn.execute("PRAGMA table_info(clients)")}
        assert "slo_ttft_p99_ms" not in have
    reg = Registry.open(db)
    try:
        rec = reg.get("c1")
        assert (rec.slo_p99_ms, rec.slo_ttft_p99_ms, rec.slo_tpot_p99_ms) == (40.0, None, None)
        rec = reg.update("c1", slo_ttft_p99_ms=500.0, slo_tpot_p99_ms=50.0)
        assert (rec.slo_ttft_p99_ms, rec.slo_tpot_p99_ms) == (500.0, 50.0)
    finally:
        reg.close()
    again = Registry.open(db)
    try:
        assert again.get("c1").slo_tpot_p99_ms == 50.0
    finally:
        again.close()


def test_metrics_show_ttft_and_tpot_against_their_slos() -> None:
    llm = ClientView(
        client_id="llm", cls=ClientClass.ONLINE, state=ClientState.RUNNING,
        limits=Limits(100.0, None, 0), uid=1000, slo_ttft_p99_ms=500.0, ttft_p99_ms=612.0,
        slo_tpot_p99_ms=50.0, tpot_p99_ms=31.0,
    )  # fmt: skip
    web = ClientView(
        client_id="web", cls=ClientClass.ONLINE, state=ClientState.RUNNING,
        limits=Limits(100.0, None, 0), uid=1000, slo_p99_ms=40.0, p99_ms=20.0,
    )  # fmt: skip
    obs = Observation(
        gpu_uuid="GPU-a", gpu_index=0, sample=GpuSample(index=0, uuid="GPU-a", name="H200"),
        probe=ProbeReading(reason="off"), clients=(llm, web), mps_state=MpsState.UP,
    )  # fmt: skip
    exp = Exporter(hostname="n1")
    try:
        exp.update(NodeMetrics(observations=[obs], user_names={1000: "alice"}))
        host, port = exp.serve("127.0.0.1:0")
        body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    finally:
        exp.close()
    got = {
        (s.name, s.labels["client"]): s.value
        for fam in text_string_to_metric_families(body)
        for s in fam.samples
        if "client" in s.labels
    }
    assert got[("gpushare_client_ttft_p99_seconds", "llm")] == pytest.approx(0.612)
    assert got[("gpushare_client_slo_ttft_p99_seconds", "llm")] == pytest.approx(0.5)
    assert got[("gpushare_client_tpot_p99_seconds", "llm")] == pytest.approx(0.031)
    assert got[("gpushare_client_slo_tpot_p99_seconds", "llm")] == pytest.approx(0.05)
    assert not any(name.startswith(("gpushare_client_tt", "gpushare_client_tp",
                                    "gpushare_client_slo_tt", "gpushare_client_slo_tp"))
                   for name, client in got if client == "web")  # fmt: skip


def test_a_marked_llm_server_is_adopted_with_its_token_slos_read_from_proc() -> None:
    """The markers `gpushare env` writes are among the few variables read from /proc/PID/environ."""
    from gpushare import config
    from gpushare.control.adoption import Rule
    from gpushare.daemon.adopter import Adopter

    env = {"PATH": os.environ["PATH"], "GPUSHARE_CLASS": "online",
           "GPUSHARE_SLO_TTFT_P99": "500ms", "GPUSHARE_SLO_TPOT_P99": "50ms"}  # fmt: skip
    proc = subprocess.Popen(["sleep", "60"], env=env)
    try:
        rules = [Rule(spec, 0, "test.toml") for spec in
                 config.loads('[[adopt]]\nname = "m"\nmarker = true\n').adopt]  # fmt: skip
        adopter = Adopter(min_age_s=0.0, all_pids=lambda: [proc.pid])
        (found,) = adopter.scan(rules, clients=(), gpu_pids=None).adopt
        d = found.decision
        assert (d.cls, d.slo_ttft_p99_s, d.slo_tpot_p99_s) == (ClientClass.ONLINE, 0.5, 0.05)
    finally:
        proc.kill()
        proc.wait(timeout=5)


def test_a_vllm_servers_own_histograms_reach_status(daemon: DaemonProc) -> None:
    from tests.test_vllm_histograms import VllmServer

    server = VllmServer("vllm:inter_token_latency_seconds")
    try:
        r = run_cli(
            daemon, "submit", "--online", "--gpu", "0", "--slo-ttft-p99", "500ms",
            "--latency-from", f"vllm:{server.url}", "--detach", "--", "sleep", "60",
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        cid = next(c["id"] for c in daemon.call("list", {})["clients"]
                   if c["slo_ttft_p99_ms"] and c["gpu_index"] == 0)  # fmt: skip

        def ttft() -> dict | None:  # type: ignore[type-arg]
            for _ in range(30):
                server.ttft.observe(0.3)
            st = daemon.call("status", {"gpu": "0"})
            lat = next(c for c in st["clients"] if c["id"] == cid)["latency"]
            return lat["ttft"] if lat["ttft"] and lat["ttft"]["p99_ms"] else None

        got = wait_for(ttft, timeout_s=30, what="TTFT from the vLLM histogram")
        assert 250.0 < got["p99_ms"] <= 500.0  # interpolated inside vLLM's (0.25, 0.5] bucket
        assert got["slo_p99_ms"] == 500.0
        daemon.call("cancel", {"client_id": cid})
    finally:
        server.close()


def test_submit_latency_from_sglang_or_tgi_checks_the_spec_in_one_line(daemon: DaemonProc) -> None:
    before = daemon.call("list", {"all": True})["clients"]
    for spec, says in (
        ("sglang:http://10.0.0.1:30000/metrics", "must be on this host"),
        ("tgi:http://127.0.0.1:3000/metrics#tgi_request_duration", "give no '#METRIC'"),
        ("sglang:ftp://127.0.0.1/metrics", "only plain http"),
        ("tgi:http://127.0.0.1:x/metrics", "bad port"),
        ("triton:http://127.0.0.1/metrics", "sglang:, tgi:"),
    ):
        r = run_cli(
            daemon, "submit", "--online", "--gpu", "0", "--slo-tpot-p99", "50ms",
            "--latency-from", spec, "--detach", "--", "sleep", "60",
        )  # fmt: skip
        assert r.returncode != 0, spec
        assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "Traceback" not in r.stderr + r.stdout
    assert daemon.call("list", {"all": True})["clients"] == before
