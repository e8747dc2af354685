"""Kubernetes: pod and container identification (the manifests: tests/k8s/test_manifests.py).

No cluster runs here (docs/kubernetes.md says what has and has not been run). The
cgroup-path parser is checked on the documented path formats of each runtime and driver, and on
the real cgroup of a container started by podman where podman can run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import DaemonProc, wait_for
from gpushare import config
from gpushare.control import pods
from gpushare.control.adoption import FACT_ENV, Rule, decide
from gpushare.model import ClientClass, PauseMechanism
from gpushare.node.cgroups.discovery import cgroup2_mount
from gpushare.node.cgroups.route import freeze_route
from gpushare.node.procs.facts import process_facts
from gpushare.node.procs.identity import descendants
from tests.fakes.fake_gpu import fake_uuid

CID = "3f1b5a0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f4a3b2c1d0e9f8a7b6c5d4e3f2a"
UID = "7a5c3b2e-1f4d-4c8a-9b6e-2d3f4a5b6c7d"
UID_ = UID.replace("-", "_")


# ------------------------------------------------------------------------- pod identification
# Path formats: the kubelet's cgroup naming (pkg/kubelet/cm: cgroupfs "pod<uid>", systemd
# "kubepods-<qos>-pod<uid_>.slice"), containerd ("cri-containerd-<id>.scope"), CRI-O
# ("crio-<id>[.scope]", monitor "crio-conmon-<id>"), docker ("docker-<id>.scope", "/docker/<id>"),
# podman ("libpod-<id>[.scope]"), as seen on nodes and in /proc/<pid>/cgroup of real containers.
# Under a cgroup root the kubelet's CgroupName.ToSystemd (pkg/kubelet/cm/cgroup_manager_linux.go)
# joins the root's components into every slice name; kind's KubeletConfiguration sets
# cgroupDriver: systemd and cgroupRoot: /kubelet (kubernetes-sigs/kind,
# pkg/cluster/internal/kubeadm/config.go), hence kind's "kubelet-kubepods-..." slices.


@pytest.mark.parametrize(
    ("path", "want"),
    [
        (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
         (CID, "containerd", UID, "burstable", "systemd")),
        (f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope",
         (CID, "containerd", UID, "guaranteed", "systemd")),
        (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope",
         (CID, "cri-o", UID, "besteffort", "systemd")),
        (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope",
         (CID, "docker", UID, "burstable", "systemd")),
        (f"/kubepods/besteffort/pod{UID}/{CID}", (CID, "", UID, "besteffort", "cgroupfs")),
        (f"/kubepods/pod{UID}/{CID}", (CID, "", UID, "guaranteed", "cgroupfs")),
        (f"/kubepods/burstable/pod{UID}/crio-{CID}", (CID, "cri-o", UID, "burstable", "cgroupfs")),
        # a kind node (cgroupDriver systemd, cgroupRoot /kubelet): the cgroup root's name is in
        # every slice's name; seen from the host, under the node container's own scope
        (f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/"
         f"kubelet-kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
         (CID, "containerd", UID, "burstable", "systemd")),
        (f"/system.slice/docker-{'e' * 64}.scope/kubelet.slice/kubelet-kubepods.slice/"
         f"kubelet-kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope",
         (CID, "containerd", UID, "guaranteed", "systemd")),
        # --cgroup-root=/k8s-nodes/gpu (cgroupfs: plain directories; systemd: "-" escaped to "_")
        (f"/k8s-nodes/gpu/kubepods/besteffort/pod{UID}/{CID}", (CID, "", UID, "besteffort", "cgroupfs")),
        (f"/k8s_nodes.slice/k8s_nodes-gpu.slice/k8s_nodes-gpu-kubepods.slice/"
         f"k8s_nodes-gpu-kubepods-besteffort.slice/k8s_nodes-gpu-kubepods-besteffort-pod{UID_}.slice/"
         f"crio-{CID}.scope", (CID, "cri-o", UID, "besteffort", "systemd")),
        (f"/system.slice/containerd.service/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope",
         (CID, "containerd", UID, "burstable", "systemd")),
        # the pod's own cgroup (no container yet) and a container's sub-cgroup (systemd inside)
        (f"/kubepods.slice/kubepods-pod{UID_}.slice", (None, "", UID, "guaranteed", "systemd")),
        (f"/kubepods/pod{UID}/{CID}/init.scope", (CID, "", UID, "guaranteed", "systemd")),
        (f"/system.slice/docker-{CID}.scope", (CID, "docker", None, None, "systemd")),
        (f"/docker/{CID}", (CID, "docker", None, None, "cgroupfs")),
        (f"/machine.slice/libpod-{CID}.scope", (CID, "podman", None, None, "systemd")),
        (f"/libpod_parent/libpod-{CID}", (CID, "podman", None, None, "cgroupfs")),
        # a runtime's monitor is not the container
        (f"/machine.slice/libpod-conmon-{CID}.scope", None),
        (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-conmon-{CID}.scope",
         (None, "", UID, "burstable", "systemd")),
        ("/system.slice/triton.service", None),
        ("/user.slice/user-1000.slice/session-3.scope", None),
        ("/", None),
    ],
)  # fmt: skip
def test_container_and_pod_from_a_cgroup_path(path, want):
    got = pods.container_of_cgroup(path)
    if want is None:
        assert got is None
        return
    assert (got.container_id, got.runtime, got.pod_uid, got.qos, got.driver) == want


def test_hybrid_host_v1_lines_name_the_container_when_v2_is_the_root():
    text = "\n".join(
        [f"{n}:{c}:/kubepods/burstable/pod{UID}/{CID}" for n, c in ((12, "memory"), (4, "cpu,cpuacct"))]
        + ["1:name=systemd:/kubepods/burstable", "0::/"]
    )  # fmt: skip
    got = pods.container_of_proc_cgroup(text)
    assert got is not None and (got.container_id, got.pod_uid) == (CID, UID)
    assert pods.container_of_proc_cgroup("0::/system.slice/sshd.service\n") is None


# --------------------------------------------------------------- a real container, from podman

PODMAN_SKIP = next(
    (
        f"{tool} is not installed (scripts/get-test-packages.sh installs podman, runc, busybox-static)"
        for tool in ("podman", "runc", "busybox")
        if shutil.which(tool) is None
    ),
    None if os.geteuid() == 0 else "podman with cgroups needs root here",
)


@pytest.fixture(scope="module")
def podman() -> Iterator[list[str]]:
    """podman with private storage, runc and cgroupfs; a one-file busybox image imported locally."""
    if PODMAN_SKIP is not None:
        pytest.skip(PODMAN_SKIP)
    mount = cgroup2_mount()
    if mount is None:
        pytest.skip("no cgroup v2 mount: the container's v2 cgroup cannot be checked")
    parents = _libpod_parents()
    existed = {p for p in parents if p.exists()}
    work = Path(tempfile.mkdtemp(prefix="gs-podman-"))
    # crun refuses hybrid hosts whose v2 hierarchy has controllers; runc does not. No network:
    # the image is built here from the busybox binary, nothing is pulled.
    argv = ["podman", "--root", str(work / "storage"), "--runroot", str(work / "run"),
            "--storage-driver", "vfs", "--runtime", "runc", "--cgroup-manager", "cgroupfs",
            "--events-backend", "none"]  # fmt: skip
    rootfs = work / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy(shutil.which("busybox") or "", rootfs / "bin" / "busybox")
    (rootfs / "bin" / "sleep").symlink_to("busybox")
    tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True, check=True)
    imported = subprocess.run([*argv, "import", "-", "localhost/gs-busybox:test"], input=tar.stdout,
                              capture_output=True, check=False)  # fmt: skip
    try:
        if imported.returncode != 0:
            pytest.skip(f"podman cannot import an image here: {imported.stderr.decode()[-300:]}")
        yield argv
    finally:
        subprocess.run([*argv, "rm", "-a", "-f", "-t", "0"], capture_output=True, check=False)
        subprocess.run([*argv, "rmi", "-a", "-f"], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)
        for p in parents:
            if p not in existed:
                with contextlib.suppress(OSError):
                    p.rmdir()


def _libpod_parents() -> list[Path]:
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] in ("cgroup", "cgroup2"):
            found.append(Path(fields[1]) / "libpod_parent")
    return found


def test_a_podman_container_is_named_from_its_real_cgroup_and_frozen_through_it(podman):
    run = subprocess.run(
        [*podman, "run", "-d", "--network", "none", "--ulimit", "nofile=1024:1024",
         "--ulimit", "nproc=1024:1024", "-e", "GPUSHARE_CLASS=offline",
         "localhost/gs-busybox:test", "/bin/sleep", "300"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {run.stderr.strip()[-400:]}")
    cid = run.stdout.strip()
    try:
        pid = int(subprocess.run([*podman, "inspect", "-f", "{{.State.Pid}}", cid],
                                 capture_output=True, text=True, check=True).stdout)  # fmt: skip
        text = Path(f"/proc/{pid}/cgroup").read_text()
        got = pods.container_of_proc_cgroup(text)
        assert got is not None
        assert (got.container_id, got.runtime, got.pod_uid) == (cid, "podman", None)
        # The same process, seen by adoption: its marker, and a cgroup of its own to freeze.
        # No GPU here: NVML's process list is stood in for, naming the container's process.
        facts = process_facts(pid, FACT_ENV, gpu_pids={pid: ("GPU-0",)})
        assert facts is not None and facts.environ == {"GPUSHARE_CLASS": "offline"}
        assert decide([Rule(config.MARKER_RULE, 0, "default")], facts).cls is ClientClass.OFFLINE
        route = freeze_route(pid, [*descendants(pid), pid])
        assert route.mechanism is PauseMechanism.CGROUP, route.reason
        assert route.cgroup is not None and route.cgroup.name == f"libpod-{cid}"
    finally:
        subprocess.run([*podman, "rm", "-f", "-t", "0", cid], capture_output=True, check=False)


def test_a_daemon_adopts_a_podman_container_names_it_and_freezes_it_through_its_cgroup(podman):
    token = uuid.uuid4().hex  # the scan sees the whole host: match only this test's container
    d = DaemonProc(
        f'[[adopt]]\nname = "pods"\nmarker = true\nenv = {{ GSTEST_POD = "{token}" }}\n',
        daemon_toml='adopt_scan_period = "100ms"\nadopt_min_age = "200ms"',
    )
    run = subprocess.run(
        [*podman, "run", "-d", "--network", "none", "--ulimit", "nofile=1024:1024",
         "--ulimit", "nproc=1024:1024", "-e", "GPUSHARE_CLASS=offline", "-e", f"GSTEST_POD={token}",
         "-e", f"GPUSHARE_GPU_UUID={fake_uuid(0)}", "localhost/gs-busybox:test", "/bin/sleep", "300"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"podman cannot run a container here: {run.stderr.strip()[-400:]}")
    cid = run.stdout.strip()
    try:
        d.start()
        pid = int(subprocess.run([*podman, "inspect", "-f", "{{.State.Pid}}", cid],
                                 capture_output=True, text=True, check=True).stdout)  # fmt: skip

        def adopted() -> dict[str, Any] | None:
            return next((c for c in d.call("status")["clients"] if c["pid"] == pid), None)

        c = wait_for(adopted, 15, "the container's process adopted")
        assert c["container"] == {"id": cid, "runtime": "podman", "pod_uid": None, "qos": None}
        assert (c["class"], c["pause_mechanism"]) == ("offline", "cgroup"), c["pause_reason"]
        assert c["pause_reason"].endswith(f"/libpod-{cid}")
        events = Path(c["pause_reason"].split(": ", 1)[1]) / "cgroup.events"
        d.call("pause", {"client_id": c["id"]})
        assert "frozen 1" in events.read_text().splitlines()  # the container's own cgroup
        d.call("resume", {"client_id": c["id"]})
        assert "frozen 0" in events.read_text().splitlines()
    finally:
        d.cleanup()
        subprocess.run([*podman, "rm", "-f", "-t", "0", cid], capture_output=True, check=False)
