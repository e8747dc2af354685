"""The human status view: missing readings print N/A (never 0), percentages are readable."""

from gpushare.cli.render import mps_down, render_clients, render_status


def _gpu(**over):
    g = {
        "index": 0, "uuid": "GPU-aaaa", "shared": True, "mem_used_bytes": 10 << 30,
        "mem_total_bytes": 16 << 30, "gpu_util_pct": 15.9368, "mps_state": "up",
        "online_slo": {"state": "ok"}, "probe": {"enabled": True, "latency_ms": 0.274},
        "client_slots_used": 4, "client_slots_max": 48, "duty": 0.15, "offline_sm_pct": 33.333,
        "error": None,
    }  # fmt: skip
    g.update(over)
    return g


def _client(**over):
    c = {
        "id": "c1", "name": None, "user": "alice", "class": "offline", "gpu_index": 0,
        "sm_pct": 50.0, "mem_limit_bytes": None, "mem_used_bytes": None, "state": "frozen",
        "held": True, "uptime_s": 61.4, "pause_mechanism": "cgroup",
    }  # fmt: skip
    c.update(over)
    return c


def _status(gpus, clients):
    return {"daemon": {"version": "0.1.0", "summary": "1 GPU(s)"}, "gpus": gpus, "clients": clients}


def test_gpu_row_rounds_readings():
    text = render_status(_status([_gpu()], []))
    row = text.splitlines()[3]
    assert "15.9%" in row
    assert "33.3%" in row
    assert "0.27ms" in row
    assert "0.15" in row
    assert "15.9368" not in text


def test_gate_columns_show_the_gate_and_requests_in_flight():
    gate = {"enabled": True, "closed": True, "inflight": 3, "signalled_clients": 1,
            "busy_fraction": 0.4, "closes": 12}  # fmt: skip
    _, _, header, row = render_status(_status([_gpu(gate=gate)], [])).splitlines()[:4]
    assert header.split()[-3:] == ["GATE", "IN", "FLIGHT"]
    assert row.split()[-2:] == ["closed", "3"]
    row = render_status(_status([_gpu(gate={**gate, "closed": False, "inflight": 0})], []))
    assert row.splitlines()[3].split()[-2:] == ["open", "0"]
    row = render_status(_status([_gpu(gate={**gate, "enabled": False, "closed": False})], []))
    assert row.splitlines()[3].split()[-2:] == ["off", "3"]
    row = render_status(_status([_gpu()], []))  # an older daemon: no gate in its status
    assert row.splitlines()[3].split()[-2:] == ["N/A", "N/A"]


def test_missing_readings_are_na_not_zero():
    text = render_status(_status([_gpu(gpu_util_pct=None, mps_state=None)], [_client()]))
    gpu_row = text.splitlines()[3]
    assert gpu_row.split()[3:5] == ["N/A", "N/A"]
    client_row = text.splitlines()[-1]
    assert "N/A" in client_row
    assert " 0%" not in client_row
    assert "frozen (held)" in client_row
    assert "1m" in client_row or "61s" in client_row


def test_no_clients_and_errors():
    text = render_status(_status([_gpu(error="nvml call timed out")], []))
    assert "error: nvml call timed out" in text
    assert text.endswith("no clients")
    assert render_clients([]) == "no clients"


def test_mps_down_only_for_shared_gpus():
    assert mps_down(_status([_gpu(mps_state="fault")], []))
    assert not mps_down(_status([_gpu(mps_state="down", shared=False)], []))
    assert not mps_down(_status([_gpu()], []))
