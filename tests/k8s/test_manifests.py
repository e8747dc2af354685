"""deploy/kubernetes/: the Kustomize bases render, and every rendered manifest validates.

Rendering: the bases use only ``resources`` (checked), so the test renders them itself; where
``kubectl`` is installed, ``kubectl kustomize`` (Kustomize itself) must render the same objects.
Validation: kubernetes-validate (the API's OpenAPI schemas, strict: unknown fields are errors)
against the three newest Kubernetes minors it knows. The ServiceMonitor is the Prometheus
operator's CRD, which kubernetes-validate has no schema for: it is checked field by field against
the Service it selects instead.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml
from typer.testing import CliRunner

from gpushare import config
from gpushare.cli.app import app
from gpushare.k8s.devices import DaemonPaths, MountSpec, check_mounts
from gpushare.paths import repo_root

K8S = repo_root() / "deploy" / "kubernetes"
BASES = {"base": K8S, "examples": K8S / "examples", "monitoring": K8S / "monitoring"}


def _minors() -> list[str]:
    """The three newest minors kubernetes-validate has schemas for (e.g. 1.35, 1.36, 1.37)."""
    found = {
        tuple(int(x) for x in v.split(".")[:2]) for v in kubernetes_validate.utils.all_versions()
    }
    return [f"{a}.{b}" for a, b in sorted(found)[-3:]]


MINORS = _minors()


def render(base: Path) -> list[dict[str, Any]]:
    kust = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert set(kust) == {
        "apiVersion",
        "kind",
        "resources",
    }, "the renderer here knows resources only"
    docs: list[dict[str, Any]] = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((base / name).read_text()) if d]
    return docs


def _key(d: dict[str, Any]) -> tuple[str, str]:
    return d["kind"], d["metadata"]["name"]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def test_the_bases_list_every_manifest_once() -> None:
    listed = {
        b / n
        for b in BASES.values()
        for n in yaml.safe_load((b / "kustomization.yaml").read_text())["resources"]
    }
    on_disk = {
        p for b in BASES.values() for p in b.glob("*.yaml") if p.name != "kustomization.yaml"
    }
    assert listed == on_disk


@pytest.mark.parametrize("name", sorted(BASES))
def test_kustomize_renders_the_same_objects(name: str) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl (its built-in kustomize) is not installed here")
    out = subprocess.run(["kubectl", "kustomize", str(BASES[name])], capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    theirs = sorted((d for d in yaml.safe_load_all(out) if d), key=_key)
    assert theirs == sorted(render(BASES[name]), key=_key)


@pytest.mark.parametrize("version", MINORS)
@pytest.mark.parametrize("name", ["base", "examples"])
def test_every_rendered_manifest_validates(name: str, version: str) -> None:
    docs = render(BASES[name])
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_misspelt_and_mistyped_fields_are_caught() -> None:
    ds = _one(render(K8S), "DaemonSet")
    typo = copy.deepcopy(ds)
    typo["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="'hostPid' was unexpected"):
        kubernetes_validate.validate(typo, MINORS[-1], strict=True)
    wrong = copy.deepcopy(ds)
    wrong["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSeconds"] = "ten"
    with pytest.raises(kubernetes_validate.ValidationError) as err:
        kubernetes_validate.validate(wrong, MINORS[-1], strict=True)
    assert list(err.value.path)[-2:] == ["readinessProbe", "periodSeconds"]


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def test_example_workloads_ask_for_a_resource_and_nothing_else() -> None:
    docs = render(BASES["examples"])
    assert {d["kind"] for d in docs} == {"Deployment", "Job"}
    asked = set()
    for d in docs:
        spec = _pod_spec(d)
        assert not any("hostPath" in v for v in spec.get("volumes", [])), d["metadata"]["name"]
        for key in ("hostPID", "hostIPC", "hostNetwork"):
            assert not spec.get(key)
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            names = [e["name"] for e in c.get("env", [])]
            assert not [n for n in names if n.startswith(("CUDA_", "GPUSHARE_", "NVIDIA_"))]
            assert "volumeMounts" not in c
            assert not c["securityContext"].get("privileged")
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            limits = c["resources"]["limits"]
            assert set(limits) <= {"gpushare.io/online", "gpushare.io/offline"}
            asked |= set(limits)
    assert asked == {"gpushare.io/online", "gpushare.io/offline"}


def test_the_daemonset_runs_the_daemon_and_the_plugin_and_no_pod_gets_the_api_socket() -> None:
    docs = render(K8S)
    spec = _pod_spec(_one(docs, "DaemonSet"))
    assert spec["hostPID"] is True
    assert spec["serviceAccountName"] == _one(docs, "ServiceAccount")["metadata"]["name"]
    assert spec["automountServiceAccountToken"] is False
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert host == {"run": "/run/gpushare", "state": "/var/lib/gpushare",
                    "cgroup": "/sys/fs/cgroup", "shm": "/dev/shm",
                    "device-plugins": "/var/lib/kubelet/device-plugins"}  # fmt: skip
    daemon, plugin = spec["containers"]
    assert daemon["command"][:2] == ["nsenter", "--cgroup=/proc/1/ns/cgroup"]
    assert daemon["readinessProbe"]["exec"]["command"] == ["gpushare", "status", "--json"]
    assert plugin["command"][:3] == ["gpushare", "k8s", "device-plugin"]
    assert plugin["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert not plugin["securityContext"].get("privileged")
    mounts = {m["name"]: m["mountPath"] for m in plugin["volumeMounts"]}
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins"
    # The plugin's arguments are ones the real command takes: it fails only on the missing dir.
    args = [*plugin["command"][1:], "--kubelet-dir", "/nonexistent-kubelet-dir"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert "/nonexistent-kubelet-dir is not a directory" in res.output
    # The config: the API socket is root's only, and what pods are given does not hold it.
    cm = _one(docs, "ConfigMap")
    cfg = config.loads(cm["data"]["gpushare.toml"], "configmap.yaml")
    assert cfg.daemon.socket_mode == "0600"
    sock = str(cfg.paths.resolved("socket"))
    paths = DaemonPaths(str(cfg.paths.resolved("mps_pipe_dir")),
                        str(cfg.paths.resolved("latency_socket")), sock)  # fmt: skip
    assert sock.startswith("/run/gpushare/")
    check_mounts(
        [MountSpec(f"{paths.mps_pipe_dir}/GPU-x", "", False), MountSpec(paths.latency_socket, "", False)],
        sock,
    )  # fmt: skip


def test_the_service_monitor_selects_the_metrics_service() -> None:
    svc = _one(render(K8S), "Service")
    ds = _one(render(K8S), "DaemonSet")
    (sm,) = render(BASES["monitoring"])
    assert (sm["apiVersion"], sm["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"]
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [svc["metadata"]["namespace"]]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ports = {p["name"] for p in svc["spec"]["ports"]}
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    assert "metrics" in ports
    assert svc["spec"]["clusterIP"] == "None"  # every pod, not one behind a virtual IP
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {
        p["name"]: p["containerPort"] for p in _pod_spec(ds)["containers"][0]["ports"]
    }
    assert container_ports["metrics"] == 9402
