"""Pod scope: the containers of one pod are one client, frozen through the pod's cgroup.

The rule (docs/security.md): a process asks for it with ``GPUSHARE_CLIENT_SCOPE=pod`` (the device
plugin sets it); it applies only to the pod cgroup that directly holds the process's container
cgroup, and only when root owns that pod cgroup.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from gpushare.config import AdoptRule
from gpushare.control.adoption import Rule, scan
from gpushare.control.pods import pod_cgroup
from gpushare.model import PauseMechanism, ProcessFacts
from gpushare.node.cgroups.route import freeze_route

UID_ = "7a5c3b2e_1f4d_4c8a_9b6e_2d3f4a5b6c7f"
POD = f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
C1, C2 = (f"{POD}/cri-containerd-{n:064x}.scope" for n in (1, 2))
# A kind node's pod (kind: cgroupDriver systemd, cgroupRoot /kubelet; the kubelet joins the root's
# name into every slice's, CgroupName.ToSystemd), as the kind node's own /proc/<pid>/cgroup shows it.
KIND_POD = (
    "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
    f"kubelet-kubepods-besteffort-pod{UID_}.slice"
)
K1, K2 = (f"{KIND_POD}/cri-containerd-{n:064x}.scope" for n in (1, 2))


@pytest.mark.parametrize(
    ("path", "pod"),
    [
        (C1, POD),
        (K1, KIND_POD),
        # seen from the host: under the kind node container's scope
        (f"/system.slice/docker-{'e' * 64}.scope{K2}", f"/system.slice/docker-{'e' * 64}.scope{KIND_POD}"),
        (f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_}.slice/crio-{3:064x}.scope",
         f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_}.slice"),
        (KIND_POD, None),
        # not the kubelet's names: "kubepods" must be a whole component, the UID a whole UID
        (f"/kubelet.slice/kubeletkubepods-pod{UID_}.slice/cri-containerd-{1:064x}.scope", None),
        (f"/kubelet.slice/kubelet-kubepods-pod{UID_}x.slice/cri-containerd-{1:064x}.scope", None),
        (f"/kubepods/burstable/pod{UID_.replace('_', '-')}/{1:064x}",
         f"/kubepods/burstable/pod{UID_.replace('_', '-')}"),
        (POD, None),  # the pod itself is no container
        (f"{C1}/nested", None),  # not directly in the pod
        ("/system.slice/docker-" + "a" * 64 + ".scope", None),  # a container, no pod
        ("/user.slice/user-1000.slice/session-3.scope", None),
    ],
)  # fmt: skip
def test_pod_cgroup_of_a_container(path: str, pod: str | None) -> None:
    assert pod_cgroup(path) == pod


def _facts(pid: int, ppid: int, cgroup: str, scope: str | None) -> ProcessFacts:
    env = {"GPUSHARE_CLASS": "offline"}
    if scope is not None:
        env["GPUSHARE_CLIENT_SCOPE"] = scope
    return ProcessFacts(pid, ppid, 0, "root", "python", 0.0, cgroup, None, env, None)


RULES = [Rule(AdoptRule(name="m", marker=True, cls="marker"), 0, "cfg")]


def test_scan_folds_a_pods_containers_into_the_first() -> None:
    out = scan(
        RULES, [_facts(10, 1, C1, "pod"), _facts(20, 1, C2, "pod"), _facts(21, 20, C2, "pod")]
    )
    assert [d.pid for d in out.decisions] == [10]
    assert dict(out.members) == {10: 10, 20: 10, 21: 10}


@pytest.mark.parametrize("scope", [None, "container", "POD"])
def test_without_pod_scope_each_container_is_its_own_client(scope: str | None) -> None:
    out = scan(RULES, [_facts(10, 1, C1, scope), _facts(20, 1, C2, scope)])
    assert [d.pid for d in out.decisions] == [10, 20]


def test_scan_folds_a_kind_pods_containers_into_the_first() -> None:
    out = scan(RULES, [_facts(10, 1, K1, "pod"), _facts(20, 1, K2, "pod")])
    assert [d.pid for d in out.decisions] == [10]
    assert dict(out.members) == {10: 10, 20: 10}


def test_pod_scope_outside_a_pod_changes_nothing() -> None:
    a, b = "/system.slice/a.service", "/system.slice/b.service"
    out = scan(RULES, [_facts(10, 1, a, "pod"), _facts(20, 1, b, "pod")])
    assert [d.pid for d in out.decisions] == [10, 20]


@pytest.fixture(params=["kubelet", "kind"])
def pod_tree(request: pytest.FixtureRequest) -> Iterator[tuple[Path, Path]]:
    """A pod cgroup holding a container cgroup, named as the kubelet names them, or on kind."""
    if (why := cgroup_skip_reason()) is not None:
        pytest.skip(why)
    base = unique_base("gs-podscope")
    if request.param == "kind":
        pod = base.joinpath(*KIND_POD.strip("/").split("/"))
    else:
        pod = base / f"kubepods-besteffort-pod{UID_}.slice"
    ctr = pod / f"cri-containerd-{1:064x}.scope"
    ctr.mkdir(parents=True)
    try:
        yield pod, ctr
    finally:
        remove_tree(base)


def _sleep_in(cgroup: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    fd = os.open(cgroup / "cgroup.procs", os.O_WRONLY)
    try:
        proc = subprocess.Popen(["sleep", "30"], env={"PATH": os.environ["PATH"], **env},
                                preexec_fn=lambda: os.write(fd, b"0"))  # fmt: skip
    finally:
        os.close(fd)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc.pid}/cmdline").read_bytes() != b"sleep\x0030\x00":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return proc


@pytest.mark.parametrize(
    ("env", "pod_owner", "route"),
    [
        ({"GPUSHARE_CLIENT_SCOPE": "pod"}, 0, "pod"),
        ({}, 0, "own"),  # not asked for
        ({"GPUSHARE_CLIENT_SCOPE": "pod"}, 12345, "own"),  # a user's (delegated) "pod": refused
    ],
)
def test_freeze_route_takes_the_pod_only_when_asked_and_root_owns_it(
    pod_tree, env, pod_owner, route
):
    pod, ctr = pod_tree
    os.chown(pod, pod_owner, -1)
    proc = _sleep_in(ctr, env)
    try:
        r = freeze_route(proc.pid, [proc.pid])
    finally:
        proc.kill()
        proc.wait(5)
    assert r.mechanism is PauseMechanism.CGROUP
    assert r.cgroup == (pod if route == "pod" else ctr), r.reason
