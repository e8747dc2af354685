"""A real Prometheus evaluates the dashboard, docs/metrics.md's examples and the alerting rules.

Prometheus (Debian's package, ``scripts/get-prometheus.sh``) scrapes a ``gpushare daemon
--simulate 1`` with clients of every kind (an online one with an SLO, an LLM server reporting its
TTFT and TPOT through the client library against its token SLOs, an offline one, one queued, a
warning in the event log) and a target shaped like dcgm-exporter for the same GPU (its labels
as dcgm-exporter writes them, values fixed). Then every query of deploy/grafana/gpushare.json,
every ``promql`` block of docs/metrics.md and every rule expression of
deploy/prometheus/gpushare-rules.yml goes through Prometheus' HTTP API and must return data.

A comparison filters by value (``a > b`` is empty while the SLO holds), so comparisons are
evaluated with PromQL's ``bool`` modifier, which keeps every matched pair as 0 or 1: the result
is empty only when a name, a label or a join is wrong, which is what this test is for. Whether
each alert fires on the right values is ``promtool test rules`` with the rules' own test file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from bench.support import trusted
from gpushare.paths import repo_root
from tests.test_grafana import _queries

REPO = repo_root()
RULES = REPO / "deploy" / "prometheus" / "gpushare-rules.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "gpushare-rules.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "gpushare.json"
DOC = REPO / "docs" / "metrics.md"
GPUSHARE = [sys.executable, "-c", "from gpushare.cli.app import main; main()"]
# Grafana's variables as the test fills them: every GPU and node, a window of 10 scrapes.
VARIABLES = {"$__rate_interval": "10s", "$UUID": ".*", "$instance": ".*"}
# A comparison between spaces, not already a `bool` one; label matchers are written without
# spaces (`{job="gpushare"}`), so they are never taken for one.
# An LLM server as the client library sees it: a first token 300 ms after each request's arrival,
# then 10 tokens 20 ms apart, reported as they come (report_ttft, report_tpot), 20 requests a second.
LLM_SERVER = """
import time
from gpushare import client
while True:
    client.report_ttft(0.3)
    for _ in range(10):
        client.report_tpot(0.02)
    time.sleep(0.05)
"""
COMPARISON = re.compile(r"(?<=\s)(==|!=|>=|<=|>|<)(?=\s)(?!\s+bool\b)")


def _skip_reason() -> str | None:
    missing = [b for b in ("prometheus", "promtool") if shutil.which(b) is None]
    if missing:
        return (
            f"{' and '.join(missing)} not installed: scripts/get-prometheus.sh installs Debian's "
            "prometheus package (root, apt-get; `make test` runs it)"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_bool(expr: str) -> str:
    """``a > b`` as ``a > bool b``: every matched pair, valued 0 or 1 (see the module doc)."""
    return COMPARISON.sub(lambda m: f"{m.group(1)} bool", expr)


def test_with_bool_leaves_matchers_alone():
    assert with_bool('a{x="1",y!="2"} > b') == 'a{x="1",y!="2"} > bool b'
    assert with_bool("a == bool 0 and b < 1") == "a == bool 0 and b < bool 1"
    assert with_bool("rate(a[5m])") == "rate(a[5m])"


def doc_examples() -> list[str]:
    return re.findall(r"```promql\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def rule_exprs() -> list[tuple[str, str]]:
    """``(alert, expr)`` of every rule, read with promtool's own parser (no YAML library here)."""
    text = RULES.read_text()
    out = []
    for block in re.split(r"\n\s+- alert: ", text)[1:]:
        name = block.split("\n", 1)[0].strip()
        found = re.search(r"\n\s+expr: (>-\n(?:\s{10}.*\n)+|.*\n)", block)
        assert found, name
        expr = found.group(1)
        if expr.startswith(">-"):
            expr = " ".join(line.strip() for line in expr.splitlines()[1:])
        out.append((name, expr.strip()))
    return out


def test_promtool_checks_the_rules_and_fires_each_alert():
    if (reason := _skip_reason()) is not None:
        pytest.skip(reason)
    checked = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in checked.stdout
    tested = subprocess.run(
        ["promtool", "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr
    fired = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert fired == {name for name, _ in rule_exprs()}


def _dcgm_exposition(uuid: str, hostname: str, model: str) -> bytes:
    """What dcgm-exporter serves for one GPU (its default fields the dashboard reads)."""
    labels = (
        f'gpu="0",UUID="{uuid}",pci_bus_id="00000000:19:00.0",device="nvidia0",'
        f'modelName="{model}",Hostname="{hostname}",DCGM_FI_DRIVER_VERSION="580.65.06"'
    )
    fields = {
        "DCGM_FI_DEV_GPU_UTIL": 35, "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.3,
        "DCGM_FI_DEV_FB_USED": 6144, "DCGM_FI_DEV_POWER_USAGE": 310.5,
        "DCGM_FI_DEV_SM_CLOCK": 1980,
    }  # fmt: skip
    lines = []
    for name, value in fields.items():
        lines += [f"# HELP {name} {name}.", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
    return ("\n".join(lines) + "\n").encode()


def _serve(body: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _get(url: str, timeout_s: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


def _wait(what: str, ready: Any, timeout_s: float = 40) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if value := ready():
                return value
        except OSError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


class Stack:
    """The simulated daemon, the dcgm-shaped target and Prometheus, under one temp directory."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.procs: list[subprocess.Popen[bytes]] = []
        self.servers: list[ThreadingHTTPServer] = []
        self.metrics_port = _free_port()
        self.prom_port = _free_port()
        self.env = {**os.environ, "GPUSHARE_SOCKET": str(base / "run" / "gpushare.sock")}

    def config(self, state_dir: str) -> None:
        (self.base / "gpushare.toml").write_text(
            f"""version = 1
[paths]
runtime_dir = "{self.base}/run"
state_dir = "{self.base}/{state_dir}"
[daemon]
admin_group = ""
cancel_grace = "1s"
[latency]
window = "5s"
[metrics]
listen = "127.0.0.1:{self.metrics_port}"
[control]
failure_backoff_min = "60s"
[mps]
control_binary = "/nonexistent/gpushare-test/nvidia-cuda-mps-control"
"""
        )

    def start_daemon(self) -> None:
        self.config("state")
        log = (self.base / "daemon.log").open("wb")
        argv = [
            *GPUSHARE,
            "daemon",
            "--simulate",
            "1",
            "--config",
            str(self.base / "gpushare.toml"),
        ]
        self.procs.append(subprocess.Popen(argv, env=self.env, cwd=REPO, stdout=log, stderr=log))
        url = f"http://127.0.0.1:{self.metrics_port}/healthz"
        _wait("the daemon's /healthz", lambda: _get(url).startswith("ok"))

    def probe_baseline_ms(self) -> float | None:
        """The first GPU's probe baseline in ``status`` (None until one is learned)."""
        done = self.cli("status", "--json")
        if done.returncode != 0:
            return None
        baseline = json.loads(done.stdout)["gpus"][0]["probe"]["baseline_ms"]
        return float(baseline) if baseline is not None else None

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*GPUSHARE, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )

    def start_prometheus(self, dcgm_port: int) -> None:
        conf = self.base / "prometheus.yml"
        conf.write_text(
            f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: gpushare
    static_configs: [{{targets: ["127.0.0.1:{self.metrics_port}"]}}]
  - job_name: dcgm
    static_configs: [{{targets: ["127.0.0.1:{dcgm_port}"]}}]
"""
        )
        argv = [
            "prometheus", f"--config.file={conf}", f"--storage.tsdb.path={self.base}/tsdb",
            f"--web.listen-address=127.0.0.1:{self.prom_port}", "--log.level=warn",
        ]  # fmt: skip
        log = (self.base / "prometheus.log").open("wb")
        self.procs.append(subprocess.Popen(argv, stdout=log, stderr=log))
        _wait("Prometheus", lambda: "Ready" in _get(f"{self.api_root}/-/ready"))

    @property
    def api_root(self) -> str:
        return f"http://127.0.0.1:{self.prom_port}"

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.api_root}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            answer = json.loads(_get(url))
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{expr!r}: {exc.read().decode()}") from exc
        assert answer["status"] == "success", answer
        return list(answer["data"]["result"])

    def stop(self) -> None:
        if self.procs:
            listing = self.cli("list", "--json")
            if listing.returncode == 0:
                for c in json.loads(listing.stdout)["clients"]:
                    self.cli("cancel", c["id"])
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for server in self.servers:
            server.shutdown()
            server.server_close()
        shutil.rmtree(self.base, ignore_errors=True)


def _logs(stack: Stack) -> str:
    return "".join(
        f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in stack.base.glob("*.log") if p.exists()
    )


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    if (reason := _skip_reason()) is not None:
        pytest.skip(reason)
    if trusted.trusted_base() is None:
        pytest.skip(trusted.SKIP_REASON)
    s = Stack(trusted.make_trusted_dir("gsp-"))  # the daemon refuses a config under /tmp
    try:
        s.start_daemon()
        submits = [
            ("--online", "--detach", "--name", "web", "--slo-p99", "60ms",
             "--sim-profile", "resnet50-inference", "--rps", "25"),
            ("--offline", "--restartable", "--detach", "--name", "train",
             "--sim-profile", "resnet50-train"),
        ]  # fmt: skip
        for args in submits:
            done = s.cli("submit", *args, "--", "sleep", "120")
            assert done.returncode == 0, done.stderr + _logs(s)
            # The probe learns its baseline while no offline work runs: before the trainer.
            _wait("the probe's baseline", lambda: s.probe_baseline_ms(), timeout_s=30)
        llm = ("--online", "--detach", "--name", "chat", "--slo-ttft-p99", "1s",
               "--slo-tpot-p99", "50ms", "--", sys.executable, "-c", LLM_SERVER)  # fmt: skip
        done = s.cli("submit", *llm)
        assert done.returncode == 0, done.stderr + _logs(s)
        # A restartable job that fails goes back to the queue for its backoff (60 s here).
        flaky = ("--offline", "--restartable", "--detach", "--name", "flaky", "--", "false")
        done = s.cli("submit", *flaky)
        assert done.returncode == 0, done.stderr + _logs(s)
        # A warning in the event log: a reload that changes [paths] (applied at a restart only).
        s.config("state2")
        s.procs[0].send_signal(signal.SIGHUP)
        exposition = _get(f"http://127.0.0.1:{s.metrics_port}/metrics")
        gpu = re.search(r"gpushare_mps_daemon_up\{([^}]*)\}", exposition)
        assert gpu, exposition
        labels = dict(re.findall(r'(\w+)="([^"]*)"', gpu.group(1)))
        dcgm = _serve(_dcgm_exposition(labels["UUID"], labels["Hostname"], labels["modelName"]))
        s.servers.append(dcgm)
        s.start_prometheus(dcgm.server_address[1])
        # Data enough for every window: the online p99, a queued job, 10 s of scrapes.
        wanted = [
            "gpushare_client_latency_p99_seconds",
            "gpushare_client_ttft_p99_seconds",
            "gpushare_client_tpot_p99_seconds",
            "gpushare_admission_queue_oldest_wait_seconds",
            'gpushare_events_total{severity="warning"}',
            'count_over_time(up{job="gpushare"}[1m]) >= 12',
            'count_over_time(up{job="dcgm"}[1m]) >= 12',
        ]
        for expr in wanted:
            _wait(expr, lambda e=expr: s.query(e), timeout_s=45)
        yield s
    except BaseException as exc:
        raise AssertionError(f"{exc}{_logs(s)}") from exc
    finally:
        s.stop()


def _cases() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    cases = [(f"dashboard {where}", expr) for where, expr in _queries(dash)]
    cases += [(f"docs/metrics.md example {i}", e) for i, e in enumerate(doc_examples(), 1)]
    cases += [(f"rule {name}", expr) for name, expr in rule_exprs()]
    return cases


def test_every_dashboard_query_doc_example_and_rule_returns_data(stack: Stack):
    cases = _cases()
    assert len(doc_examples()) >= 5 and len(rule_exprs()) >= 5
    empty = []
    for where, expr in cases:
        for var, value in VARIABLES.items():
            expr = expr.replace(var, value)
        if not stack.query(with_bool(expr)):
            empty.append(f"{where}: {expr}")
    assert not empty, "no data for:\n" + "\n".join(empty)


def test_the_series_join_dcgm_exporter_on_hostname_and_uuid(stack: Stack):
    joined = stack.query(
        "gpushare_mps_daemon_up * on(Hostname, UUID, gpu, modelName) group_left() "
        "(0 * DCGM_FI_DEV_GPU_UTIL + 1)"
    )
    assert len(joined) == 1 and joined[0]["metric"]["job"] == "gpushare"
    (build,) = stack.query("gpushare_build_info")
    assert build["metric"]["version"]
    assert stack.query('process_resident_memory_bytes{job="gpushare"} > 0')
    states = stack.query('sum by (class) (gpushare_clients{state=~"running|throttled|frozen"})')
    assert {r["metric"]["class"]: float(r["value"][1]) for r in states} == {
        "online": 2.0,  # the request-latency service and the LLM server
        "offline": 1.0,
    }


def test_an_llm_servers_token_p99s_and_slos_reach_prometheus_and_the_alerts_evaluate(stack: Stack):
    def one(expr: str) -> float:
        (row,) = stack.query(expr)
        assert row["metric"]["name"] == "chat" and row["metric"]["class"] == "online"
        return float(row["value"][1])

    assert one("gpushare_client_ttft_p99_seconds") == pytest.approx(0.3)
    assert one("gpushare_client_tpot_p99_seconds") == pytest.approx(0.02)
    assert one("gpushare_client_slo_ttft_p99_seconds") == pytest.approx(1.0)
    assert one("gpushare_client_slo_tpot_p99_seconds") == pytest.approx(0.05)
    # Each token alert's expression matches the server's two series and holds: inside the SLO.
    for name in ("GpushareTtftSloBreach", "GpushareTpotSloBreach"):
        (expr,) = [e for n, e in rule_exprs() if n == name]
        assert one(with_bool(expr)) == 0.0
