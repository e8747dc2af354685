"""The Typer application and the entry point of the ``gpushare`` console script.

Each command group lives in its own module under :mod:`gpushare.cli`, with a ``register(app)``
function. Modules are imported only when their command runs (:class:`LazyGroup`): importing all of
them costs about 0.3 s (``doctor`` and ``sim`` pull in the daemon and the simulator), which every
command paid before. A module added with an eager ``module.register(app)`` below still works; an
entry in :data:`COMMANDS` keeps it lazy. Exit codes: :data:`EXIT_CODES`.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any

import typer
import typer.core
import typer.main
from typer._click.decorators import help_option
from typer._click.exceptions import ClickException, UsageError

from gpushare import __version__
from gpushare.cli import exitcodes, params
from gpushare.cli.exitcodes import EXIT_CODES, epilog

#: Command name -> (module with ``register(app)``, one-line summary shown by ``gpushare --help``).
#: The summary is the command's docstring's first line (tests/cli/test_cli_startup.py checks it),
#: kept here so that ``--help`` imports no command module.
COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("gpushare.cli.clients_cmd", "Run a command as an MPS client with gpushare's limits (foreground unless --detach)."),
    "status": ("gpushare.cli.clients_cmd", "Show GPUs and clients; exit 1 when a shared GPU's MPS is down."),
    "list": ("gpushare.cli.clients_cmd", "List clients (live and queued; --all for every one)."),
    "cancel": ("gpushare.cli.clients_cmd", "Stop a client: SIGTERM now, SIGKILL after daemon.cancel_grace."),
    "pause": ("gpushare.cli.clients_cmd", "Hold a client frozen until `gpushare resume` (its owner, root or an admin)."),
    "resume": ("gpushare.cli.clients_cmd", "Release a pause."),
    "events": ("gpushare.cli.clients_cmd", "Print the daemon's event log (client transitions, MPS events, alerts)."),
    "daemon": ("gpushare.cli.daemon_cmd", "Run the gpushare daemon in the foreground (systemd Type=notify)."),
    "doctor": ("gpushare.cli.doctor_cmd", "Check that this host has what gpushare needs: driver, MPS, cgroups, directories, systemd."),
    "env": ("gpushare.cli.env_cmd", "Print the environment to start a workload with so that MPS applies gpushare's limits."),
    "install": ("gpushare.cli.install_cmd", "Install gpushare as a systemd service: config, unit, /usr/bin link, admin group; start it."),
    "uninstall": ("gpushare.cli.install_cmd", "Stop and remove the gpushare service; running workloads are left alone."),
    "sim": ("gpushare.cli.sim_cmd", "Run sharing policies on simulated GPUs in virtual time and compare what they do."),
    "completion": ("gpushare.cli.completion", "Print the completion script for SHELL (bash, zsh or fish)."),
    "config": ("gpushare.cli.config_cmd", "Inspect and validate the configuration."),
    "drain": ("gpushare.cli.drain_cmd", "Admit nothing new on a GPU; running clients finish or checkpoint (root or the admin group)."),
    "k8s": ("gpushare.cli.k8s_cmd", "Kubernetes: the kubelet device plugin (docs/kubernetes.md)."),
    "rank-exec": ("gpushare.cli.rankexec_cmd", "Exec one rank of a gang (torchrun --no-python) on its own GPU, by LOCAL_RANK."),
    "undrain": ("gpushare.cli.drain_cmd", "End a drain: the GPU admits work again (root or the admin group)."),
}  # fmt: skip

#: ``-h`` as well as ``--help``, on every command (click passes it down to sub-contexts).
CONTEXT = {"help_option_names": ["-h", "--help"]}


def new_app(**kwargs: Any) -> typer.Typer:
    """A Typer application with gpushare's settings: plain help (no type placeholders, no rich)."""
    # Rich help costs ~0.1 s of imports, reads "[gate]" in a help text as markup and shows type
    # placeholders; click's plain help is what operators know from git and kubectl.
    return typer.Typer(
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
        add_completion=False,
        context_settings=CONTEXT,
        **kwargs,
    )


class PlainArgument(typer.core.TyperArgument):
    """An argument shown as ``CMD...`` (usage) and ``CMD...`` (help): no ``{CMD}``, no ``<str>``."""

    def _usage_display_name(self) -> str:
        name = self.display_name_raw
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")

    def display_type_rich(self, ctx: Any) -> str | None:
        return None


def tidy_metavars(command: Any) -> None:
    """Give every value option a metavar named after it (``--mem MEM``), never ``<str>``.

    Also converts each value without Pydantic, numbers bounded (:mod:`gpushare.cli.params`).
    """
    if getattr(command, "_help_option", False) is None and command.add_help_option:
        # Made here as click would make it on first use, so that its conversion is ours too.
        help_option(CONTEXT["help_option_names"])(command)
        command._help_option = command.params.pop()
        params.install(command._help_option)
    for param in getattr(command, "params", ()):
        params.install(param)
        if isinstance(param, typer.core.TyperArgument):
            param.__class__ = PlainArgument
        if param.metavar is None and not getattr(param, "is_flag", False):
            param.metavar = (param.name or "value").upper()
    for sub in getattr(command, "commands", {}).values():
        tidy_metavars(sub)


class LazyGroup(typer.core.TyperGroup):
    """The root group: imports a command's module the first time that command is asked for."""

    def list_commands(self, ctx: Any) -> list[str]:
        """Eagerly registered commands, then the lazy ones in :data:`COMMANDS` order."""
        return [*COMMANDS, *(n for n in self.commands if n not in COMMANDS)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        """The command, building it from its module on first use."""
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module = importlib.import_module(COMMANDS[cmd_name][0])
            sub = new_app()
            module.register(sub)
            group = typer.main.get_group(sub)
            for name, command in group.commands.items():
                tidy_metavars(command)
                self.commands.setdefault(name, command)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        """The command list of ``--help`` from :data:`COMMANDS`: no module is imported."""
        rows = [
            (name, self.commands[name].get_short_help_str(limit=formatter.width))
            if name in self.commands
            else (name, COMMANDS[name][1])
            for name in self.list_commands(ctx)
        ]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


app = new_app(
    name="gpushare",
    help="Share NVIDIA GPUs between latency-critical online services and offline jobs.",
    epilog=epilog(),
    no_args_is_help=True,
    cls=LazyGroup,
)


@app.command("slurm", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def _slurm(ctx: typer.Context) -> None:
    """Slurm's Prolog, TaskProlog and Epilog: gpushare slurm prolog|task-prolog|epilog."""
    from gpushare.slurm import main as slurm_main

    raise typer.Exit(slurm_main(ctx.args))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"gpushare {__version__}")
        raise typer.Exit


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Share NVIDIA GPUs between latency-critical online services and offline jobs."""


def main(args: Sequence[str] | None = None) -> None:
    """Console-script entry point (after :mod:`gpushare.cli.fast`'s fast paths)."""
    if os.environ.get("_GPUSHARE_COMPLETE"):
        from gpushare.cli import completion

        completion.init_if_completing()
    command = typer.main.get_command(app)
    tidy_metavars(command)
    try:
        code = command.main(args=args, prog_name="gpushare", standalone_mode=False)
    except typer.Abort:
        code = exitcodes.INTERRUPTED
    except ClickException as exc:
        # One line, not click's usage block: what was wrong and where the help is.
        where = exc.ctx.command_path if isinstance(exc, UsageError) and exc.ctx else "gpushare"
        hint = f" (see '{where} -h')" if isinstance(exc, UsageError) else ""
        sys.stderr.write(f"{where}: {exc.format_message()}{hint}\n")
        code = exc.exit_code
    raise SystemExit(code if isinstance(code, int) else 0)


__all__ = ["COMMANDS", "EXIT_CODES", "LazyGroup", "app", "main", "new_app"]
