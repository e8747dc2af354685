"""Command-line options that several commands share, declared once (``submit`` and ``env``)."""

from __future__ import annotations

from typing import Annotated

import typer

OnlineOpt = Annotated[bool, typer.Option("--online", help="Latency-critical service.")]
OfflineOpt = Annotated[bool, typer.Option("--offline", help="Best-effort job.")]
MemOpt = Annotated[str | None, typer.Option("--mem", help="Pinned GPU memory limit, e.g. 8G.")]
SloP99Opt = Annotated[
    str | None, typer.Option("--slo-p99", help="Online p99 latency SLO, e.g. 40ms.")
]
SloTtftP99Opt = Annotated[
    str | None,
    typer.Option("--slo-ttft-p99", help="Online LLM server: p99 time to first token, e.g. 500ms."),
]
SloTpotP99Opt = Annotated[
    str | None,
    typer.Option("--slo-tpot-p99", help="Online LLM server: p99 time per output token, e.g. 50ms."),
]
