"""The vendored stubs are what gpushare/k8s/proto/regenerate.sh makes from api.proto today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.support.daemon_helpers import REPO
from gpushare.k8s.proto import api_pb2

PROTO = REPO / "gpushare" / "k8s" / "proto"


def test_generated_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    subprocess.run(
        ["sh", str(PROTO / "regenerate.sh"), sys.executable, str(tmp_path)], check=True,
        timeout=60,
    )  # fmt: skip
    made = tmp_path / "gpushare" / "k8s" / "proto"
    for name in ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"):
        assert (PROTO / name).read_text() == (made / name).read_text(), name


def test_wire_names_are_the_kubelets() -> None:
    # The kubelet calls /v1beta1.DevicePlugin/<Method> and /v1beta1.Registration/Register.
    services = api_pb2.DESCRIPTOR.services_by_name
    assert services["Registration"].full_name == "v1beta1.Registration"
    assert [m.name for m in services["DevicePlugin"].methods] == [
        "GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate",
        "PreStartContainer",
    ]  # fmt: skip
    fields = {f.name: f.number for f in api_pb2.ContainerAllocateResponse.DESCRIPTOR.fields}
    assert fields == {"envs": 1, "mounts": 2, "devices": 3, "annotations": 4, "cdi_devices": 5}
