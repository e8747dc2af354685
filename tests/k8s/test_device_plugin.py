"""The device plugin against a fake kubelet over real gRPC and a real daemon (fake GPUs and MPS).

The plugin runs as ``gpushare k8s device-plugin`` in its own process; the kubelet's side is
tests/k8s/fake_kubelet.py on real Unix sockets; the daemon is tests/support/daemon_proc.py (a real
daemon process with two fake GPUs and a fake MPS node whose state a file sets).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from tests.fakes.fake_gpu import fake_uuid
from tests.k8s.fake_kubelet import FakeKubelet

ONLINE = "gpushare.io/online"
OFFLINE = "gpushare.io/offline"
# The daemon adopts marked processes (what the plugin's environment carries); the scan sees the
# whole host, so the rule also asks for a token of this test's own.
TOKEN = {"GSTEST_K8S": uuid.uuid4().hex}
RULE = (
    f'[[adopt]]\nname = "pods"\nmarker = true\nenv = {{ GSTEST_K8S = "{TOKEN["GSTEST_K8S"]}" }}\n'
)
FAST = 'adopt_scan_period = "100ms"\nadopt_min_age = "200ms"'


Node = tuple[DaemonProc, FakeKubelet, subprocess.Popen[bytes], Path]


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with _node(RULE) as n:
        yield n


@contextlib.contextmanager
def _node(extra_toml: str) -> Iterator[Node]:
    """A real daemon (two fake GPUs), a fake kubelet and the plugin as its own process."""
    daemon = DaemonProc(extra_toml, daemon_toml=FAST).start()
    kdir = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    kubelet = FakeKubelet(kdir)
    err = open(kdir.parent / f"{kdir.name}.plugin.log", "wb")  # noqa: SIM115
    plugin = subprocess.Popen(
        [sys.executable, "-m", "gpushare", "k8s", "device-plugin", "--kubelet-dir", str(kdir),
         "--config", str(daemon.config_path), "--socket", str(daemon.socket), "--poll", "200ms"],
        cwd=REPO, stdout=err, stderr=err,
    )  # fmt: skip
    try:
        yield daemon, kubelet, plugin, Path(err.name)
    finally:
        plugin.send_signal(signal.SIGTERM)
        try:
            plugin.wait(10)
        except subprocess.TimeoutExpired:
            plugin.kill()
            plugin.wait(5)
        err.close()
        kubelet.stop()
        daemon.cleanup()
        shutil.rmtree(kdir, ignore_errors=True)
        Path(err.name).unlink(missing_ok=True)


def _paths(daemon: DaemonProc) -> dict[str, str]:
    return daemon.call("status")["daemon"]["paths"]


def _gpus(daemon: DaemonProc) -> list[str]:
    return [g["uuid"] for g in daemon.call("status")["gpus"]]


def test_registers_both_resources_and_lists_replicas_per_gpu(node) -> None:
    daemon, kubelet, _plugin, _log = node
    for resource, replicas in ((ONLINE, 4), (OFFLINE, 10)):
        ep = kubelet.endpoint(resource)
        kubelet.wait(lambda ep=ep: ep.devices, what=f"{resource} devices")
        assert ep.options.get_preferred_allocation_available
        assert not ep.options.pre_start_required
        uuids = _gpus(daemon)
        assert sorted(ep.devices) == sorted(f"{u}::{n}" for u in uuids for n in range(replicas))
        assert set(ep.devices.values()) == {"Healthy"}
    got = {r for r, _e, v in kubelet.registrations if v == "v1beta1"}
    assert got == {ONLINE, OFFLINE}


def _container_view(mounts, api_socket: str, latency_socket: str) -> str:
    """What a process sees through exactly these mounts: a private mount namespace and a chroot."""
    script = r"""
import json, os, socket, subprocess, sys, tempfile
mounts, api, lat, root = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", root], check=True)
for host, ctr in mounts:
    target = root + ctr
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.isdir(host):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "w").close()
    subprocess.run(["mount", "--bind", host, target], check=True)
os.chroot(root)
os.chdir("/")
out = []
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(api)
    out.append("api:reached")
except OSError as exc:
    out.append(f"api:{type(exc).__name__}")
d = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    d.sendto(b"x", lat)
    out.append("latency:reached")
except OSError as exc:
    out.append(f"latency:{type(exc).__name__}")
print(" ".join(out))
"""
    import json

    pairs = json.dumps([[m.host_path, m.container_path] for m in mounts])
    root = tempfile.mkdtemp(prefix="ctr-", dir="/tmp")
    try:
        res = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", script,
             pairs, api_socket, latency_socket, root],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        os.rmdir(root)  # the tmpfs and bind mounts went with the namespace
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.mark.root
@pytest.mark.parametrize(("resource", "count", "cls", "sm"), [(ONLINE, 1, "online", "100"),
                                                              (OFFLINE, 3, "offline", "30")])  # fmt: skip
def test_a_pod_gets_env_and_mounts_but_never_the_api_socket(node, resource, count, cls, sm) -> None:
    daemon, kubelet, _plugin, _log = node
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to build the container's mount namespace")
    paths = _paths(daemon)
    ids, resp = kubelet.admit(resource, count)
    assert len(ids) == count
    uuid = ids[0].partition("::")[0]
    assert all(i.startswith(uuid + "::") for i in ids), "one container, one GPU"
    env = dict(resp.envs)
    pipe = f"{paths['mps_pipe_dir']}/{uuid}"
    # The real MPS node makes the GPU's pipe directory when it starts its control daemon; the
    # fake one does not, and a bind mount needs its source.
    Path(pipe).mkdir(parents=True, exist_ok=True)
    assert env["GPUSHARE_CLASS"] == cls
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == sm
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == ("0" if cls == "online" else "1")
    assert env["GPUSHARE_GPU_UUID"] == uuid
    assert env["GPUSHARE_LATENCY_SOCKET"] == paths["latency_socket"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "GPUSHARE_SOCKET" not in env
    mounts = {m.host_path: m for m in resp.mounts}
    assert pipe in mounts and paths["latency_socket"] in mounts
    assert all(m.host_path == m.container_path for m in resp.mounts)
    assert [c.name for c in resp.cdi_devices] == [f"nvidia.com/gpu={uuid}"]
    # What the container sees through its mounts: the latency socket, not the API socket.
    view = _container_view(resp.mounts, str(daemon.socket), paths["latency_socket"])
    assert view == "api:FileNotFoundError latency:reached"


def test_gpu_health_follows_the_daemon(node) -> None:
    daemon, kubelet, _plugin, _log = node
    paths = _paths(daemon)
    sick = _gpus(daemon)[1]
    ep = kubelet.endpoint(OFFLINE)
    state = Path(paths["mps_pipe_dir"]) / f"{sick}.state"
    state.write_text("fault")
    try:
        kubelet.wait(
            lambda: {h for d, h in ep.devices.items() if d.startswith(sick)} == {"Unhealthy"},
            what="the faulty GPU's devices to turn Unhealthy",
        )
        assert {h for d, h in ep.devices.items() if not d.startswith(sick)} == {"Healthy"}
    finally:
        state.unlink()
    kubelet.wait(lambda: set(ep.devices.values()) == {"Healthy"}, what="healthy again")


def test_reregisters_after_a_kubelet_restart(node) -> None:
    _daemon, kubelet, plugin, log = node
    before = len(kubelet.registrations)
    kubelet.restart()
    kubelet.wait(
        lambda: len(kubelet.registrations) >= before + 2, timeout_s=15,
        what=f"re-registration (plugin log: {log})",
    )  # fmt: skip
    assert plugin.poll() is None
    ep = kubelet.endpoint(OFFLINE)
    kubelet.wait(lambda: ep.devices, what="devices after the restart")
    ids, resp = kubelet.admit(OFFLINE, 2)
    assert dict(resp.envs)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "20"


def test_the_nodes_policy_caps_what_a_pods_units_are_worth() -> None:
    # A node-wide cap of 60 % and 40 % for the second GPU: a request below the cap gets what it
    # asked; more units than the cap is worth get the cap, and the plugin logs it.
    first, second = fake_uuid(0), fake_uuid(1)
    policy = f'[control]\noffline_sm_pct_max = 60\n[gpus."{second}"]\noffline_sm_pct_max = 40\n'
    with _node(RULE + policy) as (_daemon, kubelet, _plugin, log):
        got = []
        for count in (3, 10, 7):  # bin-packed: 3 on the first GPU, 10 on the second, 7 on the first
            ids, resp = kubelet.admit(OFFLINE, count)
            sm = dict(resp.envs)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
            got.append((ids[0].partition("::")[0], sm))
        assert got == [(first, "30"), (second, "40"), (first, "60")]
        wait_for(lambda: log.read_text().count("share_capped") == 2, 5, "two share_capped lines")


def test_every_gpu_unhealthy_while_the_daemon_is_down(node) -> None:
    daemon, kubelet, _plugin, _log = node
    ep = kubelet.endpoint(ONLINE)
    daemon.stop()
    kubelet.wait(lambda: set(ep.devices.values()) == {"Unhealthy"}, what="every device Unhealthy")
    daemon.start()
    kubelet.wait(lambda: set(ep.devices.values()) == {"Healthy"}, what="healthy again")


POD_UID = "7a5c3b2e-1f4d-4c8a-9b6e-2d3f4a5b6c7e"


def _run_in(cgroup: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    fd = os.open(cgroup / "cgroup.procs", os.O_WRONLY)
    try:
        proc = subprocess.Popen(
            ["sleep", "60"], env={"PATH": os.environ["PATH"], **env},
            preexec_fn=lambda: os.write(fd, b"0"),
        )  # fmt: skip
    finally:
        os.close(fd)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes() != b"sleep\x0060\x00":
        assert time.monotonic() < deadline, "sleep did not start"
        time.sleep(0.005)
    return proc


def test_a_pods_two_containers_are_one_client(node) -> None:
    daemon, kubelet, _plugin, _log = node
    if (why := cgroup_skip_reason()) is not None:
        pytest.skip(why)
    # The kubelet admits a pod's containers one after the other; each gets its own Allocate.
    ids1, r1 = kubelet.admit(OFFLINE, 2)
    ids2, r2 = kubelet.admit(OFFLINE, 1)
    gpu = ids1[0].partition("::")[0]
    assert ids2[0].startswith(gpu), "bin-packed: the pod's containers share a GPU"
    # The pod's cgroups as the kubelet (systemd driver) and containerd name them.
    base = unique_base("gs-k8s-pod")
    pod = base / f"kubepods-besteffort-pod{POD_UID.replace('-', '_')}.slice"
    ctrs = [pod / f"cri-containerd-{n:064x}.scope" for n in (1, 2)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for c in ctrs:
            c.mkdir(parents=True)
        procs = [_run_in(c, {**dict(r.envs), **TOKEN}) for c, r in zip(ctrs, (r1, r2), strict=True)]
        pids = {p.pid for p in procs}

        def mine() -> list[dict]:
            return [c for c in daemon.call("status")["clients"] if c["pid"] in pids]

        first = wait_for(mine, 10, "the pod adopted")
        time.sleep(1.0)  # several more scans (100 ms each, 200 ms minimum age): no second client
        clients = mine()
        assert len(clients) == 1, clients
        c = clients[0]
        assert c["id"] == first[0]["id"]
        assert (c["class"], c["gpu_uuid"]) == ("offline", gpu)
        assert c["pause_mechanism"] == "cgroup", c["pause_reason"]
        assert c["pause_reason"] == (
            f"cgroup freezer on its pod's cgroup (GPUSHARE_CLIENT_SCOPE=pod): {pod}"
        )
        daemon.call("pause", {"client_id": c["id"]})
        for cg in (pod, *ctrs):
            assert "frozen 1" in (cg / "cgroup.events").read_text(), cg
        daemon.call("resume", {"client_id": c["id"]})
        for cg in ctrs:
            wait_for(lambda cg=cg: "frozen 0" in (cg / "cgroup.events").read_text(), 5, "thawed")
    finally:
        for p in procs:
            p.kill()
            p.wait(5)
        remove_tree(base)
