"""What the device plugin advertises and gives a container (gpushare.k8s.devices, pure)."""

from __future__ import annotations

import pytest

from gpushare.k8s import devices
from gpushare.k8s.devices import AllocationError, DaemonPaths, Gpu, PluginSettings
from gpushare.model import ClientClass

A = "GPU-00000000-1111-2222-3333-444444444440"
B = "GPU-00000000-1111-2222-3333-444444444441"
GPUS = [Gpu(0, A, True), Gpu(1, B, True)]
PATHS = DaemonPaths(
    "/run/gpushare/mps", "/run/gpushare/latency.sock", "/run/gpushare/gpushare.sock"
)


def _env(cls: ClientClass, uuid: str, sm: float, paths: DaemonPaths) -> dict[str, str]:
    return {"GPUSHARE_CLASS": cls.value, "SM": f"{sm:g}", "GPU": uuid}


SETTINGS = PluginSettings()


def _alloc(cls, ids, gpus=GPUS, paths=PATHS, settings=SETTINGS):
    return devices.allocation(cls, ids, gpus, _env, paths, settings)


def test_device_ids_are_replicas_per_gpu_within_the_kubelets_limit() -> None:
    ids = devices.device_ids(GPUS, 3)
    assert [i for i, _ok in ids] == [
        f"{A}::0",
        f"{A}::1",
        f"{A}::2",
        f"{B}::0",
        f"{B}::1",
        f"{B}::2",
    ]
    assert all(len(i) <= devices.MAX_ID_LEN for i, _ok in devices.device_ids(GPUS, 1000))


@pytest.mark.parametrize(("count", "replicas", "sm"), [(1, 10, 10.0), (3, 10, 30.0), (10, 10, 100.0),
                                                       (1, 3, 33.33), (1, 100, 1.0)])  # fmt: skip
def test_offline_share_is_what_the_request_asked(count: int, replicas: int, sm: float) -> None:
    settings = PluginSettings(offline_replicas=replicas)
    a = _alloc(ClientClass.OFFLINE, [f"{A}::{n}" for n in range(count)], settings=settings)
    assert a.sm_pct == sm
    assert a.envs["SM"] == f"{sm:g}"


def test_online_runs_uncapped_whatever_it_holds() -> None:
    assert _alloc(ClientClass.ONLINE, [f"{A}::0", f"{A}::1"]).sm_pct == 100.0


def test_mounts_are_the_gpus_pipe_dir_the_latency_socket_and_shm_never_the_api_socket() -> None:
    a = _alloc(ClientClass.OFFLINE, [f"{B}::4"])
    assert [m.host_path for m in a.mounts] == [
        f"/run/gpushare/mps/{B}",
        "/run/gpushare/latency.sock",
        "/dev/shm",
    ]
    assert a.cdi_devices == (f"nvidia.com/gpu={B}",)
    assert a.device_nodes == ()


@pytest.mark.parametrize(
    ("pipe_root", "api_socket"),
    [("/run", f"/run/{A}/api.sock"), ("/", f"/{A}/api.sock"), ("/run/x/..", f"/run/{A}/s"),
     ("/run", f"//run/./{A}/sub/api.sock")],
)  # fmt: skip
def test_a_pipe_dir_above_the_api_socket_is_refused(pipe_root: str, api_socket: str) -> None:
    # The GPU's pipe directory is mounted; if it is the socket's directory or above, refused.
    paths = DaemonPaths(pipe_root, "/run/gpushare/latency.sock", api_socket)
    with pytest.raises(AllocationError, match="holds the API socket"):
        _alloc(ClientClass.ONLINE, [f"{A}::0"], paths=paths)


def test_the_api_socket_as_the_latency_socket_is_refused() -> None:
    paths = DaemonPaths("/run/gpushare/mps", PATHS.api_socket, PATHS.api_socket)
    with pytest.raises(AllocationError, match="holds the API socket"):
        _alloc(ClientClass.OFFLINE, [f"{A}::0"], paths=paths)


@pytest.mark.parametrize(
    ("ids", "gpus", "paths", "why"),
    [
        ([f"{A}::0", f"{B}::0"], GPUS, PATHS, "devices of 2 GPUs"),
        (["nvidia0"], GPUS, PATHS, "not one of gpushare's"),
        ([f"{A}::x"], GPUS, PATHS, "not one of gpushare's"),
        ([], GPUS, PATHS, "no device"),
        ([f"{A}::0"], [Gpu(0, A, False)], PATHS, "unhealthy"),
        ([f"{A}::0"], [Gpu(1, B, True)], PATHS, "not shared"),
        ([f"{A}::0"], GPUS, None, "has not answered"),
    ],
)
def test_refusals_say_why(ids, gpus, paths, why) -> None:
    with pytest.raises(AllocationError, match=why):
        _alloc(ClientClass.OFFLINE, ids, gpus=gpus, paths=paths)


def test_device_nodes_when_asked() -> None:
    a = _alloc(
        ClientClass.ONLINE, [f"{B}::0"], settings=PluginSettings(device_nodes=True, cdi_kind=None)
    )
    assert [d.path for d in a.device_nodes] == ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    assert a.cdi_devices == ()


def test_preferred_bin_packs_one_gpu() -> None:
    avail = [f"{A}::0", f"{B}::0", f"{B}::1", f"{B}::2", f"{A}::1"]
    # A has 2 free, B 3: 2 fit best on A (B stays whole for a larger request), 3 only on B.
    assert devices.preferred(avail, [], 2) == [f"{A}::0", f"{A}::1"]
    assert devices.preferred(avail, [], 3) == [f"{B}::0", f"{B}::1", f"{B}::2"]
    assert devices.preferred(avail, [f"{B}::2"], 2) == [f"{B}::2", f"{B}::0"]
    # No single GPU has 4: any 4, and Allocate says why it refuses them.
    assert len(devices.preferred(avail, [], 4)) == 4


@pytest.mark.parametrize(
    ("count", "top", "sm", "asked"),
    [(3, 60.0, 30.0, None), (6, 60.0, 60.0, None), (10, 60.0, 60.0, 100.0), (10, 0.5, 1.0, 100.0)],
)
def test_the_gpus_policy_caps_an_offline_share(count, top, sm, asked) -> None:
    # A pod author chooses how many units to ask for; the node's policy caps what they are worth.
    gpus = [Gpu(0, A, True, offline_sm_pct_max=top)]
    a = _alloc(ClientClass.OFFLINE, [f"{A}::{n}" for n in range(count)], gpus=gpus)
    assert (a.sm_pct, a.asked_sm_pct) == (sm, asked)
    assert a.envs["SM"] == f"{sm:g}"


def test_online_is_not_capped_by_the_offline_policy() -> None:
    gpus = [Gpu(0, A, True, offline_sm_pct_max=40.0)]
    a = _alloc(ClientClass.ONLINE, [f"{A}::0"], gpus=gpus)
    assert (a.sm_pct, a.asked_sm_pct) == (100.0, None)
