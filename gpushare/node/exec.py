"""The one function through which gpushare runs external commands.

Never a shell, always a timeout, ``LC_ALL=C`` so outputs parse the same everywhere, and a result
instead of an exception on a non-zero exit.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Completed:
    """The outcome of :func:`run`. ``timed_out`` implies ``returncode == -1``."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """The command ran to completion with exit status 0."""
        return self.returncode == 0 and not self.timed_out


def run(
    argv: Sequence[str],
    *,
    input: str | None = None,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> Completed:
    """Run ``argv`` to completion, feeding ``input`` on stdin; never raises for exit status.

    Raises:
        FileNotFoundError: the program does not exist.
        PermissionError: the program is not executable.
    """
    full_env = dict(os.environ if env is None else env)
    full_env["LC_ALL"] = "C"
    try:
        proc = subprocess.run(
            list(argv),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=full_env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        log.warning("cmd_timeout", argv=list(argv), timeout_s=timeout_s)
        return Completed(tuple(argv), -1, _text(exc.stdout), _text(exc.stderr), timed_out=True)
    if proc.returncode != 0:
        log.debug("cmd_failed", argv=list(argv), rc=proc.returncode, stderr=proc.stderr[-500:])
    return Completed(tuple(argv), proc.returncode, proc.stdout, proc.stderr)


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode(errors="replace")
