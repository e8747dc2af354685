"""The human status view: missing readings print N/A (never 0), percentages are readable.

Cells are read by their column's header (:func:`cell`), so a test says which column it means.
"""

import re

from gpushare.cli.render import WIDTH, mps_down, render_clients, render_list, render_status


def cell(text: str, first: str, header: str) -> str:
    """The cell under ``header`` in the row starting with ``first`` (the table above it)."""
    lines = text.splitlines()
    n = next(i for i, line in enumerate(lines) if line.startswith(first + " ") or line == first)
    head = next(
        lines[i]
        for i in range(n - 1, -1, -1)
        if re.search(rf"(^|  ){re.escape(header)}(  |$)", lines[i])
    )
    start = re.search(rf"(^|  ){re.escape(header)}(  |$)", head).start() + (
        0 if head.startswith(header) else 2
    )
    rest = [m.start() for m in re.finditer(r"  (?=\S)", head) if m.start() > start]
    end = rest[0] + 2 if rest else None
    return lines[n][start:end].strip()


def _gpu(**over):
    g = {
        "index": 0, "uuid": "GPU-aaaa", "name": "NVIDIA H100 80GB HBM3", "shared": True, "mem_used_bytes": 10 << 30,
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
    text = render_status(_status([_gpu()], []), wide=True)
    assert cell(text, "0", "UTIL") == "15.9%"
    assert cell(text, "0", "OFFLINE SM") == "33.3%"
    assert cell(text, "0", "PROBE") == "0.27ms"
    assert cell(text, "0", "OFFLINE") == "duty 0.15"
    assert "15.9368" not in text


def test_the_sm_column_says_when_offline_launches_at_the_online_priority():
    # 0: launched at the online clients' MPS priority; 1 (and an older daemon's status, without
    # the key) says nothing more.
    for wide, header in ((True, "OFFLINE SM"), (False, "SM")):
        text = render_status(_status([_gpu(offline_mps_priority=0)], []), wide=wide)
        assert cell(text, "0", header) == "33.3% p0"
        for g in (_gpu(offline_mps_priority=1), _gpu()):
            assert cell(render_status(_status([g], []), wide=wide), "0", header) == "33.3%"


def test_request_gate_columns_show_the_gate_and_requests_in_flight():
    gate = {"enabled": True, "closed": True, "inflight": 3, "signalled_clients": 1,
            "busy_fraction": 0.4, "closes": 12}  # fmt: skip

    def gate_cells(g):
        text = render_status(_status([g], []), wide=True)
        return [cell(text, "0", "REQUESTS"), cell(text, "0", "IN FLIGHT")]

    assert gate_cells(_gpu(request_gate=gate)) == ["closed", "3"]
    assert gate_cells(_gpu(request_gate={**gate, "closed": False, "inflight": 0})) == ["open", "0"]
    assert gate_cells(_gpu(request_gate={**gate, "enabled": False, "closed": False})) == [
        "off",
        "3",
    ]
    assert gate_cells(_gpu()) == ["N/A", "N/A"]  # an older daemon: no request gate in its status
    # A gate delay: offline work runs beside the first 16 ms of each busy spell.
    delayed = {**gate, "closed": False, "inflight": 1, "delay_ms": 16.0}
    assert gate_cells(_gpu(request_gate=delayed)) == ["open+16ms", "1"]
    assert gate_cells(_gpu(request_gate={**delayed, "enabled": False})) == ["off", "1"]
    assert gate_cells(_gpu(shared=False, request_gate=None)) == ["-", "-"]
    # The default view has the gate's state in GATE.
    text = render_status(_status([_gpu(request_gate=delayed)], []))
    assert cell(text, "0", "GATE") == "open+16ms"


def test_missing_readings_are_na_not_zero():
    text = render_status(_status([_gpu(gpu_util_pct=None, mps_state=None)], [_client()]))
    assert [cell(text, "0", "UTIL"), cell(text, "0", "MPS")] == ["N/A", "N/A"]
    assert cell(text, "c1", "THAWED") == "N/A"
    assert cell(text, "c1", "STATE") == "frozen (held)"
    assert " 0%" not in text.splitlines()[-1]


def test_no_clients_and_errors():
    text = render_status(_status([_gpu(error="nvml call timed out")], []))
    assert "error: nvml call timed out" in text
    assert text.endswith("no clients")


def test_mps_down_only_for_shared_gpus():
    assert mps_down(_status([_gpu(mps_state="fault")], []))
    assert not mps_down(_status([_gpu(mps_state="down", shared=False)], []))
    assert not mps_down(_status([_gpu()], []))


def test_an_adopted_client_says_who_adopted_it_and_how_it_is_paused():
    adopted = _client(
        id="c2", pause_mechanism="signal", adopted_by="slurm job 42",
        pause_reason="SIGSTOP/SIGCONT: /sys/fs/cgroup/x also holds pid 7, which is not part of the client",
    )  # fmt: skip
    text = render_clients([_client(adopted_by=None), adopted], wide=True)
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
    assert render_clients([c], wide=True).splitlines()[-1] == (
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


def test_online_rows_show_p99_against_slo_and_source():
    text = render_status(_v2_status(), wide=True)
    cols = ["P99", "SLO", "P99/SLO", "SOURCE"]
    assert [cell(text, "c1", h) for h in cols] == ["31.2ms", "40ms", "0.78", "app"]
    # The client's own p99 is unknown: the probe's ratio speaks for it, and says so.
    assert [cell(text, "c2", h) for h in cols] == ["N/A", "25ms", "1.40", "probe"]
    short = render_status(_v2_status())
    assert cell(short, "c1", "P99/SLO") == "31.2ms/40ms"


def test_offline_rows_show_thawed_fraction_restarts_evictions():
    text = render_status(_v2_status(), wide=True)
    cols = ["THAWED 1M", "RESTARTS", "EVICTIONS", "STATE"]
    assert [cell(text, "c3", h) for h in cols] == ["30%", "2", "1", "throttled"]
    assert text.index("online clients") < text.index("offline clients")


def test_every_client_shows_its_pid_restarts_and_age():
    st = _v2_status()
    for c in st["clients"]:
        c.update(pid=4242, restarts=c.get("restarts", 0), submitted_at=1000.0)
    text = render_status(st, now=1000.0 + 7320)
    for cid in ("c1", "c2", "c3"):
        assert cell(text, cid, "PID") == "4242"
        assert cell(text, cid, "AGE") == "2h"
        assert cell(text, cid, "RESTARTS") in ("0", "2")


def test_gpu_gate_and_why():
    text = render_status(_v2_status(), wide=True)
    lines = text.splitlines()
    assert cell(text, "0", "OFFLINE") == "duty 0.35"
    assert cell(text, "1", "OFFLINE") == "open"
    assert (
        "GPU 0 offline duty 0.35: set_duty, 12s ago: duty 0.35: probe ratio 1.40 over violation "
        "ratio 1.2" in lines
    )
    assert not any(line.startswith("GPU 1 offline") for line in lines)  # no action yet: no why
    unshared = render_status(_status([_gpu(shared=False, duty=1.0, gate=None)], []), wide=True)
    assert cell(unshared, "0", "OFFLINE") == "-"


def test_schema_1_answers_render_with_na():
    # A CLI upgraded before the daemon restarted gets answers without the new fields.
    on = _client(id="c1", **{"class": "online"}, slo_p99_ms=40.0, held=False, state="running")
    text = render_status(_status([_gpu()], [on, _client(id="c2")]), wide=True)
    cols = ["P99", "SLO", "P99/SLO", "SOURCE"]
    assert [cell(text, "c1", h) for h in cols] == ["N/A", "40ms", "N/A", "N/A"]
    assert [cell(text, "c2", h) for h in ["THAWED 1M", "RESTARTS", "EVICTIONS"]] == ["N/A"] * 3
    assert "offline 0.15" not in text
    assert cell(text, "0", "OFFLINE") == "duty 0.15"


def test_the_default_view_fits_100_columns_and_wide_has_it_all():
    st = _v2_status()
    st["gpus"][0]["uuid"] = "GPU-5c3a9e4f-8f3b-2d1e-7a6c-0b9d8e7f6a5b"
    long_name = "a-rather-long-service-name-for-the-frontend"
    st["clients"][0].update(name=long_name, pid=4194303, restarts=12, submitted_at=0.0)
    st["clients"][2]["waiting"] = "cannot start: " + "GPU 0: needs 40.00GiB; " * 20
    text = render_status(st, now=1e6)
    assert max(len(line) for line in text.splitlines()) <= WIDTH, text
    assert "H100 80GB HBM3" in text and "NVIDIA" not in text  # the model, as nvidia-smi -L
    assert long_name not in text and "GPU-5c3a9e4f-8f3b" not in text
    wide = render_status(st, wide=True, now=1e6)
    assert long_name in wide and "GPU-5c3a9e4f-8f3b-2d1e-7a6c-0b9d8e7f6a5b" in wide
    assert st["clients"][2]["waiting"] in wide


def test_colour_only_when_asked():
    st = _v2_status()
    assert "\x1b[" not in render_status(st)
    coloured = render_status(st, colour=True)
    assert "\x1b[33mthrottled" in coloured  # attention: yellow
    assert "\x1b[31m" in coloured  # c2's p99 over its SLO: red
    # Colour never moves a column: the text without escapes is the plain view.
    assert re.sub(r"\x1b\[[0-9;]*m", "", coloured) == render_status(st)


def test_list_shows_state_exit_age_and_reason():
    ended = _client(id="c7", state="failed", held=False, exit_code=3, submitted_at=0.0,
                    reason="exit code 3 (probably: CUDA out of memory; see /var/log/c7.log)")  # fmt: skip
    waiting = _client(id="c8", state="queued", held=False, queue_position=2, submitted_at=50.0,
                      waiting="cannot start: GPU 0: needs 6G", gpu_index=None, pid=None)  # fmt: skip
    text = render_list([ended, waiting], now=3600.0)
    assert [cell(text, "c7", h) for h in ("STATE", "EXIT", "AGE")] == ["failed", "3", "60m"]
    assert cell(text, "c7", "REASON").startswith("exit code 3 (probably: CUDA")
    assert [cell(text, "c8", h) for h in ("GPU", "PID", "STATE")] == ["-", "-", "queued(2)"]
    assert cell(text, "c8", "REASON") == "GPU 0: needs 6G"
    assert "N/A/-" not in text
    assert max(len(line) for line in text.splitlines()) <= WIDTH


def test_a_queued_job_says_why_it_waits_under_the_table():
    why = (
        "cannot start: GPU 0: needs 4.00GiB, 2.00GiB free beside the 2.00GiB online reserve; "
        "GPU 1: no MPS client slot free"
    )
    queued = _client(id="c4", state="queued", held=False, uptime_s=None, waiting=why,
                     queue_position=1, gpu_index=None, sm_pct=None)  # fmt: skip
    running = _client(id="c3", state="running", held=False, waiting=None)
    text = render_status(_status([_gpu()], [running, queued]), wide=True)
    lines = text.splitlines()
    # The row stays a table row: the reason is a note of its own, in full.
    assert [cell(text, "c4", h) for h in ("GPU", "SM", "STATE")] == ["-", "-", "queued(1)"]
    assert lines[-1] == f"c4: queued: {why}"
    assert not any(line.startswith("c3: queued") for line in lines)
    # The default view cuts the note to the width and says where the rest is.
    short = render_clients([running, queued]).splitlines()[-1]
    assert short.startswith("c4: queued: cannot start: GPU 0") and short.endswith("(-o wide)")
    assert len(short) <= WIDTH
    # A daemon without the field, or a job no admission round has seen yet: no note.
    assert "queued:" not in render_clients([_client(id="c5", state="queued", held=False)])


def test_the_queue_column_says_what_was_asked_and_how_it_runs():
    def queue_cell(queue):
        return cell(render_clients([_client(offline={"queue": queue})], wide=True), "c1", "QUEUE")

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
