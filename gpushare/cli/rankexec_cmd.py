"""``gpushare rank-exec -- CMD``: one rank of a gang reaches its own GPU (docs/design.md §7, D2).

``torchrun --no-python`` runs it once per worker with ``LOCAL_RANK`` set: it takes the gang's GPU
of that number from ``GPUSHARE_GANG`` (set by ``gpushare submit --gpus``), puts that GPU's MPS
variables in the environment (pipe directory, ``GPUSHARE_GPU_UUID``, SM share, priority, pinned
memory limit), sets ``LOCAL_RANK=0`` (the one GPU its MPS server shows is device 0; the original
is kept in ``GPUSHARE_LOCAL_RANK``) and execs ``CMD``. ``RANK``, ``WORLD_SIZE`` and the
rendezvous are left alone. It runs before every worker, so :func:`run` needs neither Typer nor the
daemon: :mod:`gpushare.cli.fast` calls it directly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated

from gpushare import mpsenv
from gpushare.cli import exitcodes

if TYPE_CHECKING:
    import typer

USAGE = "usage: gpushare rank-exec -- CMD [ARGS...]  (a worker of `torchrun --no-python`)"


def run(args: Sequence[str]) -> int:
    """Exec ``args`` (after an optional ``--``) as its rank; the exit status when it cannot."""
    cmd = list(args[1:] if args[:1] == ["--"] else args)
    if not cmd or cmd[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not cmd else sys.stdout)
        return exitcodes.BAD_INPUT if not cmd else 0
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


def register(app: typer.Typer) -> None:
    """Add ``rank-exec`` to the root application (for ``--help``; the fast path runs it)."""
    import typer

    def rank_exec(
        cmd: Annotated[list[str], typer.Argument(help="The worker's command, after --.")],
    ) -> None:
        """Exec one rank of a gang (torchrun --no-python) on its own GPU, by LOCAL_RANK."""
        raise typer.Exit(code=run(cmd))

    app.command("rank-exec")(rank_exec)
