"""``--queue auto`` switched live (issue 32): the control files and the daemon's live clients."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest

from gpushare.config import GateConfig
from gpushare.daemon.inflight_control import ControlFiles, LiveQueues
from gpushare.native import CONTROL_ENV, INFLIGHT_ENV

GPU = "GPU-1234-abcd"
LIB = "/opt/gs/libgpushare_inflight.so"
BOUNDED = GateConfig(shallow_queue="bounded", inflight_kernels=3)


def _bound(path: str) -> int:
    with open(path, "rb") as f:
        data = f.read()
    assert len(data) == 4, "never truncated nor grown: the clients map 4 bytes"
    return int(struct.unpack("<i", data)[0])


def test_a_control_file_is_root_s_readable_by_all_and_rewritten_in_place(tmp_path: Path) -> None:
    files = ControlFiles(tmp_path / "run" / "inflight")
    path = files.path(GPU)
    assert _bound(path) == 0, "a new file says unbounded"
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "inflight").st_mode) == 0o755
    ino = st.st_ino
    files.write(GPU, 4)
    assert _bound(path) == 4
    files.write(GPU, 0)
    assert _bound(path) == 0
    assert os.stat(path).st_ino == ino, "the same file: a client's mapping sees every write"
    files.close()


def test_a_link_planted_where_the_control_file_goes_is_not_written_through(
    tmp_path: Path,
) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    d = tmp_path / "inflight"
    d.mkdir()
    (d / GPU).symlink_to(target)
    with pytest.raises(OSError, match="Too many levels of symbolic links|symbolic link"):
        ControlFiles(d).path(GPU)
    assert target.read_bytes() == b"keep"


class _Writer:
    def __init__(self) -> None:
        self.writes: list[tuple[str, int]] = []

    def path(self, gpu_uuid: str) -> str:
        return f"/run/gs/inflight/{gpu_uuid}"

    def write(self, gpu_uuid: str, bound: int) -> None:
        self.writes.append((gpu_uuid, bound))


def test_an_auto_client_is_launched_with_the_control_file_and_follows_gating() -> None:
    writer, shallow = _Writer(), dict[str, str]()
    live = LiveQueues(lambda: writer, shallow)
    got = live.launch_env("c1", GPU, "auto", False, BOUNDED, LIB, now=10.0)
    assert got is not None
    env, how = got
    assert env == {"LD_PRELOAD": LIB, INFLIGHT_ENV: "3", CONTROL_ENV: f"/run/gs/inflight/{GPU}"}
    assert "unbounded" in how
    assert live.is_live("c1") and "c1" not in shallow
    assert writer.writes == [(GPU, 0)]
    # Gating on: the bound is written, the client is shallow at once, with no relaunch; kernels
    # it queued deep before still count as a deep queue's for the drain signal.
    assert live.gating(GPU, True, BOUNDED, now=20.0) == ["c1"]
    assert writer.writes[-1] == (GPU, 3)
    assert shallow["c1"] == "3 in flight"
    assert not live.settled("c1", 20.5, deep_drain_s=1.0)
    assert live.settled("c1", 21.0, deep_drain_s=1.0)
    # The same state again writes nothing; off again: deep.
    assert live.gating(GPU, True, BOUNDED, now=21.0) == []
    assert live.gating(GPU, False, BOUNDED, now=30.0) == ["c1"]
    assert writer.writes[-1] == (GPU, 0) and "c1" not in shallow
    live.forget("c1")
    assert not live.is_live("c1")


def test_a_client_launched_while_gating_is_on_has_nothing_queued_deep() -> None:
    writer, shallow = _Writer(), dict[str, str]()
    live = LiveQueues(lambda: writer, shallow)
    assert live.launch_env("c1", GPU, "auto", True, BOUNDED, LIB, now=5.0) is not None
    assert shallow["c1"] == "3 in flight"
    assert live.settled("c1", 5.0, deep_drain_s=1.0)


@pytest.mark.parametrize(
    ("queue", "gate", "library", "has_writer"),
    [
        ("deep", BOUNDED, LIB, True),
        ("shallow", BOUNDED, LIB, True),
        (None, BOUNDED, LIB, True),
        ("auto", GateConfig(shallow_queue="blocking"), LIB, True),
        ("auto", BOUNDED, None, True),  # the library may not be preloaded: the blocking fallback
        ("auto", BOUNDED, LIB, False),  # no writer: no live switch
    ],
)
def test_only_an_auto_client_that_can_preload_the_library_switches_live(
    queue: str | None, gate: GateConfig, library: str | None, has_writer: bool
) -> None:
    writer = _Writer()
    live = LiveQueues(lambda: writer if has_writer else None, {})
    assert live.launch_env("c1", GPU, queue, True, gate, library, now=0.0) is None
    assert not live.is_live("c1")
    assert writer.writes == []


def test_a_readopted_client_with_a_control_file_follows_its_gpu_again() -> None:
    writer, shallow = _Writer(), dict[str, str]()
    live = LiveQueues(lambda: writer, shallow)
    shallow["c1"] = "3 in flight"  # what its environment's GPUSHARE_MAX_INFLIGHT said
    assert live.adopt("c1", GPU, {CONTROL_ENV: "/run/gs/inflight/x", INFLIGHT_ENV: "3"})
    # The restarted daemon has not turned gating on: the file says unbounded.
    assert "c1" not in shallow
    assert live.gating(GPU, True, BOUNDED, now=1.0) == ["c1"]
    assert not live.adopt("c2", GPU, {INFLIGHT_ENV: "3"})
