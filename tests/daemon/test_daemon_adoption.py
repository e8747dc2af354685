"""A real daemon process adopts running processes by rule and by job, pauses them where they are,
keeps them across its own restart, and refuses what it may not do (tests/support/daemon_proc.py: fake GPU
and MPS, everything else real)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.daemon_helpers import DaemonProc, call_as, python_for_others, wait_for
from gpushare import config
from gpushare.control.adoption import FACT_ENV, Rule, decide
from gpushare.daemon.adopter import Found
from gpushare.daemon.core import Daemon
from gpushare.daemon.registry import Registry
from gpushare.node.adopted import AdoptingPauser
from gpushare.node.procs.facts import process_facts
from gpushare.node.signal_pauser import SignalPauser
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode

FAST = 'adopt_scan_period = "100ms"\nadopt_min_age = "200ms"'
# The scan sees the whole host: the rules match only this test's processes (a token of its own in
# their environment), never another test's running beside it.
TOKEN = {"GSTEST_ADOPT": uuid.uuid4().hex}
POD_UID = "7a5c3b2e-1f4d-4c8a-9b6e-2d3f4a5b6c7d"
CID = "3f1b5a0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a"
RULE = f'[[adopt]]\nname = "svc"\nmarker = true\nenv = {{ GSTEST_ADOPT = "{TOKEN["GSTEST_ADOPT"]}" }}\n'


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs_: list[subprocess.Popen[bytes]] = []
    yield procs_
    for p in procs_:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
            os.killpg(p.pid, signal.SIGCONT)
        p.wait(timeout=5)


@pytest.fixture
def leaf() -> Iterator[Path | None]:
    """A cgroup of its own for a process (a service's), where cgroups can be made here."""
    if cgroup_skip_reason() is not None:
        yield None
        return
    base = unique_base("gs-adopt-leaf")
    # Named as the kubelet (systemd driver) and containerd name a pod's container.
    path = (
        base
        / f"kubepods-besteffort-pod{POD_UID.replace('-', '_')}.slice"
        / f"cri-containerd-{CID}.scope"
    )
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        remove_tree(base)


def _run(started, env: dict[str, str], cgroup: Path | None = None) -> subprocess.Popen[bytes]:
    fd = os.open(cgroup / "cgroup.procs", os.O_WRONLY) if cgroup is not None else None
    try:
        proc = subprocess.Popen(
            ["sleep", "60"], env={"PATH": os.environ["PATH"], **TOKEN, **env}, start_new_session=True,
            preexec_fn=(lambda: os.write(fd, b"0")) if fd is not None else None,
        )  # fmt: skip
    finally:
        if fd is not None:
            os.close(fd)
    started.append(proc)
    # Popen returns once the exec has begun; the new image's environment is readable only after
    # the kernel has laid out its stack (its arguments appear at the same moment).
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes() != b"sleep\x0060\x00":
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.005)
    return proc


def _adopted(d: DaemonProc, pid: int) -> dict[str, Any] | None:
    return next((c for c in d.call("status")["clients"] if c["pid"] == pid), None)


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2]


def test_processes_are_adopted_by_rule_paused_where_they_are_and_readopted_after_a_restart(
    started, leaf
):
    d = DaemonProc(RULE, daemon_toml=FAST)
    try:
        d.start()
        gpu = fake_uuid(0)
        shared = _run(started, {"GPUSHARE_CLASS": "offline", "GPUSHARE_GPU_UUID": gpu})
        bad = _run(started, {"GPUSHARE_CLASS": "batch"})
        c = wait_for(lambda: _adopted(d, shared.pid), 10, "the marked process adopted")
        assert (c["class"], c["gpu_uuid"], c["state"]) == ("offline", gpu, "running")
        assert c["adopted_by"] == f"rule 'svc' ({d.config_path})"
        # Started in the test's own cgroup: not a cgroup of its own, so signals.
        assert c["pause_mechanism"] == "signal"
        assert c["pause_reason"].startswith("SIGSTOP/SIGCONT: ")
        d.call("pause", {"client_id": c["id"]})
        assert _state(shared.pid) == "T"
        d.call("resume", {"client_id": c["id"]})
        wait_for(lambda: _state(shared.pid) != "T", 5, "SIGCONT")
        refused = wait_for(
            lambda: [e for e in d.events() if e["kind"] == "adoption_refused"], 10, "the refusal"
        )
        assert [e["message"] for e in refused] == [
            f"pid {bad.pid} (sleep) of root not adopted: GPUSHARE_CLASS='batch' is not a class: "
            "use online or offline"
        ]
        assert _adopted(d, bad.pid) is None
        own = None
        if leaf is not None:
            own = _run(started, {"GPUSHARE_CLASS": "online", "GPUSHARE_GPU_UUID": gpu}, leaf)
            o = wait_for(lambda: _adopted(d, own.pid), 10, "the process in its own cgroup")
            assert o["pause_mechanism"] == "cgroup", o["pause_reason"]
            assert o["pause_reason"] == f"cgroup freezer on its own cgroup: {leaf}"
            # A pod's container, named in status from the process's real cgroup path.
            assert o["container"] == {"id": CID, "runtime": "containerd", "pod_uid": POD_UID,
                                      "qos": "besteffort"}  # fmt: skip
            assert c["container"] is None
        # A job registered over the API survives the restart too.
        reg = d.call("adopt", {"source": "test", "job": "7", "uid": 0, "cls": "offline",
                               "match_env": {"JOB": "7", **TOKEN}})  # fmt: skip
        assert reg == {"source": "test", "job": "7", "adopted": []}
        d.kill9()
        os.kill(shared.pid, 0)  # the workloads outlive the daemon
        d.start()
        again = _adopted(d, shared.pid)
        assert again is not None and again["id"] == c["id"]
        assert again["pause_reason"].startswith("SIGSTOP/SIGCONT: ")
        readopted = [e for e in d.events() if e["kind"] == "client_readopted"]
        assert len(readopted) == (2 if own is not None else 1)
        d.call("pause", {"client_id": c["id"]})
        assert _state(shared.pid) == "T"
        d.call("resume", {"client_id": c["id"]})
        if own is not None:
            o = _adopted(d, own.pid)
            assert o is not None and o["pause_mechanism"] == "cgroup"
            d.call("pause", {"client_id": o["id"]})
            assert "frozen 1" in (leaf / "cgroup.events").read_text()
            d.call("resume", {"client_id": o["id"]})
        nogpu = _run(started, {"JOB": "7"})  # two GPUs here: which one is its?
        wait_for(
            lambda: [e for e in d.events() if e["message"].startswith(
                f"pid {nogpu.pid} (sleep) of root not adopted by test job 7: it does not say which "
                "of the 2 shared GPUs it uses; start it with the environment of `gpushare env --gpu G`"
            )], 10, "the GPU-less process refused",
        )  # fmt: skip
        job = _run(started, {"JOB": "7", "GPUSHARE_GPU_UUID": gpu})
        j = wait_for(lambda: _adopted(d, job.pid), 10, "the registered job's process")
        assert (j["adopted_by"], j["class"]) == ("test job 7", "offline")
        # Released: its client ends, its process runs on, thawed.
        d.call("pause", {"client_id": j["id"]})
        assert d.call("release", {"source": "test", "job": "7"})["released"] == [j["id"]]
        assert d.client(j["id"])["state"] == "exited"
        assert d.client(j["id"])["reason"] == "released: test job 7 ended"
        wait_for(lambda: _state(job.pid) != "T", 5, "the released process thawed")
        # An adopted process's exit is noticed like a launched one's.
        shared.kill()
        shared.wait()
        wait_for(lambda: d.client(c["id"])["state"] in ("exited", "failed"), 10, "the adopted exit")
    finally:
        d.cleanup()


def test_a_rule_in_a_users_config_adopts_that_users_processes_only(started):
    token = TOKEN["GSTEST_ADOPT"]
    rule = f'[[adopt]]\nname = "all"\nuser = "root"\nclass = "offline"\nenv = {{ GSTEST_ADOPT = "{token}" }}\n'
    d = DaemonProc(rule, daemon_toml=FAST)
    os.chown(d.config_path, 1000, 1000)  # not root's config
    try:
        d.start()
        p = _run(started, {"X": "1"})
        refused = wait_for(
            lambda: [e["message"] for e in d.events() if f"pid {p.pid} " in e["message"]], 10,
            "the refusal",
        )  # fmt: skip
        assert refused == [
            f"rule 'all' ({d.config_path}, uid 1000) would adopt pid {p.pid} (sleep) of root as "
            "offline, which its owner did not ask for (no GPUSHARE_CLASS in its environment); "
            "only a rule in root's config may do that"
        ]
        assert _adopted(d, p.pid) is None
    finally:
        d.cleanup()


def test_bad_adopt_requests_are_refused_and_change_nothing():
    d = DaemonProc(daemon_toml=FAST)
    try:
        d.start()
        base = {"source": "slurm", "job": "9", "uid": 1000, "cls": "offline",
                "match_env": {"SLURM_JOB_ID": "9", **TOKEN}}  # fmt: skip
        for params, message in [
            ({"cls": "batch"}, "class 'batch' is not a class: use online or offline"),
            ({"match_env": {}}, "give match_env"),
            ({"gpu": "0"}, "leave gpu out"),
            ({"sm_pct": 0.0}, "--sm must be a percentage in (0, 100]"),
        ]:
            with pytest.raises(Exception, match=re.escape(message)):
                d.call("adopt", {**base, **params})
        if python_for_others() is not None:
            out = call_as(1001, 1001, d.socket, "adopt", base)
            assert out["error"] == "PERMISSION_DENIED"
            assert out["message"].startswith("uid 1001 may register its own processes only")
            d.call("adopt", base)  # root may
            out = call_as(1001, 1001, d.socket, "release", {"source": "slurm", "job": "9"})
            assert out["error"] == "PERMISSION_DENIED"
        # A release of a job never registered is no error (an Epilog runs for every job).
        assert d.call("release", {"source": "slurm", "job": "404"})["released"] == []
        assert not [e for e in d.events() if e["kind"] == "job_released" and "404" in e["message"]]
    finally:
        d.cleanup()


def test_a_process_that_exits_while_it_is_being_adopted_leaves_nothing_behind(started):
    # Not tmp_path: other pytest sessions of this user may prune it while the daemon runs.
    base = Path(tempfile.mkdtemp(prefix="gsad-", dir="/tmp"))
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
socket = "{base}/api.sock"
[daemon]
adopt_scan_period = "1h"
[probe]
enabled = false
""")  # fmt: skip
    d = Daemon(
        cfg, registry=Registry.open(base / "db.sqlite"), gpu=FakeGpuBackend(gpus=1),
        mps=FakeMpsNode(pipe_root=base / "mps"), pauser=AdoptingPauser(SignalPauser()),
    )  # fmt: skip
    d.start()
    try:
        p = _run(started, {"GPUSHARE_CLASS": "offline"})
        facts = process_facts(p.pid, FACT_ENV)
        assert facts is not None
        rule = Rule(config.AdoptRule(name="m", marker=True), 0, "test")
        found = Found(decide([rule], facts), facts, "rule 'm' (test)")
        assert found.decision.adopt
        p.kill()
        p.wait()
        with d.state.lock:
            assert d.adoptions._adopt(found) is None
        assert d.registry.clients(include_final=True) == []
        (event,) = [e for e in d.registry.events() if e.kind == "adoption_refused"]
        assert event.message == (
            f"pid {p.pid} (sleep) of root exited while it was being adopted by rule 'm' (test); "
            "nothing recorded"
        )
    finally:
        d.shutdown()
        d.registry.close()
        shutil.rmtree(base, ignore_errors=True)
