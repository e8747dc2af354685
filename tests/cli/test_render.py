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


def test_request_gate_columns_show_the_gate_and_requests_in_flight():
    gate = {"enabled": True, "closed": True, "inflight": 3, "signalled_clients": 1,
            "busy_fraction": 0.4, "closes": 12}  # fmt: skip
    text = render_status(_status([_gpu(request_gate=gate)], []))
    _, _, header, row = text.splitlines()[:4]
    assert header.split()[-3:] == ["REQUESTS", "IN", "FLIGHT"]
    assert row.split()[-2:] == ["closed", "3"]
    text = render_status(_status([_gpu(request_gate={**gate, "closed": False, "inflight": 0})], []))
    assert text.splitlines()[3].split()[-2:] == ["open", "0"]
    off = {**gate, "enabled": False, "closed": False}
    text = render_status(_status([_gpu(request_gate=off)], []))
    assert text.splitlines()[3].split()[-2:] == ["off", "3"]
    text = render_status(_status([_gpu()], []))  # an older daemon: no request gate in its status
    assert text.splitlines()[3].split()[-2:] == ["N/A", "N/A"]
    # A gate delay: offline work runs beside the first 16 ms of each busy spell.
    delayed = {**gate, "closed": False, "inflight": 1, "delay_ms": 16.0}
    text = render_status(_status([_gpu(request_gate=delayed)], []))
    assert text.splitlines()[3].split()[-2:] == ["open+16ms", "1"]
    text = render_status(_status([_gpu(request_gate={**delayed, "enabled": False})], []))
    assert text.splitlines()[3].split()[-2:] == ["off", "1"]
    text = render_status(_status([_gpu(shared=False, request_gate=None)], []))
    assert text.splitlines()[3].split()[-2:] == ["-", "-"]


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


def _v2_status():
    gate = {"state": "cycling", "duty": 0.35, "last_action": {
        "kind": "set_duty", "reason": "duty 0.35: probe ratio 1.40 over violation ratio 1.2",
        "at": 1.7e9, "age_s": 12.4}}  # fmt: skip
    gpus = [_gpu(duty=0.35, gate=gate), _gpu(index=1, uuid="GPU-bbbb", duty=1.0,
                                             gate={"state": "open", "duty": 1.0, "last_action": None})]  # fmt: skip
    web = _client(id="c1", name="web", **{"class": "online"}, state="running", held=False,
                  slo_p99_ms=40.0, latency={"p99_ms": 31.24, "slo_p99_ms": 40.0, "ratio": 0.781,
                                            "source": "app", "samples": 900, "reason": None})  # fmt: skip
    api = _client(id="c2", name="api", **{"class": "online"}, state="running", held=False,
                  gpu_index=1, slo_p99_ms=25.0, latency={"p99_ms": None, "slo_p99_ms": 25.0,
                  "ratio": 1.4, "source": "probe", "samples": 0, "reason": "no latency reports"})  # fmt: skip
    train = _client(id="c3", name="train", state="throttled", held=False, restarts=2,
                    slo_p99_ms=None, offline={"thawed_ratio_1m": 0.3, "thawed_s": 512.0,
                                              "evictions": 1})  # fmt: skip
    return _status(gpus, [web, api, train])


def _row(text, first):
    return next(line for line in text.splitlines() if line.startswith(first + " "))


def test_online_rows_show_p99_against_slo_and_source():
    text = render_status(_v2_status())
    web = _row(text, "c1").split()
    assert web[6:10] == ["31.2ms", "40ms", "0.78", "app"]
    api = _row(text, "c2").split()
    # The client's own p99 is unknown: the probe's ratio speaks for it, and says so.
    assert api[6:10] == ["N/A", "25ms", "1.40", "probe"]


def test_offline_rows_show_thawed_fraction_restarts_evictions():
    text = render_status(_v2_status())
    head = next(line for line in text.splitlines() if "THAWED 1M" in line).split()
    row = _row(text, "c3").split()
    assert head[:3] == ["ID", "NAME", "USER"]
    assert row[6:10] == ["30%", "2", "1", "throttled"]
    assert text.index("online clients") < text.index("offline clients")


def test_gpu_gate_and_why():
    text = render_status(_v2_status())
    lines = text.splitlines()
    assert "duty 0.35" in lines[3]
    assert lines[4].split()[8] == "open"
    assert (
        "GPU 0 offline duty 0.35: set_duty, 12s ago: duty 0.35: probe ratio 1.40 over violation "
        "ratio 1.2" in lines
    )
    assert not any(line.startswith("GPU 1 offline") for line in lines)  # no action yet: no why
    unshared = render_status(_status([_gpu(shared=False, duty=1.0, gate=None)], []))
    assert unshared.splitlines()[3].split()[8] == "-"


def test_schema_1_answers_render_with_na():
    # A CLI upgraded before the daemon restarted gets answers without the new fields.
    on = _client(id="c1", **{"class": "online"}, slo_p99_ms=40.0, held=False, state="running")
    text = render_status(_status([_gpu()], [on, _client(id="c2")]))
    assert _row(text, "c1").split()[6:10] == ["N/A", "40ms", "N/A", "N/A"]
    assert _row(text, "c2").split()[6:9] == ["N/A", "N/A", "N/A"]
    assert "offline 0.15" not in text
    assert "duty 0.15" in text.splitlines()[3]


def test_list_splits_classes():
    st = _v2_status()
    text = render_clients(st["clients"])
    assert text.splitlines()[0] == "online clients"
    assert "offline clients" in text
    assert render_clients([c for c in st["clients"] if c["class"] == "offline"]).startswith(
        "offline clients"
    )


def test_a_queued_job_says_why_it_waits_under_the_table():
    why = (
        "cannot start: GPU 0: needs 4.00GiB, 2.00GiB free beside the 2.00GiB online reserve; "
        "GPU 1: no MPS client slot free"
    )
    queued = _client(id="c4", state="queued", held=False, uptime_s=None, waiting=why)
    running = _client(id="c3", state="running", held=False, waiting=None)
    text = render_status(_status([_gpu()], [running, queued]))
    lines = text.splitlines()
    # The row stays a table row: the reason is a note of its own, in full.
    assert _row(text, "c4").split()[-4:] == ["queued", "N/A", "cgroup", "N/A"]
    assert why not in _row(text, "c4")
    assert lines[-1] == f"c4: queued: {why}"
    assert not any(line.startswith("c3: queued") for line in lines)
    # `list` renders the same clients the same way.
    assert render_clients([running, queued]).splitlines()[-1] == f"c4: queued: {why}"
    # A daemon without the field, or a job no admission round has seen yet: no note.
    assert "queued:" not in render_clients([_client(id="c5", state="queued", held=False)])


def test_a_long_waiting_reason_is_clipped_and_points_at_json():
    why = "cannot start: " + "; ".join(
        f"GPU {i}: needs 40.00GiB, 8.00GiB free beside the 2.00GiB online reserve" for i in range(8)
    )
    text = render_clients([_client(id="c9", state="queued", held=False, waiting=why)])
    note = text.splitlines()[-1]
    assert note.startswith("c9: queued: cannot start: GPU 0: needs 40.00GiB")
    assert note.endswith("... (all of it: --json)")
    assert len(note) < len(why)
    assert "GPU 7" not in note


def test_the_queue_column_says_what_was_asked_and_how_it_runs():
    def queue_cell(queue):
        text = render_clients([_client(offline={"queue": queue})])
        header, row = text.splitlines()[1:3]
        assert header.split()[-1] == "QUEUE"
        return row[header.index("QUEUE") :].strip()

    assert queue_cell({"asked": None, "now": "deep", "shallow": None}) == "deep"
    assert queue_cell({"asked": "shallow", "now": "shallow", "shallow": "4 in flight"}) == (
        "shallow (4 in flight)"
    )
    assert (
        queue_cell({"asked": "auto", "now": "shallow", "shallow": "blocking"}) == "auto (blocking)"
    )
    assert queue_cell({"asked": "auto", "now": "deep", "shallow": None}) == "auto (deep)"
    assert queue_cell({"asked": "auto", "now": None, "shallow": None}) == "auto"  # not running
    assert queue_cell(None) == "N/A"  # an older daemon


def test_status_says_when_an_untrusted_file_was_refused():
    status = _status([_gpu()], [])
    assert "not trusted" not in render_status(status)
    status["daemon"]["trust_refusals"] = {"the in-flight library": 3}
    lines = render_status(status).splitlines()
    assert lines[1] == (
        "refused as not trusted: the in-flight library (3x); `gpushare doctor` names the fix"
    )
