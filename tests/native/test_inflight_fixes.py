"""The in-flight interposer is harmless inside any job it is preloaded into (issue 31).

One test (or group) per finding of the review at b0c0ecb, each failing on that library (run with
``GPUSHARE_TEST_INFLIGHT_C`` pointing at its inflight.c) and passing on this one. Where the bound
is off, a preloaded process must behave exactly as one without the preload: those tests compare
the two. What is checked is the fake GPU's count and log (conftest.py), not the interposer's.
"""

from __future__ import annotations

import os
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpushare import native
from tests.native.conftest import (
    CC,
    FLAGS,
    HERE,
    Built,
    assert_all_ran_in_order,
    run,
    without_asan,
    without_tsan,
)

KERNEL_US = 200
BURST = 40
HANG_S = 10  # a run that takes this long has hung: these runs take well under a second


@dataclass(frozen=True)
class DlHelpers:
    plugin: Path  # libplugin.so, linked to libdep.so
    next_interposer: Path  # a second LD_PRELOAD dlsym, HAMi-core's style


@pytest.fixture(scope="module")
def dl_helpers(tmp_path_factory: pytest.TempPathFactory) -> DlHelpers:
    if CC is None:
        pytest.skip("no C compiler (cc) on PATH: apt-get install gcc to test the interposer")
    d = tmp_path_factory.mktemp("dl")
    src = str(HERE / "dl_helpers.c")
    shared = [CC, *FLAGS, "-fPIC", "-shared"]
    plugin_link = ["-Wl,--no-as-needed", "-l:libdep.so", f"-Wl,-rpath,{d}", "-ldl"]
    steps = [
        [*shared, "-DDEP", "-o", str(d / "libdep.so"), src],
        [*shared, "-DPLUGIN", "-o", str(d / "libplugin.so"), src, f"-L{d}", *plugin_link],
        [*shared, "-DNEXT_INTERPOSER", "-o", str(d / "libnext.so"), src, "-ldl"],
    ]
    for argv in steps:
        subprocess.run(argv, check=True, capture_output=True, timeout=120)
    return DlHelpers(plugin=d / "libplugin.so", next_interposer=d / "libnext.so")


# ---- 1. dlsym --------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", ["2", None], ids=["bounded", "bound-off"])
def test_a_plugin_loaded_local_finds_its_dependency_through_rtld_default(
    built: Built, dl_helpers: DlHelpers, bound: str | None
) -> None:
    # As Python loads an extension module: RTLD_LOCAL, and its own dlsym(RTLD_DEFAULT, ...) of a
    # symbol of its dependency, which glibc resolves in the caller's scope.
    env = {"LAUNCHER_PLUGIN": str(dl_helpers.plugin)}
    bare = run(built, "direct", "kernel", 2, 0, preload=False, extra_env=env)
    assert bare.fake["plugin_found"] == 1
    r = run(built, "direct", "kernel", 2, 0, bound=bound, extra_env=env)
    assert r.fake["plugin_found"] == 1


@pytest.mark.parametrize("bound", ["2", None], ids=["bounded", "bound-off"])
def test_a_later_interposer_still_sees_dlsym_and_the_bound_holds(
    built: Built, dl_helpers: DlHelpers, bound: str | None
) -> None:
    # HAMi-core's style, preloaded after gpushare's (the daemon puts ours first): its unversioned
    # dlsym must see cudart's dlsym(handle, "cuGetProcAddress_v2") as without our library.
    more = (dl_helpers.next_interposer,)
    alone = run(built, "dlsym-gpa", "kernel", BURST, KERNEL_US, preload=False, more_preload=more)
    r = run(built, "dlsym-gpa", "kernel", BURST, KERNEL_US, bound=bound, more_preload=more)
    assert alone.fake["next_interposer_lookups"] == 1
    assert r.fake["next_interposer_lookups"] == 1
    if bound is not None:
        assert r.fake["max_inflight"] == 2
    else:
        assert r.fake["max_inflight"] >= BURST - 5
    assert_all_ran_in_order(r.fake)


# ---- 2. streams ------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", ["4", None], ids=["bounded", "bound-off"])
def test_a_slow_stream_does_not_hold_back_another(built: Built, bound: str | None) -> None:
    # 300 ms on stream A, then 20 x 1 ms on stream B: B needs none of A's slot, so its launches
    # go on (3 slots retired out of order) and its kernels finish before A's.
    bare = run(built, "direct", "slowfirst", 21, 1000, preload=False)
    r = run(built, "direct", "slowfirst", 21, 1000, bound=bound)
    assert bare.fake["last_tag"] == 0
    assert r.fake["last_tag"] == 0
    loop_ns = r.fake["launch_loop_ns"]
    assert isinstance(loop_ns, int)
    assert loop_ns < 150_000_000, loop_ns
    assert_all_ran_in_order(r.fake)
    if bound is not None:
        assert r.fake["max_inflight"] == 4


@without_tsan
@pytest.mark.parametrize("bound", ["1", "2", None], ids=["k1", "k2", "bound-off"])
def test_the_legacy_default_stream_keeps_its_order(built: Built, bound: str | None) -> None:
    # 30 ms on stream A, 1 ms on the legacy stream, 1 ms on stream B: the legacy kernel waits
    # for A and B's for it (the fake follows the documented semantics; without them B's and the
    # legacy kernel would finish first).
    bare = run(built, "direct", "legacy", 3, 0, preload=False)
    r = run(built, "direct", "legacy", 3, 0, bound=bound)
    assert bare.fake["tags"] == [0, 1, 2]
    assert r.fake["tags"] == [0, 1, 2]
    assert_all_ran_in_order(r.fake)


# ---- 3. wait limit ---------------------------------------------------------------------------


def test_a_give_up_lets_that_launch_through_and_the_bound_comes_back(
    built: Built, tmp_path: Path
) -> None:
    # A 600 ms kernel against a 300 ms limit at k = 2 (the 400 ms, with a margin for a
    # loaded machine, whose preemptions do not count as waiting); after it a burst is bounded.
    stats = tmp_path / "stats.json"
    env = {native.WAIT_LIMIT_ENV: "300"}
    r = run(built, "direct", "stuck", 2 * BURST, KERNEL_US, 1, 1, "none", "-", stats=stats,
            extra_env=env)  # fmt: skip
    assert r.fake["max_inflight"] == 2  # the second half, after the stuck kernel
    assert_all_ran_in_order(r.fake)
    assert r.stats is not None
    assert r.stats["give_ups"] == 1
    assert r.stats["passthrough_reason"] is None
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "300 ms without finishing" in lines[0]


# ---- 4. graphs -------------------------------------------------------------------------------


def test_a_graph_launch_drains_so_a_graph_of_kernels_is_not_one_slot(
    built: Built, tmp_path: Path
) -> None:
    # Graphs of 3 kernel nodes at k = 4: one graph in flight at a time (3 kernels), not 4 graphs.
    stats = tmp_path / "stats.json"
    env = {"LAUNCHER_GRAPH_NODES": "3"}
    r = run(built, "direct", "graph", 20, KERNEL_US, bound="4", stats=stats, extra_env=env)
    assert r.fake["max_inflight"] == 3
    assert r.fake["kernels_done"] == 60
    assert r.stats is not None
    assert r.stats["graph_launches"] == 20


# ---- 5. fork ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bound", ["2", None], ids=["bounded", "bound-off"])
def test_a_forked_child_of_a_process_without_cuda_keeps_the_bound(
    built: Built, bound: str | None
) -> None:
    # Python multiprocessing's fork start, Lightning's ddp_fork: the parent never touched CUDA.
    env = {"LAUNCHER_FORK": "1"}
    # Kernels 10x longer than elsewhere: a loaded host (or TSan) issuing the burst slowly must
    # still find it all in flight without the bound (the run measured 34 of 40 at 200 us).
    kernel_us = 10 * KERNEL_US
    bare = run(built, "direct", "kernel", BURST, kernel_us, preload=False, extra_env=env)
    r = run(built, "direct", "kernel", BURST, kernel_us, bound=bound, extra_env=env)
    assert bare.fake["max_inflight"] >= BURST - 5
    if bound is not None:
        assert r.fake["max_inflight"] == 2
    else:
        assert r.fake["max_inflight"] >= BURST - 5
    assert_all_ran_in_order(r.fake)


# ---- 6. cancellation and signals -------------------------------------------------------------


def test_a_cancelled_waiter_does_not_hang_the_process(built: Built) -> None:
    # The thread is cancelled while it waits in the library; the main thread then launches.
    r = run(built, "direct", "cancel", 1, KERNEL_US, bound="1", timeout_s=HANG_S)
    assert_all_ran_in_order(r.fake)


@without_asan
def test_a_longjmp_out_of_a_wait_does_not_hang_the_process(built: Built, tmp_path: Path) -> None:
    # SIGALRM's handler siglongjmps out of a launch waiting in the library; then one more launch,
    # and the exit (which writes the stats) must not hang either.
    stats = tmp_path / "stats.json"
    r = run(built, "direct", "longjmp", 1, KERNEL_US, bound="1", stats=stats, timeout_s=HANG_S)
    assert r.fake["jumped"] == 1
    assert_all_ran_in_order(r.fake)
    assert r.stats is not None


# ---- 7. contexts -----------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["reset", "recreate"])
def test_no_event_of_a_destroyed_context_is_used_again(built: Built, how: str) -> None:
    # Halfway: cuDevicePrimaryCtxReset (as cudaDeviceReset), or cuCtxDestroy and a new context
    # at the same address. The fake counts every use of an event that died with its context.
    r = run(built, "direct", "kernel", 2 * BURST, KERNEL_US, 1, 1, "none", how)
    assert r.fake["stale_event_uses"] == 0
    assert r.fake["max_inflight_before_switch"] == 2
    assert r.fake["max_inflight"] == 2
    assert_all_ran_in_order(r.fake)
    assert r.stderr == ""


def test_streams_of_two_created_contexts_are_bounded_together(built: Built) -> None:
    # Launched from the primary context onto streams of two others: each event is created in
    # its stream's context (pushed and popped), or the fake's cuEventRecord refuses it.
    r = run(built, "direct", "twoctx", BURST, KERNEL_US)
    assert r.fake["max_inflight"] == 2
    assert_all_ran_in_order(r.fake)
    assert r.stderr == ""


# ---- 8. files from the environment -----------------------------------------------------------


@without_tsan
def test_a_fifo_as_the_control_file_is_refused_without_blocking(
    built: Built, tmp_path: Path
) -> None:
    fifo = tmp_path / "control"
    os.mkfifo(fifo)
    env = {native.CONTROL_ENV: str(fifo)}
    r = run(built, "direct", "kernel", BURST, KERNEL_US, extra_env=env, timeout_s=HANG_S)
    assert r.fake["max_inflight"] == 2  # from GPUSHARE_MAX_INFLIGHT
    assert "not a regular file" in r.stderr


@without_tsan
def test_a_symlinked_control_file_is_refused(built: Built, tmp_path: Path) -> None:
    real = tmp_path / "bound"
    real.write_bytes((1).to_bytes(4, "little"))
    link = tmp_path / "link"
    link.symlink_to(real)
    r = run(built, "direct", "kernel", BURST, KERNEL_US, extra_env={native.CONTROL_ENV: str(link)})
    assert r.fake["max_inflight"] == 2  # not the file's 1
    assert "symbolic link" in r.stderr


@without_tsan
def test_a_fifo_as_the_stats_path_does_not_hang_the_exit(built: Built, tmp_path: Path) -> None:
    fifo = tmp_path / "stats"
    os.mkfifo(fifo)
    env = {native.STATS_ENV: str(fifo)}  # not stats=: the runner would read the FIFO itself
    r = run(built, "direct", "kernel", 4, KERNEL_US, extra_env=env, timeout_s=HANG_S)
    # O_NONBLOCK: with no reader the open fails at once (ENXIO) rather than block.
    assert "cannot write" in r.stderr


@without_tsan
def test_a_symlink_as_the_stats_path_is_not_followed(built: Built, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("unchanged\n")
    link = tmp_path / "stats.json"
    link.symlink_to(target)
    env = {native.STATS_ENV: str(link)}  # not stats=: the runner would read the target
    r = run(built, "direct", "kernel", 4, KERNEL_US, extra_env=env)
    assert target.read_text() == "unchanged\n"
    assert "symbolic link" in r.stderr


@without_tsan
def test_the_stats_file_is_created_private(built: Built, tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    old = os.umask(0o022)
    try:
        r = run(built, "direct", "kernel", 4, KERNEL_US, stats=stats)
    finally:
        os.umask(old)
    assert r.stats is not None
    assert stat.S_IMODE(stats.stat().st_mode) == 0o600
