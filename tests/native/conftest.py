"""Fixtures of the in-flight interposer's tests: its builds (plain, ASan+UBSan, TSan) and a runner.

``fake_cuda.c`` is built as ``libcuda.so.1`` with a fake GPU that runs "kernels" (sleeps) and
counts the kernels enqueued and not yet done; ``launcher_prog.c`` reaches the launch entry points
the ways real programs do and prints what the fake GPU saw. Every test runs against each build
variant: the interposer and the fake instrumented with AddressSanitizer and UndefinedBehavior-
Sanitizer, or ThreadSanitizer, their runtime preloaded first (the program is not instrumented).
``GPUSHARE_TEST_INFLIGHT_C=path`` builds the interposer from another ``inflight.c`` (an older
one, to see a test fail on it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpushare import native
from gpushare.native import build as native_build

HERE = Path(__file__).resolve().parent
CC = shutil.which(os.environ.get("CC", "cc"))
FLAGS = ("-std=c11", "-O2", "-Wall", "-Wextra", "-Werror")
SANITIZER_ENV = {
    # Reports fail the run (exit status) and say where; no leak report: the fake never frees.
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=86",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=86",
    "TSAN_OPTIONS": "halt_on_error=1:exitcode=86:report_signal_unsafe=0",
}


@dataclass(frozen=True)
class Built:
    """One build variant: the interposer, the fake driver's directory and the launcher."""

    variant: str
    library: Path
    prog: Path
    fake_dir: Path
    runtimes: tuple[Path, ...]  # sanitizer runtimes to preload first; () for the plain build

    def preload(self, with_library: bool, *more: Path) -> str:
        """The LD_PRELOAD value: the runtimes, then the interposer (if wanted), then ``more``."""
        libs = [*self.runtimes, *((self.library,) if with_library else ()), *more]
        return " ".join(str(p) for p in libs)


def _compile(args: list[str]) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=120)


VARIANTS = ("plain", "asan", "tsan")

without_tsan = pytest.mark.parametrize("built", ["plain", "asan"], indirect=True)
"""For tests of parsing and single-threaded paths: ThreadSanitizer's start-up costs about a second
a process on 2 busy cores, and it has nothing to find there (its runs are the threaded tests)."""

without_asan = pytest.mark.parametrize("built", ["plain", "tsan"], indirect=True)
"""For a siglongjmp out of a signal handler that interrupted the library's nap: under ASan a worker
thread of the fake driver crashed at a garbage pc once in some hundreds of runs (never in the plain
or TSan builds, not reproduced in 60 runs alone); what such a test checks (no hang, no lock left
held) is checked by those two builds."""


@pytest.fixture(scope="session", params=VARIANTS)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Built:
    variant: str = request.param
    if CC is None:
        pytest.skip("no C compiler (cc) on PATH: apt-get install gcc to test the interposer")
    sanitize = None if variant == "plain" else variant
    runtimes: tuple[Path, ...] = ()
    if sanitize is not None:
        found = native_build.sanitizer_runtimes(sanitize)
        if found is None:
            pytest.skip(f"{CC} has no {variant} runtime (apt-get install gcc's libasan/libtsan)")
        runtimes = found
    d = tmp_path_factory.mktemp(f"inflight-{variant}")
    lib = d / native.LIBRARY_NAME
    other = os.environ.get("GPUSHARE_TEST_INFLIGHT_C")
    source = Path(other) if other else native_build.SOURCE
    # The interposer as `make native` builds it (plus the sanitizer's flags), into our directory.
    ok, line = native_build.build(lib, strict=other is None, sanitize=sanitize, source=source)
    assert ok, line
    san = list(native_build.SANITIZERS[sanitize]) if sanitize is not None else []
    # -Bsymbolic: the fake's own references (the pointers its cuGetProcAddress hands out) bind
    # inside it, as the real driver's do, so LD_PRELOAD does not reach them by accident.
    fake = [CC, *FLAGS, *san, "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-Wl,-Bsymbolic"]
    _compile([*fake, "-o", str(d / "libcuda.so.1"), str(HERE / "fake_cuda.c"), "-lpthread"])
    prog = d / "launcher_prog"
    link = [f"-L{d}", "-l:libcuda.so.1", f"-Wl,-rpath,{d}", "-ldl", "-lpthread"]
    _compile([CC, *FLAGS, "-o", str(prog), str(HERE / "launcher_prog.c"), *link])
    return Built(variant=variant, library=lib, prog=prog, fake_dir=d, runtimes=runtimes)


@dataclass(frozen=True)
class Run:
    fake: dict[str, object]
    stderr: str
    stats: dict[str, object] | None


def base_env(b: Built, *, preload: bool, more_preload: tuple[Path, ...] = ()) -> dict[str, str]:
    """The environment of a run: no GPUSHARE_ variable, the build's LD_PRELOAD."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSHARE_")}
    env.pop("LD_PRELOAD", None)
    env.update(SANITIZER_ENV)
    value = b.preload(preload, *more_preload)
    if value:
        env["LD_PRELOAD"] = value
    return env


def run(
    b: Built,
    *args: str | int,
    bound: str | None = "2",
    preload: bool = True,
    stats: Path | None = None,
    extra_env: dict[str, str] | None = None,
    more_preload: tuple[Path, ...] = (),
    timeout_s: float = 30,
) -> Run:
    env = base_env(b, preload=preload, more_preload=more_preload)
    if bound is not None:
        env[native.INFLIGHT_ENV] = bound
    if stats is not None:
        env[native.STATS_ENV] = str(stats)
    env.update(extra_env or {})
    p = subprocess.run(
        [str(b.prog), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    assert p.returncode == 0, p.stderr
    return Run(
        fake=json.loads(p.stdout),
        stderr=p.stderr,
        stats=json.loads(stats.read_text()) if stats is not None and stats.exists() else None,
    )


def assert_all_ran_in_order(fake: dict[str, object]) -> None:
    assert fake["kernels_done"] == fake["expected"]
    assert fake["order_ok"] is True
    assert fake["launch_errors"] == 0
