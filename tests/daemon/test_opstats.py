"""OpStats: the per-client and per-GPU figures status and /metrics show, and their bounds."""

import pytest

from gpushare.daemon.opstats import LastAction, OpStats, Tracked, gate_status, latency_status
from gpushare.latency.p99 import LatencyP99
from gpushare.model import ClientState


def test_sync_tracks_live_clients_and_drops_ended_ones():
    ops = OpStats()
    ops.sync([Tracked("c1", live=True, thawed=True), Tracked("c2", live=True, thawed=False)], 0.0)
    ops.paused("c1", True, 15.0)
    ops.evicted("c2", "GPU-a")
    fields = ops.offline_fields("c1", ClientState.FROZEN, 30.0)
    assert fields["thawed_s"] == pytest.approx(15.0)
    assert fields["thawed_ratio_1m"] == pytest.approx(0.5)
    assert ops.offline_fields("c2", ClientState.THROTTLED, 30.0)["thawed_ratio_1m"] == 0.0
    # c2 was evicted and requeued (known, not live); c1 ended.
    ops.sync([Tracked("c2", live=False, thawed=True, queued=True, queued_since_wall_s=100.0)], 31)
    assert ops.thaw.clients() == []
    assert ops.offline_fields("c2", ClientState.QUEUED, 31.0) == {
        "thawed_ratio_1m": None, "thawed_s": None, "evictions": 1}  # fmt: skip
    assert ops.offline_fields("c1", ClientState.EXITED, 31.0)["evictions"] is None
    ops.sync([], 32.0)
    assert ops.evictions("c2") == 0
    assert ops.gpu_evictions("GPU-a") == 1  # node lifetime, per GPU: a fixed set
    assert ops._queued_since == {}


def test_admission_waits():
    ops = OpStats()
    assert ops.admission(0, 1000.0).oldest_wait_s is None
    ops.sync([Tracked("q1", live=False, thawed=True, queued=True, queued_since_wall_s=900.0),
              Tracked("q2", live=False, thawed=True, queued=True, queued_since_wall_s=990.0)],
             5.0)  # fmt: skip
    adm = ops.admission(2, 1000.0)
    assert (adm.queued, adm.oldest_wait_s) == (2, 100.0)
    ops.admitted("q1", 1000.0)
    ops.admitted("never-queued", 1000.0)
    adm = ops.admission(1, 1000.0)
    assert adm.oldest_wait_s == 10.0
    assert adm.wait_s is not None
    assert (adm.wait_s.count, adm.wait_s.sum_s) == (1, 100.0)


def test_step_histograms_per_gpu():
    ops = OpStats()
    assert ops.step_histogram("GPU-a") is None
    ops.stepped("GPU-a", 0.0003)
    ops.stepped("GPU-a", 2.0)
    h = ops.step_histogram("GPU-a")
    assert h.count == 2
    assert dict(h.buckets)[0.0005] == 1
    assert h.buckets[-1][1] == 1  # 2 s is past the last bound: only in +Inf


def test_latency_from_app_prometheus_or_probe():
    app = latency_status(LatencyP99(30.0, 500, source="app"), 40.0, 1.1, 1.5)
    assert (app["p99_ms"], app["ratio"], app["source"]) == (30.0, 0.75, "app")
    prom = latency_status(LatencyP99(60.0, 80, source="prometheus"), 40.0, None, 1.5)
    assert (prom["ratio"], prom["source"]) == (1.5, "prometheus")
    # No report of its own: the probe speaks for it, against the probe's own limit.
    none = latency_status(LatencyP99(None, 2, "only 2 reports", source="app"), 40.0, 1.8, 1.5)
    assert (none["p99_ms"], none["source"], none["reason"]) == (None, "probe", "only 2 reports")
    assert none["ratio"] == pytest.approx(1.2)
    blind = latency_status(None, 40.0, None, 1.5)
    assert (blind["ratio"], blind["source"], blind["reason"]) == (None, None, "no latency reports")
    no_slo = latency_status(LatencyP99(30.0, 500, source="app"), None, 1.1, 1.5)
    assert (no_slo["ratio"], no_slo["source"]) == (None, "app")


def test_gate_states_and_why():
    assert gate_status(1.0, None, 5.0) == {"state": "open", "duty": 1.0, "last_action": None}
    assert gate_status(0.0, None, 5.0)["state"] == "closed"
    last = LastAction("set_duty", "duty 0.3: probe ratio 1.4", at_wall_s=1.7e9, at_mono_s=2.0)
    gate = gate_status(0.3, last, 14.5)
    assert gate["state"] == "cycling"
    assert gate["last_action"] == {"kind": "set_duty", "reason": "duty 0.3: probe ratio 1.4",
                                   "client_id": None, "at": 1.7e9, "age_s": 12.5}  # fmt: skip
