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


def test_an_adopted_client_says_who_adopted_it_and_how_it_is_paused():
    adopted = _client(
        id="c2", pause_mechanism="signal", adopted_by="slurm job 42",
        pause_reason="SIGSTOP/SIGCONT: /sys/fs/cgroup/x also holds pid 7, which is not part of the client",
    )  # fmt: skip
    text = render_clients([_client(adopted_by=None), adopted])
    assert text.splitlines()[-1] == (
        "c2: adopted by slurm job 42; paused by SIGSTOP/SIGCONT: /sys/fs/cgroup/x also holds pid 7, "
        "which is not part of the client"
    )
    assert "c1: adopted" not in text


def test_an_adopted_pod_is_named():
    c = _client(
        adopted_by="rule 'marker' (/etc/gpushare/gpushare.toml)", pause_reason=None,
        container={"id": "3f1b5a0c9d8e" + "0" * 52, "runtime": "containerd",
                   "pod_uid": "7a5c3b2e-1f4d-4c8a-9b6e-2d3f4a5b6c7d", "qos": "burstable"},
    )  # fmt: skip
    assert render_clients([c]).splitlines()[-1] == (
        "c1: adopted by rule 'marker' (/etc/gpushare/gpushare.toml) in pod "
        "7a5c3b2e-1f4d-4c8a-9b6e-2d3f4a5b6c7d (container 3f1b5a0c9d8e, containerd)"
    )
