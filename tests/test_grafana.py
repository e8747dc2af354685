"""deploy/grafana/gpushare.json: every query names a metric that exists.

gpushare's names are collected from the exporter's real registry (what a scrape of the daemon
serves), expanded by type as the exposition spells samples (``_total`` for counters, ``_bucket``,
``_sum`` and ``_count`` for histograms). DCGM names must be among dcgm-exporter's default fields
(etc/default-counters.csv and etc/dcp-metrics-included.csv of NVIDIA/dcgm-exporter). That a real
Prometheus returns data for each query is tests/test_prometheus_real.py.
"""

import json
import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpushare.metrics import Exporter
from gpushare.paths import repo_root

DASHBOARD = repo_root() / "deploy" / "grafana" / "gpushare.json"

DCGM_DEFAULT_FIELDS = {
    "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK", "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_DEC_UTIL", "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE",
}  # fmt: skip

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "bool", "offset", "inf", "nan"}  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def exported_series_names() -> set[str]:
    text = generate_latest(Exporter().registry).decode()
    names = set()
    for fam in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
        names.update(fam.name + s for s in suffixes.get(fam.type, [""]))
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (label matchers, ranges, grouping removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = _GROUPING.sub("", expr)
    expr = re.sub(r"(?<![A-Za-z0-9_:])\d[\w.]*", "", expr)  # numbers and durations (5m)
    names = set()
    for m in _IDENT.finditer(expr):
        word = m.group(0)
        if word.lower() in _KEYWORDS or expr[m.end() :].lstrip().startswith("("):
            continue  # a function call or an operator
        names.add(word)
    return names


def _balanced(expr: str) -> bool:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    stack = []
    for ch in expr:
        if ch in "([{":
            stack.append({"(": ")", "[": "]", "{": "}"}[ch])
        elif ch in ")]}" and (not stack or stack.pop() != ch):
            return False
    return not stack


def _queries(dash: dict) -> list[tuple[str, str]]:
    out = []

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dash["panels"]):
        out += [(p["title"], t["expr"]) for t in p.get("targets", [])]
    for a in dash["annotations"]["list"]:
        if "expr" in a:
            out.append((f"annotation {a['name']}", a["expr"]))
            assert a["target"]["expr"] == a["expr"]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"]
            assert q == v["definition"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            assert inner, q
            out.append((f"variable {v['name']}", inner.group(1)))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.99, sum by (le, gpu) (rate(a_bucket{UUID=~"$UUID", x="b c"}'
            "[$__rate_interval]))) / on(UUID) group_left() (max by (UUID) (DCGM_X) * 1048576)")  # fmt: skip
    assert metric_names(expr) == {"a_bucket", "DCGM_X"}
    assert metric_names("x > bool y offset 5m") == {"x", "y"}
    assert _balanced('sum(rate(a{x="(]"}[5m]))')
    assert not _balanced("sum(rate(a[5m])")


def test_every_query_names_an_exported_metric(dashboard):
    exported = exported_series_names()
    assert "gpushare_client_thawed_seconds_total" in exported
    assert "gpushare_controller_step_seconds_bucket" in exported
    queries = _queries(dashboard)
    assert len(queries) > 20
    for where, expr in queries:
        assert _balanced(expr), f"{where}: unbalanced brackets in {expr!r}"
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name in names:
            known = name in exported or name in DCGM_DEFAULT_FIELDS
            assert known, f"{where}: {name!r} is neither exported by gpushare nor a DCGM default"


def test_dashboard_covers_the_issue(dashboard):
    exprs = " ".join(e for _, e in _queries(dashboard))
    for name in ("gpushare_client_latency_p99_seconds", "gpushare_client_slo_p99_seconds",
                 "gpushare_client_thawed_ratio", "gpushare_client_sm_limit_ratio",
                 "DCGM_FI_DEV_GPU_UTIL"):  # fmt: skip
        assert name in exprs
    repeated = [p for p in dashboard["panels"] if p.get("repeat") == "UUID"]
    assert any("p99" in p["title"] for p in repeated), "per-GPU online p99 panel"
    assert len([a for a in dashboard["annotations"]["list"] if "expr" in a]) >= 4
    assert [p["title"] for p in dashboard["panels"] if p["type"] == "row"][-1].startswith("GPU")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Every query filters on the GPU variable, except the node-level admission series.
    for where, expr in _queries(dashboard):
        if "admission" not in expr and not where.startswith("variable"):
            assert 'UUID=~"$UUID' in expr, where


def test_dashboard_shows_llm_token_p99s_against_their_slos(dashboard):
    exprs = " ".join(e for _, e in _queries(dashboard))
    for name in ("gpushare_client_ttft_p99_seconds", "gpushare_client_slo_ttft_p99_seconds",
                 "gpushare_client_tpot_p99_seconds", "gpushare_client_slo_tpot_p99_seconds"):  # fmt: skip
        assert name in exprs
