"""``gpushare k8s device-plugin``: the kubelet device plugin that runs beside the daemon.

gRPC and the plugin are imported inside the command: registering it costs the CLI's start-up
nothing, and a host without the ``kubernetes`` extra (grpcio, protobuf) is told what to install.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    help="Kubernetes: the kubelet device plugin (docs/kubernetes.md).",
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


# An extended resource's domain: lower-case DNS labels joined by dots.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)+")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"gpushare k8s device-plugin: {message}", err=True)
    return typer.Exit(code=2)


@app.command("device-plugin")
def device_plugin(
    kubelet_dir: Annotated[
        Path,
        typer.Option("--kubelet-dir", help="The kubelet's device-plugin directory."),
    ] = Path("/var/lib/kubelet/device-plugins"),
    prefix: Annotated[
        str, typer.Option("--resource-prefix", help="Resources <prefix>/online, <prefix>/offline.")
    ] = "gpushare.io",
    online_replicas: Annotated[
        int, typer.Option("--online-replicas", help="Online pods per GPU.", min=1, max=1000)
    ] = 4,
    offline_replicas: Annotated[
        int,
        typer.Option(
            "--offline-replicas",
            help="Units of <prefix>/offline per GPU; one unit is 100/N % of its SMs.",
            min=1,
            max=100,
        ),
    ] = 10,
    online_slo: Annotated[
        str | None,
        typer.Option("--online-slo-p99", help="The SLO online pods declare, e.g. 40ms."),
    ] = None,
    cdi_kind: Annotated[
        str,
        typer.Option(
            "--cdi-kind", help="CDI device kind for the GPU (<kind>=<UUID>); '' for none."
        ),
    ] = "nvidia.com/gpu",
    device_nodes: Annotated[
        bool,
        typer.Option("--device-nodes", help="Also pass /dev/nvidia<i>, nvidiactl, nvidia-uvm."),
    ] = False,
    poll: Annotated[
        str, typer.Option("--poll", help="How often the daemon's GPU health is read.")
    ] = "5s",
    config_path: Annotated[
        Path | None,
        typer.Option("--config", help="Config file (default: $GPUSHARE_CONFIG or /etc/gpushare)."),
    ] = None,
    socket: Annotated[
        str | None,
        typer.Option("--socket", help="The daemon's API socket (default: the config's)."),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning.")] = "info",
) -> None:
    """Serve gpushare.io/online and gpushare.io/offline to the kubelet (runs until SIGTERM)."""
    from gpushare import config
    from gpushare.model import ClientClass
    from gpushare.mpsenv import check_limits
    from gpushare.roots.envresolve import daemon_socket, load_config
    from gpushare.units import parse_duration

    try:
        slo_s = parse_duration(online_slo) if online_slo is not None else None
        poll_s = parse_duration(poll)
        if slo_s is not None:
            check_limits(ClientClass.ONLINE, None, None, slo_s)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if not _DNS_SUBDOMAIN.fullmatch(prefix) or len(prefix) > 253:
        raise _fail(f"--resource-prefix must be a DNS name such as gpushare.io, got {prefix!r}")
    if not 0.1 <= poll_s <= 300:
        raise _fail(f"--poll must be within 100ms and 5m, got {poll}")
    if not kubelet_dir.is_dir():
        raise _fail(f"{kubelet_dir} is not a directory (mount the kubelet's device-plugins dir)")
    try:
        cfg = load_config(config_path)
    except config.ConfigError as exc:
        raise _fail(f"{exc}; fix the file or pass --config") from None
    try:
        from gpushare.k8s.devices import PluginSettings
        from gpushare.k8s.run import serve
    except ImportError as exc:
        raise _fail(f"{exc}: install gpushare[kubernetes] (grpcio, protobuf)") from None
    from gpushare.logs import configure_logging

    configure_logging(log_level)
    settings = PluginSettings(
        resource_prefix=prefix, online_replicas=online_replicas,
        offline_replicas=offline_replicas, online_slo_p99_s=slo_s, cdi_kind=cdi_kind or None,
        device_nodes=device_nodes,
    )  # fmt: skip
    serve(cfg, settings, daemon_socket(cfg, socket), kubelet_dir, poll_s)


def register(root: typer.Typer) -> None:
    """Add ``gpushare k8s`` to the root application."""
    root.add_typer(app, name="k8s")
