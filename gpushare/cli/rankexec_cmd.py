"""``gpushare rank-exec -- CMD``: one rank of a gang reaches its own GPU (docs/design.md §7, D2).

``torchrun --no-python`` runs it once per worker with ``LOCAL_RANK`` set: it takes the gang's GPU
of that number from ``GPUSHARE_GANG`` (set by ``gpushare submit --gpus``), puts that GPU's MPS
variables in the environment (pipe directory, ``GPUSHARE_GPU_UUID``, SM share, priority, pinned
memory limit), sets ``LOCAL_RANK=0`` (the one GPU its MPS server shows is device 0; the original
is kept in ``GPUSHARE_LOCAL_RANK``) and execs ``CMD``. ``RANK``, ``WORLD_SIZE`` and the
rendezvous are left alone. It runs before every worker, so the command itself
(:func:`gpushare.cli.fast.run_rank_exec`) needs neither Typer nor the daemon; this module gives it
its ``--help``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from gpushare.cli.fast import run_rank_exec


def register(app: typer.Typer) -> None:
    """Add ``rank-exec`` to the root application (for ``--help``; the fast path runs it)."""

    def rank_exec(
        cmd: Annotated[list[str], typer.Argument(help="The worker's command, after --.")],
    ) -> None:
        """Exec one rank of a gang (torchrun --no-python) on its own GPU, by LOCAL_RANK."""
        raise typer.Exit(code=run_rank_exec(cmd))

    app.command("rank-exec")(rank_exec)
