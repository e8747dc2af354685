"""Build the in-flight bound (``inflight.c``) with the host's C compiler.

One place says how: ``make native`` (through ``scripts/build-native.sh``), ``gpushare install`` and
the tests all compile it here. ``python -m gpushare.native.build [--strict] [--sanitize=NAME] [OUT]``
builds it next to :mod:`gpushare.native` or into ``OUT``; ``--sanitize`` (``asan``: AddressSanitizer
with UndefinedBehaviorSanitizer, ``tsan``: ThreadSanitizer) makes the instrumented variants the
tests run, never one to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from gpushare.native import LIBRARY_NAME, library_path

SOURCE = Path(__file__).resolve().parent / "inflight.c"
"""The interposer's source, shipped in the package so a host can build it."""

FLAGS = ("-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")
"""-O2 is load-bearing: dlsym(RTLD_NEXT, ...) must be forwarded as a tail call (inflight.c)."""

STRICT_FLAGS = ("-Werror",)
"""Added by ``make native`` and the tests: a warning fails the build here, never on an operator's
host, whose newer compiler may warn about what this one did not."""

SANITIZERS: dict[str, tuple[str, ...]] = {
    "asan": ("-fsanitize=address,undefined", "-fno-sanitize-recover=all"),
    "tsan": ("-fsanitize=thread",),
}
"""Extra flags of each instrumented variant (-O2 kept: the dlsym forward must stay a tail call)."""

_RUNTIMES = {"asan": ("libasan.so", "libubsan.so"), "tsan": ("libtsan.so",)}

_TIMEOUT_S = 120.0


def compiler() -> str | None:
    """The C compiler to use (``$CC``, else ``cc``), or ``None`` when there is none."""
    return shutil.which(os.environ.get("CC") or "cc")


def sanitizer_runtimes(name: str) -> tuple[Path, ...] | None:
    """The shared runtimes a program must preload, first, to run a ``name`` variant.

    ``None`` when the compiler lacks one (it answers ``-print-file-name`` with the bare name).
    """
    cc = compiler()
    if cc is None or name not in _RUNTIMES:
        return None
    found = []
    for lib in _RUNTIMES[name]:
        try:
            done = subprocess.run(
                [cc, f"-print-file-name={lib}"],
                capture_output=True,
                text=True,
                timeout=_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        path = Path(done.stdout.strip())
        if done.returncode != 0 or not path.is_absolute() or not path.is_file():
            return None
        found.append(path.resolve())
    return tuple(found)


def build(
    out: Path | None = None,
    *,
    strict: bool = False,
    sanitize: str | None = None,
    source: Path = SOURCE,
) -> tuple[bool, str]:
    """Compile the interposer into ``out`` (default: :func:`library_path`); ``strict``: -Werror.

    ``sanitize`` names an instrumented variant (:data:`SANITIZERS`); ``source`` another version
    of ``inflight.c`` (the tests build an older one to show that a new test fails on it).

    Returns:
        Whether it was built, and a line saying what happened or why not (no compiler, the
        compiler's own error). The file is replaced atomically: a client starting meanwhile
        preloads the old library or the new one, never half of one.
    """
    target = out if out is not None else library_path()
    if sanitize is not None and sanitize not in SANITIZERS:
        return False, f"unknown sanitizer {sanitize!r} (one of {', '.join(SANITIZERS)})"
    cc = compiler()
    if cc is None:
        return False, (
            f"no C compiler ({os.environ.get('CC') or 'cc'}) on PATH: {target} not built "
            "(apt-get install gcc, or dnf install gcc)"
        )
    tmp = target.with_name(f".{LIBRARY_NAME}.{os.getpid()}.tmp")
    argv = [
        cc,
        *FLAGS,
        *(STRICT_FLAGS if strict else ()),
        *(SANITIZERS[sanitize] if sanitize is not None else ()),
        "-o",
        str(tmp),
        str(source),
        "-ldl",
        "-lpthread",
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        tmp.unlink(missing_ok=True)
        return False, f"{cc} failed: {exc}"
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        return False, f"{cc} failed: {(done.stderr or done.stdout).strip()}"
    os.replace(tmp, target)
    return True, f"built {target}"


def main(argv: list[str]) -> int:
    """``python -m gpushare.native.build [--strict] [--sanitize=NAME] [OUT]``.

    Returns 0 when built or there is no compiler.
    """
    strict = "--strict" in argv
    sanitize = next((a.split("=", 1)[1] for a in argv if a.startswith("--sanitize=")), None)
    rest = [a for a in argv if a != "--strict" and not a.startswith("--sanitize=")]
    ok, line = build(Path(rest[0]) if rest else None, strict=strict, sanitize=sanitize)
    print(f"build-native: {line}")
    return 0 if ok or compiler() is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
