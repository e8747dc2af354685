"""Which Kubernetes pod and container a process belongs to, read from its cgroup path (pure).

The kubelet names a pod's cgroup after its UID and the container runtime names the container's
after its id, in one of two layouts (the kubelet's ``--cgroup-driver``):

==========  =========================================================================================
cgroupfs    ``/kubepods[/burstable|/besteffort]/pod<uid>/<id>`` (containerd, docker),
            ``.../pod<uid>/crio-<id>`` (CRI-O)
systemd     ``/kubepods.slice[/kubepods-<qos>.slice]/kubepods[-<qos>]-pod<uid_>.slice/<runtime>-<id>.scope``
            with ``cri-containerd-``, ``crio-`` or ``docker-``; the UID's dashes become underscores
==========  =========================================================================================

Under a ``--cgroup-root`` (``cgroupRoot``) the kubelet puts its components in front of
``kubepods``: with cgroupfs as directories (``/kubelet/kubepods/...``), with systemd in every slice's
name, because the kubelet joins the components with ``-`` (each one's own dashes escaped to ``_``)
and systemd expands ``a-b-c.slice`` to ``/a.slice/a-b.slice/a-b-c.slice`` (the kubelet's
``CgroupName.ToSystemd`` in ``pkg/kubelet/cm/cgroup_manager_linux.go``). kind sets
``cgroupDriver: systemd`` and ``cgroupRoot: /kubelet`` (kubernetes-sigs/kind,
``pkg/cluster/internal/kubeadm/config.go``), so a kind node's pods are
``/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod<uid_>.slice/cri-containerd-<id>.scope``.

Outside Kubernetes the same functions name a container: ``/docker/<id>``,
``/system.slice/docker-<id>.scope``, and podman's ``libpod-<id>[.scope]``. A runtime's monitor
processes (``crio-conmon-<id>``, ``libpod-conmon-<id>``) are not the container. The path may have
any prefix (a kind node's ``/kubelet.slice/...``, a nested runtime); on a hybrid host the v1 lines of
``/proc/<pid>/cgroup`` hold the path when the v2 line is ``/`` (:func:`container_of_proc_cgroup`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HEX_ID = r"([0-9a-f]{64})"
_UID_BODY = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_UID = rf"({_UID_BODY})"
_POD_CGROUPFS = re.compile(rf"^pod{_UID}$")
# The cgroup root's components come first, each ending in "-" and free of "-" and "/" (the
# kubelet escapes their dashes to "_"): "kubelet-kubepods-besteffort-pod<uid>.slice" on kind.
_POD_SYSTEMD = re.compile(
    rf"^(?:[^-/]+-)*kubepods(?:-(?P<qos>besteffort|burstable))?-pod(?P<uid>{_UID_BODY})\.slice$"
)
_CONTAINER = (
    (re.compile(rf"^cri-containerd-{_HEX_ID}\.scope$"), "containerd"),
    (re.compile(rf"^crio-{_HEX_ID}(?:\.scope)?$"), "cri-o"),
    (re.compile(rf"^docker-{_HEX_ID}\.scope$"), "docker"),
    (re.compile(rf"^libpod-{_HEX_ID}(?:\.scope)?$"), "podman"),
    (re.compile(rf"^{_HEX_ID}$"), ""),
)
_QOS = {"besteffort": "besteffort", "burstable": "burstable"}


@dataclass(frozen=True, slots=True)
class Container:
    """A process's container and, under Kubernetes, its pod."""

    container_id: str | None
    """The runtime's 64-hex id; ``None`` for a process in the pod's cgroup but no container's."""
    runtime: str
    """``containerd``, ``cri-o``, ``docker``, ``podman``; empty where the layout does not say
    (a bare id under ``/kubepods``: containerd or docker with the cgroupfs driver)."""
    pod_uid: str | None
    """The pod's UID as the API server writes it (dashes); ``None`` outside Kubernetes."""
    qos: str | None
    """``guaranteed``, ``burstable`` or ``besteffort`` under Kubernetes."""
    driver: str
    """``systemd`` (``.slice``/``.scope`` names) or ``cgroupfs``."""


def container_of_cgroup(path: str) -> Container | None:
    """The container (and pod) a cgroup path names, or ``None`` when it names neither."""
    parts = [p for p in path.split("/") if p]
    pod_uid = qos = None
    pod_at = -1
    for i, part in enumerate(parts):
        if m := _POD_CGROUPFS.match(part):
            pod_uid, pod_at = m.group(1).replace("_", "-"), i
            qos = _QOS.get(parts[i - 1], "guaranteed") if i > 0 else None
        elif m := _POD_SYSTEMD.match(part):
            pod_uid, pod_at = m.group("uid").replace("_", "-"), i
            qos = m.group("qos") or "guaranteed"
    cid = runtime = None
    for part in reversed(parts[pod_at + 1 :]):
        for pattern, name in _CONTAINER:
            if m := pattern.match(part):
                cid, runtime = m.group(1), name
                break
        if cid is not None:
            break
    if cid is None and pod_uid is None:
        return None
    if runtime == "" and pod_uid is None and "docker" in parts:
        runtime = "docker"  # docker's cgroupfs layout: /docker/<id>
    systemd = any(p.endswith((".slice", ".scope")) for p in parts)
    return Container(cid, runtime or "", pod_uid, qos, "systemd" if systemd else "cgroupfs")


def container_of_proc_cgroup(text: str) -> Container | None:
    """The container of a process from its ``/proc/<pid>/cgroup`` text, v2 line first.

    On a hybrid host the v2 line may be ``/`` while the v1 controllers' lines carry the
    container's path; the first line that names a container wins.
    """
    lines = [line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2]
    ordered = [p for h, _c, p in lines if h == "0"] + [p for h, _c, p in lines if h != "0"]
    for path in ordered:
        found = container_of_cgroup(path)
        if found is not None:
            return found
    return None


ENV_CLIENT_SCOPE = "GPUSHARE_CLIENT_SCOPE"
"""``pod``: every container of the process's pod is one client (the device plugin sets it)."""
POD_SCOPE = "pod"


def pod_cgroup(path: str) -> str | None:
    """The pod's cgroup path when ``path`` is a container's cgroup directly in a pod's, else None.

    ``/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid>.slice/cri-containerd-<id>.scope``
    gives ``/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid>.slice``.
    """
    head, _sep, leaf = path.rstrip("/").rpartition("/")
    found, parent = container_of_cgroup(path), container_of_cgroup(head)
    if found is None or found.container_id is None or found.pod_uid is None or not leaf:
        return None
    if parent is None or parent.container_id is not None or parent.pod_uid != found.pod_uid:
        return None
    pod_part = head.rpartition("/")[2]
    return head if _POD_CGROUPFS.match(pod_part) or _POD_SYSTEMD.match(pod_part) else None
