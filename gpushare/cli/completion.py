"""Shell completion for bash, zsh and fish: ``gpushare completion SHELL`` prints the script.

The script calls ``gpushare`` back with ``_GPUSHARE_COMPLETE`` set (Typer's completion protocol);
commands, options and shipped scenario names complete offline, client ids and GPUs come from the
daemon when it answers within :data:`DAEMON_TIMEOUT_S` (a daemon that is down completes nothing,
quickly, and never prints an error into the shell). ``gpushare status`` is unaffected: its fast
path (:mod:`gpushare.cli.fast`) never imports this module.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer
import typer.completion

from gpushare import protocol

COMPLETE_VAR = "_GPUSHARE_COMPLETE"
SHELLS = ("bash", "zsh", "fish")
#: How long a completion waits for the daemon: a TAB must never hang the shell.
DAEMON_TIMEOUT_S = 0.5

HELP = """Print the completion script for SHELL (bash, zsh or fish).

\b
bash:  gpushare completion bash > /etc/bash_completion.d/gpushare
       (or: source <(gpushare completion bash) in ~/.bashrc)
zsh:   gpushare completion zsh > "${fpath[1]}/_gpushare"
fish:  gpushare completion fish > ~/.config/fish/completions/gpushare.fish
"""


def init_if_completing() -> None:
    """Register Typer's completion classes when the shell is asking for completions."""
    if os.environ.get(COMPLETE_VAR):
        # Typer re-exports these in typer.completion without declaring them (its own
        # --install-completion uses them); tests/cli/test_completion.py fails if an upgrade drops them.
        typer.completion.completion_init()  # type: ignore[attr-defined]


def _ask(ctx: typer.Context, method: str, params: dict[str, Any]) -> Any:
    from gpushare.client import ApiClient, ApiError, DaemonUnreachableError

    socket = ctx.params.get("socket")
    try:
        with ApiClient.connect(socket, timeout_s=DAEMON_TIMEOUT_S, name="completion") as api:
            return api.call(method, params)
    except (ApiError, DaemonUnreachableError, OSError, ValueError):
        return None


def client_ids(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """Live and queued client ids (with name, class and state as help)."""
    answer = _ask(ctx, protocol.LIST, {"all": False})
    if not isinstance(answer, dict):
        return []
    out = []
    for c in answer.get("clients", []):
        cid = str(c.get("id", ""))
        if cid.startswith(incomplete):
            about = f"{c.get('name') or ''} {c.get('class', '')} {c.get('state', '')}".strip()
            out.append((cid, about))
    return out


def gpus(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """GPU indexes and UUIDs the daemon reports."""
    answer = _ask(ctx, protocol.STATUS, {})
    if not isinstance(answer, dict):
        return []
    out = []
    for g in answer.get("gpus", []):
        name = str(g.get("name", ""))
        for key in (str(g.get("index", "")), str(g.get("uuid", ""))):
            if key and key.startswith(incomplete):
                out.append((key, name))
    return out


def gpu_or_any(ctx: typer.Context, incomplete: str) -> list[tuple[str, str]]:
    """``any`` and the daemon's GPUs (``submit --gpu``)."""
    head = [("any", "the GPU admission picks")] if "any".startswith(incomplete) else []
    return head + gpus(ctx, incomplete)


def queue_modes(incomplete: str) -> list[tuple[str, str]]:
    """``submit --queue`` values."""
    helps = {
        "shallow": "a freeze bites within a kernel or a few ([gate] shallow_queue)",
        "deep": "as CUDA launches",
        "auto": "shallow while request gating is on for its GPU",
    }
    helps[protocol.DEFAULT_QUEUE_MODE] += " (the default)"
    return [(m, helps[m]) for m in protocol.QUEUE_MODES if m.startswith(incomplete)]


def scenarios(incomplete: str) -> list[str]:
    """Shipped scenario names (file paths complete through the shell's own fallback)."""
    from gpushare.sim import scenario

    return [name for name in scenario.shipped() if name.startswith(incomplete)]


def policies(incomplete: str) -> list[str]:
    """Policy names of the registry."""
    from gpushare.control.registry import POLICY_NAMES

    return [name for name in POLICY_NAMES if name.startswith(incomplete)]


def completion(
    shell: Annotated[
        str,
        typer.Argument(help="bash, zsh or fish.", autocompletion=lambda: list(SHELLS)),
    ],
) -> None:
    """Print the completion script for SHELL (bash, zsh or fish)."""
    if shell not in SHELLS:
        typer.echo(
            f"gpushare: unknown shell {shell!r}; choose one of {', '.join(SHELLS)}", err=True
        )
        raise typer.Exit(code=2)
    script = typer.completion.get_completion_script(  # type: ignore[attr-defined]
        prog_name="gpushare", complete_var=COMPLETE_VAR, shell=shell
    )
    typer.echo(script.strip())


def register(app: typer.Typer) -> None:
    """Add ``gpushare completion`` to the application."""
    app.command("completion", help=HELP)(completion)
