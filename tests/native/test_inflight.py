"""The shallow-queue interposer (gpushare/native/inflight.c) against a fake libcuda.

Fixtures and the runner are in conftest.py; every bound checked here is the fake GPU's count, not
the interposer's own bookkeeping.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gpushare import native
from tests.native.conftest import Built, assert_all_ran_in_order, base_env, run, without_tsan

# Long enough kernels that an unbounded burst of launches is all queued at once (each launch
# costs a few microseconds), short enough that a test takes well under a second.
KERNEL_US = 200
BURST = 40


def test_without_the_preload_the_whole_burst_is_in_flight(built: Built) -> None:
    # The control for every bound below: the fake GPU does see a deep queue.
    r = run(built, "direct", "kernel", BURST, KERNEL_US, preload=False)
    assert r.fake["max_inflight"] >= BURST - 5
    assert_all_ran_in_order(r.fake)


def test_bound_holds_and_every_kernel_runs_in_order(built: Built) -> None:
    r = run(built, "direct", "kernel", BURST, KERNEL_US, 2)
    assert r.fake["max_inflight"] == 2
    assert_all_ran_in_order(r.fake)
    # Pooled and reused: as many events as the bound, none with timing.
    assert r.fake["events_created"] == 2
    assert r.fake["events_timed"] == 0
    assert r.stderr == ""


@without_tsan
def test_bound_one_is_as_shallow_as_launch_blocking(built: Built) -> None:
    r = run(built, "direct", "kernel", 20, KERNEL_US, bound="1")
    assert r.fake["max_inflight"] == 1
    assert_all_ran_in_order(r.fake)


@without_tsan
@pytest.mark.parametrize(
    "reach",
    [
        "direct",
        "gpa",
        "gpa-ptsz",
        "gpa-self",
        "dlsym-gpa",
        "dlsym-gpa-v1",
        "dlsym",
        "ptsz",
        "rtld-next",
    ],
)
def test_every_way_of_reaching_a_launch_is_bounded(built: Built, reach: str) -> None:
    r = run(built, reach, "kernel", BURST, KERNEL_US)
    assert r.fake["max_inflight"] == 2
    assert_all_ran_in_order(r.fake)
    # The variant asked for is the variant that ran: per-thread flag -> the driver's _ptsz.
    legacy, ptsz = (0, BURST) if reach in ("ptsz", "gpa-ptsz") else (BURST, 0)
    assert (r.fake["calls_legacy"], r.fake["calls_ptsz"]) == (legacy, ptsz)


@without_tsan
@pytest.mark.parametrize("api", ["ex", "coop", "graph"])
@pytest.mark.parametrize("reach", ["direct", "dlsym-gpa", "ptsz"])
def test_ex_cooperative_and_graph_launches_are_bounded(built: Built, api: str, reach: str) -> None:
    r = run(built, reach, api, BURST, KERNEL_US, bound="3")
    # A graph launch drains (inflight.c): one graph at a time, here of one kernel node.
    assert r.fake["max_inflight"] == (1 if api == "graph" else 3)
    assert_all_ran_in_order(r.fake)


def test_threads_launching_at_once_stay_bounded(built: Built) -> None:
    # 4 threads x 2 streams each, one process-wide bound.
    r = run(built, "dlsym-gpa", "kernel", 25, KERNEL_US, 2, 4)
    assert r.fake["expected"] == 100
    assert r.fake["max_inflight"] == 2
    assert_all_ran_in_order(r.fake)


def test_a_capturing_stream_passes_through_untouched(built: Built, tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    r = run(built, "direct", "kernel", BURST, KERNEL_US, 1, 1, "same", stats=stats)
    # No event recorded on, or waited for, a stream being captured; so nothing bounds it.
    assert r.fake["capture_violations"] == 0
    assert r.fake["events_created"] == 0
    assert r.fake["max_inflight"] > 2
    assert_all_ran_in_order(r.fake)
    assert r.stats is not None
    assert r.stats["captured_passthrough"] == BURST


def test_a_capture_elsewhere_is_not_invalidated_by_the_waits(built: Built) -> None:
    # Another stream is being captured in global mode: our event queries and waits must run in
    # relaxed mode, or the driver fails them and invalidates that capture.
    r = run(built, "direct", "kernel", BURST, KERNEL_US, 1, 1, "other")
    assert r.fake["capture_invalidated"] == 0
    assert r.fake["max_inflight"] == 2
    assert_all_ran_in_order(r.fake)


@without_tsan
@pytest.mark.parametrize("value", [None, "", "abc", "0", "-1", "2x", " 2", "1025", "99999999999"])
def test_a_bad_bound_passes_everything_through_and_says_so_once(
    built: Built, tmp_path: Path, value: str | None
) -> None:
    stats = tmp_path / "stats.json"
    r = run(built, "dlsym-gpa", "kernel", BURST, KERNEL_US, bound=value, stats=stats)
    assert r.fake["max_inflight"] >= BURST - 5
    assert r.fake["events_created"] == 0
    assert_all_ran_in_order(r.fake)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert native.INFLIGHT_ENV in lines[0]
    if value:
        assert f"'{value}'" in lines[0]
    assert r.stats is not None
    assert r.stats["bound"] == 0
    assert native.INFLIGHT_ENV in str(r.stats["passthrough_reason"])


def test_stats_file_counts_launches_and_waits(built: Built, tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    r = run(built, "ptsz", "kernel", BURST, KERNEL_US, stats=stats)
    assert r.stats is not None
    assert r.stats["launches"] == BURST
    assert r.stats["bound"] == 2
    assert r.stats["max_inflight"] == 2
    assert r.stats["passthrough_reason"] is None
    # Kernels of 200 us against launches of a few: nearly every launch past the first two waits.
    waits = r.stats["waits"]
    assert isinstance(waits, int)
    assert BURST // 2 <= waits <= BURST - 2


@without_tsan
def test_a_failing_event_turns_the_bound_off_without_breaking_the_job(
    built: Built, tmp_path: Path
) -> None:
    stats = tmp_path / "stats.json"
    r = run(
        built,
        "direct",
        "kernel",
        BURST,
        KERNEL_US,
        stats=stats,
        extra_env={"FAKE_CUDA_FAIL_EVENT_CREATE": "1"},
    )
    assert_all_ran_in_order(r.fake)
    assert r.fake["max_inflight"] > 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "cuEventCreate" in lines[0]
    assert r.stats is not None
    assert "cuEventCreate" in str(r.stats["passthrough_reason"])


def test_the_module_names_what_the_daemon_sets() -> None:
    assert native.LIBRARY_NAME == "libgpushare_inflight.so"
    assert native.INFLIGHT_ENV == "GPUSHARE_MAX_INFLIGHT"
    assert native.STATS_ENV == "GPUSHARE_INFLIGHT_STATS"
    # The library reads these names: they must be spelled the same in inflight.c.
    source = (native.library_path().parent / "inflight.c").read_text()
    for name in (native.INFLIGHT_ENV, native.STATS_ENV, native.WAIT_LIMIT_ENV, native.CONTROL_ENV):
        assert f'getenv("{name}")' in source
    assert native.library_path().name == native.LIBRARY_NAME
    assert native.library_path().parent == Path(native.__file__).resolve().parent
    assert (native.library_path().parent / "inflight.c").is_file()
    assert native.built() == native.library_path().is_file()


def control_file(path: Path, value: int) -> Path:
    path.write_bytes(value.to_bytes(4, "little", signed=True))
    return path


def test_the_control_file_sets_the_bound_and_changes_it_without_a_restart(
    built: Built, tmp_path: Path
) -> None:
    ctl = control_file(tmp_path / "bound", 3)
    stats = tmp_path / "stats.json"
    # The file says 3 (over the environment's 2); halfway the daemon's side rewrites it to 1.
    r = run(
        built,
        "dlsym-gpa",
        "kernel",
        2 * BURST,
        KERNEL_US,
        1,
        1,
        "none",
        f"{ctl}:1",
        stats=stats,
        extra_env={native.CONTROL_ENV: str(ctl)},
    )
    assert r.fake["max_inflight_before_switch"] == 3
    assert r.fake["max_inflight"] == 1
    assert_all_ran_in_order(r.fake)
    assert r.stderr == ""
    assert r.stats is not None
    assert r.stats["bound"] == 1
    assert r.stats["passthrough_reason"] is None


@without_tsan
@pytest.mark.parametrize(
    ("first", "then", "before", "after"), [(0, 2, "burst", 2), (2, 0, 2, "burst")]
)
def test_a_control_value_of_zero_is_unbounded(
    built: Built, tmp_path: Path, first: int, then: int, before: object, after: object
) -> None:
    ctl = control_file(tmp_path / "bound", first)
    r = run(
        built,
        "direct",
        "kernel",
        2 * BURST,
        KERNEL_US,
        1,
        1,
        "none",
        f"{ctl}:{then}",
        bound=None,
        extra_env={native.CONTROL_ENV: str(ctl)},
    )
    for seen, want in (
        (r.fake["max_inflight_before_switch"], before),
        (r.fake["max_inflight"], after),
    ):
        if want == "burst":
            assert seen >= BURST - 5
        else:
            assert seen == want
    assert_all_ran_in_order(r.fake)
    assert r.stderr == ""  # GPUSHARE_MAX_INFLIGHT is not needed with a control file


@without_tsan
def test_an_unusable_control_file_falls_back_to_the_environment(
    built: Built, tmp_path: Path
) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"\x02")
    r = run(built, "direct", "kernel", BURST, KERNEL_US, extra_env={native.CONTROL_ENV: str(short)})
    assert r.fake["max_inflight"] == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert native.CONTROL_ENV in lines[0]
    assert str(short) in lines[0]


@without_tsan
def test_processes_that_launch_nothing_leave_the_stats_alone(built: Built, tmp_path: Path) -> None:
    # The job's shell and the tools it runs inherit LD_PRELOAD and the stats path.
    stats = tmp_path / "stats.json"
    env = base_env(built, preload=True)
    env.update({native.INFLIGHT_ENV: "2", native.STATS_ENV: str(stats)})
    script = f"{built.prog} direct kernel {BURST} {KERNEL_US} >/dev/null && /bin/true"
    subprocess.run(["/bin/sh", "-c", script], env=env, check=True, timeout=30)
    lines = stats.read_text().splitlines()
    assert len(lines) == 1, lines
    line = json.loads(lines[0])
    assert line["launches"] == BURST
    assert line["max_inflight"] == 2


def test_a_kernel_waiting_on_a_later_launch_does_not_hang_the_job(
    built: Built, tmp_path: Path
) -> None:
    # k = 1 holds back the launch the first kernel waits for: the wait must give up (that launch
    # goes through), not hang; the bound stays on.
    stats = tmp_path / "stats.json"
    r = run(
        built,
        "direct",
        "pair",
        10,
        KERNEL_US,
        bound="1",
        stats=stats,
        extra_env={native.WAIT_LIMIT_ENV: "200"},
    )
    assert_all_ran_in_order(r.fake)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "200 ms without finishing" in lines[0]
    assert r.stats is not None
    assert r.stats["passthrough_reason"] is None
    # At most one give-up per pair (its second launch is what its first kernel waits for); a
    # pair launched while an earlier give-up is unresolved goes through without waiting.
    give_ups = r.stats["give_ups"]
    assert isinstance(give_ups, int)
    assert 1 <= give_ups <= 5


def test_a_bound_that_fits_the_dependency_keeps_it(built: Built) -> None:
    r = run(built, "direct", "pair", 20, KERNEL_US, bound="2")
    assert r.fake["max_inflight"] == 2
    assert_all_ran_in_order(r.fake)
    assert r.stderr == ""
