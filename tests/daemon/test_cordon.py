"""The drained-GPU set (gpushare/daemon/cordon.py) on its own: file, failures, queued jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpushare.daemon.cordon import Cordon, Cordons, held_by_drain
from gpushare.model import GpuSample, QueuedJob


def test_the_set_survives_a_new_instance_and_the_file_is_private(tmp_path: Path):
    path = tmp_path / "drained.json"
    Cordons(path).set(add=[Cordon("GPU-a", 1.0, "root", "upgrade")])
    again = Cordons(path)
    assert again.get("GPU-a") == Cordon("GPU-a", 1.0, "root", "upgrade")
    assert path.stat().st_mode & 0o777 == 0o600
    again.set(remove=["GPU-a"])
    assert Cordons(path).drained() == set()


def test_a_drain_that_cannot_be_written_changes_nothing(tmp_path: Path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    cordons = Cordons(blocker / "drained.json")
    with pytest.raises((FileExistsError, NotADirectoryError)):
        cordons.set(add=[Cordon("GPU-a", 1.0, "root")])
    assert cordons.drained() == set()


def test_an_unreadable_file_is_reported_and_counts_as_no_drain(tmp_path: Path):
    path = tmp_path / "drained.json"
    path.write_text(json.dumps({"drained": [{"gpu_uuid": "GPU-a"}]}))  # fields missing
    cordons = Cordons(path)
    assert cordons.drained() == set()
    assert cordons.load_error is not None and str(path) in cordons.load_error


def _sample(index: int, uuid: str) -> GpuSample:
    return GpuSample(index=index, uuid=uuid, name="sim", mem_total_bytes=1 << 34,
                     mem_used_bytes=0, gpu_util_pct=0.0)  # fmt: skip


def _job(cid: str, gpu: str | None) -> QueuedJob:
    return QueuedJob(client_id=cid, uid=0, mem_bytes=None, sm_pct=None, gpu=gpu,
                     submitted_at_s=0.0, restartable=True)  # fmt: skip


def test_queued_jobs_say_they_wait_for_a_drain():
    samples = [_sample(0, "GPU-a"), _sample(1, "GPU-b")]
    jobs = [_job("c1", "0"), _job("c2", "GPU-b"), _job("c3", None)]
    waiting = {"c1": "no room", "c2": "no room", "c3": "no room"}
    got = held_by_drain(jobs, waiting, samples, {"GPU-a"}, {"GPU-b": object()})
    assert got == {"c1": "GPU 0 is draining (gpushare undrain)"}
    got = held_by_drain(jobs, waiting, samples, {"GPU-a", "GPU-b"}, {})
    assert got == {
        "c1": "GPU 0 is draining (gpushare undrain)",
        "c2": "GPU 1 is draining (gpushare undrain)",
        "c3": "every GPU is draining (gpushare undrain)",
    }
    assert held_by_drain(jobs, waiting, samples, set(), {}) == {}
