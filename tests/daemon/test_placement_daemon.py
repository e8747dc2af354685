"""Placement by the real daemon: ``submit --gpu any`` spreads a burst, promises hold memory.

On ``gpushare daemon --simulate 4`` (real socket, real cgroups where the machine allows, simulated
GPUs and MPS) and on the test daemon with fake GPUs (tests/support/daemon_proc.py). The rule itself
is tested in tests/control/test_placement.py.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import DaemonProc, wait_for
from gpushare import protocol
from gpushare.client import ApiClient, ApiError
from gpushare.protocol import ErrorCode
from tests.fakes.fake_gpu import fake_uuid
from tests.support import sim_daemon_helpers as helpers
from tests.support.sim_daemon_helpers import SimDaemon

ABSENT_MPS = Path("/nonexistent/gpushare-test/nvidia-cuda-mps-control")
GIB = 1 << 30
# GPU 3 keeps 14G of its 16G for online clients: an offline client with no --mem still fits there
# (14G <= 16G), one with --mem 4G does not (18G).
SIM_CONFIG = '[gpus."3"]\nonline_memory_reserve = "14G"'


@pytest.fixture
def sim4() -> Iterator[SimDaemon]:
    with helpers.sim_daemon(ABSENT_MPS, rest=SIM_CONFIG, gpus=4) as d:
        try:
            yield d
        finally:
            _cancel_all(d)


def _api(d: SimDaemon) -> ApiClient:
    return ApiClient.connect(d.base / "run" / "gpushare.sock", timeout_s=10.0)


def _request(**params: Any) -> dict[str, Any]:
    """What ``gpushare submit --offline --detach [--gpu G] [--mem M] -- sleep 120`` sends."""
    req: dict[str, Any] = {
        "cls": "offline", "argv": ["sleep", "120"], "detach": True, "cwd": "/",
        "env": {"PATH": os.environ["PATH"]}, "gpu": "any",
    }  # fmt: skip
    req.update(params)
    return req


def _cancel_all(d: SimDaemon) -> None:
    """Cancel every client over the socket (one CLI process each would take seconds)."""
    if d.proc.poll() is not None:
        return
    with _api(d) as api:
        for c in api.call(protocol.LIST, {})["clients"]:
            api.call(protocol.CANCEL, {"client_id": c["id"]})
        wait_for(lambda: not api.call(protocol.LIST, {})["clients"], 10.0, "the clients to end")


def _gpu_of(stdout: str) -> str:
    found = re.search(r"started on (GPU-\S+)", stdout)
    assert found, stdout
    return found.group(1)


def test_a_burst_spreads_over_idle_gpus_and_named_or_unfitting_gpus_behave_as_before(
    sim4: SimDaemon,
) -> None:
    d = sim4
    # The burst: 8 detached submits back to back, before NVML could show any of them.
    # Idle sleeps use no GPU memory, so free memory alone ties: the client count spreads them.
    with _api(d) as api:
        placed = [api.call(protocol.SUBMIT, _request())["gpu_uuid"] for _ in range(8)]
    assert Counter(placed) == {f"GPU-sim-000{i}": 2 for i in range(4)}, placed
    assert placed[:4] == [f"GPU-sim-000{i}" for i in range(4)]  # one each in turn

    # A named GPU is still that GPU, however many clients it has.
    res = d.cli("submit", "--offline", "--detach", "--gpu", "0", "--", "sleep", "120")
    assert res.returncode == 0, res.stderr
    assert _gpu_of(res.stdout) == "GPU-sim-0000"

    # A GPU that does not fit is skipped: GPU 3 keeps 14G for online clients, so --mem 4G goes
    # to the GPU with the fewest clients of those that fit (GPU 0 has 3 now).
    res = d.cli("submit", "--offline", "--detach", "--mem", "4G", "--", "sleep", "120")
    assert res.returncode == 0, res.stderr
    assert _gpu_of(res.stdout) == "GPU-sim-0001"
    # Named, it is refused with the message it always had.
    res = d.cli("submit", "--offline", "--detach", "--gpu", "3", "--mem", "4G", "--", "sleep", "1")
    assert res.returncode == 5  # no capacity (gpushare.cli.exitcodes)
    assert res.stderr.strip() == (
        "gpushare: GPU 3: needs 18G with 14G kept for online clients, 16G free"
    )
    # Nowhere fits: every GPU's reason; GPU 1's counts the 4G promised to the client just placed.
    res = d.cli("submit", "--offline", "--detach", "--mem", "15G", "--", "sleep", "1")
    assert res.returncode == 5  # no capacity (gpushare.cli.exitcodes)
    assert res.stderr.strip() == (
        "gpushare: GPU 0: needs 17G with 2G kept for online clients, 16G free; "
        "GPU 1: needs 17G with 2G kept for online clients, 12G free after 4G promised to "
        "clients that do not use their --mem yet; "
        "GPU 2: needs 17G with 2G kept for online clients, 16G free; "
        "GPU 3: needs 29G with 14G kept for online clients, 16G free"
    )
    clients = json.loads(d.cli("list", "--json").stdout)["clients"]
    assert len(clients) == 10  # the refused submits left nothing behind


def test_a_promise_holds_memory_until_nvml_shows_it(sim4: SimDaemon) -> None:
    d = sim4
    # A simulated job's process uses its --mem in the simulated NVML sample, once it runs.
    res = d.cli(
        "submit", "--offline", "--detach", "--gpu", "0", "--mem", "4G",
        "--sim-profile", "resnet50-train", "--", "sleep", "120",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr

    def used() -> bool:
        gpu = json.loads(d.cli("status", "--json", "--gpu", "0").stdout)["gpus"][0]
        return bool(gpu["mem_used_bytes"] == 4 * GIB)

    wait_for(used, 20.0, "the simulated job's memory in NVML's sample")
    with _api(d) as api:
        # Shown, it is no longer promised as well: 12G free, 10G needed (a double count: 8G).
        placed = api.call(protocol.SUBMIT, _request(gpu="0", mem_bytes=8 * GIB))
        assert placed["gpu_uuid"] == "GPU-sim-0000"
        # This sleep never shows its 8G: they stay promised, 4G are left for others.
        api.call(protocol.SUBMIT, _request(gpu="0", mem_bytes=2 * GIB))  # 2G + 2G reserve fit
        with pytest.raises(ApiError) as info:
            # Main's rule took this too: 12G free in NVML's reading, 5G needed.
            api.call(protocol.SUBMIT, _request(gpu="0", mem_bytes=3 * GIB, no_queue=True))
        assert info.value.code is ErrorCode.NO_CAPACITY
        assert info.value.message == (
            "GPU 0: needs 5G with 2G kept for online clients, 2G free after 10G promised to "
            "clients that do not use their --mem yet"
        )
        # With gpu any it goes to an idle GPU instead.
        assert api.call(protocol.SUBMIT, _request(mem_bytes=3 * GIB))["gpu_uuid"] != (
            "GPU-sim-0000"
        )


@pytest.fixture
def fake2() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=2)  # two 16G GPUs with 1G used, whose NVML lists no processes
    try:
        yield d.start()
    finally:
        d.cleanup()


def test_declared_memory_spreads_and_is_held_until_shown(fake2: DaemonProc) -> None:
    d = fake2
    first = d.submit_detached(["sleep", "30"], gpu="any", mem_bytes=8 << 30)
    second = d.submit_detached(["sleep", "30"], gpu="any", mem_bytes=8 << 30)
    # Equal free memory in NVML's reading; the first's 8G, promised, sends the second elsewhere.
    assert (first["gpu_uuid"], second["gpu_uuid"]) == (fake_uuid(0), fake_uuid(1))
    with pytest.raises(ApiError) as info:
        d.submit_detached(["sleep", "30"], gpu="0", mem_bytes=8 << 30, no_queue=True)
    assert info.value.code is ErrorCode.NO_CAPACITY
    assert info.value.message == (
        "GPU 0: needs 10G with 2G kept for online clients, 7G free after 8G promised to "
        "clients that do not use their --mem yet"
    )
    # A client without --mem promises nothing: it still fits beside them.
    third = d.submit_detached(["sleep", "30"], gpu="0")
    assert third["gpu_uuid"] == fake_uuid(0)
