"""The console-script entry point, with a fast path for plain ``gpushare status``.

``gpushare status`` is what people and monitoring scripts run most; through Typer it pays for
Typer's and Pydantic's imports and per-parameter adapters (about 0.3 s), so the common forms
(``status [--json] [-o wide|json] [--gpu G] [--socket S]``) are answered here with the standard library and the
API client only. Anything else, including ``--help`` and any form this parser does not know, goes
to the Typer application unchanged, which stays the reference for options and messages.
``gpushare slurm ...`` (Slurm's Prolog, TaskProlog and Epilog) and ``gpushare rank-exec`` (before
every worker of a gang, :mod:`gpushare.cli.rankexec_cmd`) are always answered here.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

_VALUE_OPTS = ("--gpu", "--socket", "--output")
_OUTPUTS = ("wide", "json")


def _parse_status(args: Sequence[str]) -> dict[str, str | bool] | None:
    opts: dict[str, str | bool] = {}
    it = iter(args)
    for arg in it:
        if arg == "--json":
            opts["json"] = True
            continue
        name, eq, value = arg.partition("=")
        name = "--output" if name == "-o" else name
        if name not in _VALUE_OPTS or name[2:] in opts:
            return None
        if not eq:
            value = next(it, "")
            if not value or value.startswith("-"):
                return None
        if name == "--output" and value not in _OUTPUTS:
            return None  # the Typer path says what is wrong
        opts[name[2:]] = value
    return opts


def run_status(opts: dict[str, str | bool]) -> int:
    """``gpushare status`` without Typer; returns the exit status."""
    from gpushare import protocol
    from gpushare.cli.render import mps_down, render_status
    from gpushare.cli.term import emit, use_colour
    from gpushare.client import ApiClient, ApiError, DaemonUnreachableError

    sock = opts.get("socket")
    params = {"gpu": opts["gpu"]} if "gpu" in opts else {}
    try:
        with ApiClient.connect(sock if isinstance(sock, str) else None) as api:
            result = api.call(protocol.STATUS, params)
    except DaemonUnreachableError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code
    except ApiError as exc:
        print(f"gpushare: {exc.message}", file=sys.stderr)
        return exc.code.exit_code()
    if opts.get("json") or opts.get("output") == "json":
        emit(json.dumps(result, indent=2))
    else:
        emit(render_status(result, wide=opts.get("output") == "wide", colour=use_colour()))
    return 1 if mps_down(result) else 0


USAGE = "usage: gpushare rank-exec -- CMD [ARGS...]  (a worker of `torchrun --no-python`)"


def run_rank_exec(args: Sequence[str]) -> int:
    """Exec ``args`` (after an optional ``--``) as its rank; the exit status when it cannot."""
    from gpushare import mpsenv
    from gpushare.cli import exitcodes

    cmd = list(args[1:] if args[:1] == ["--"] else args)
    if not cmd:
        print(f"gpushare rank-exec: no command; {USAGE}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    try:
        env = mpsenv.rank_env(os.environ)
    except mpsenv.RankError as exc:
        print(f"gpushare rank-exec: {exc}", file=sys.stderr)
        return exitcodes.BAD_INPUT
    try:
        os.execvpe(cmd[0], cmd, env)
    except FileNotFoundError:
        print(f"gpushare rank-exec: {cmd[0]}: command not found", file=sys.stderr)
        return exitcodes.NOT_FOUND
    except OSError as exc:
        print(f"gpushare rank-exec: {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return exitcodes.CANNOT_EXECUTE


def main() -> None:
    """Console-script entry point: the fast path when it applies, else the Typer application."""
    args = sys.argv[1:]
    if args[:1] == ["slurm"]:
        # Slurm runs the TaskProlog before every task: argparse, no Typer.
        from gpushare.slurm import main as slurm_main

        raise SystemExit(slurm_main(args[1:]))
    if args[:1] == ["rank-exec"] and args[1:2] not in (["-h"], ["--help"]):
        # Before every worker of a gang: no Typer (gpushare.cli.rankexec_cmd).
        raise SystemExit(run_rank_exec(args[1:]))
    if args[:1] == ["status"]:
        opts = _parse_status(args[1:])
        if opts is not None:
            raise SystemExit(run_status(opts))
    from gpushare.cli.app import main as typer_main

    try:
        typer_main(args)
    except BrokenPipeError:
        # Output that went through print() or typer.echo rather than term.emit.
        from gpushare.cli.term import closed_pipe

        raise closed_pipe() from None
