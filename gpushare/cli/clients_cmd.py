"""``gpushare submit|status|list|cancel|pause|resume|events``: thin clients of the daemon's API.

Each command parses its arguments, makes one call (or a few, for ``--watch``/``--follow``),
renders the answer and exits with the status :meth:`gpushare.protocol.ErrorCode.exit_code` gives;
a daemon that cannot be reached is one line and exit 3.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from datetime import datetime, timezone
from typing import Annotated, Any

import typer

from gpushare import protocol
from gpushare.cli import completion
from gpushare.cli.options import (
    MemOpt,
    OfflineOpt,
    OnlineOpt,
    SloP99Opt,
    SloTpotP99Opt,
    SloTtftP99Opt,
)
from gpushare.cli.render import mps_down, render_list, render_status
from gpushare.cli.term import emit, use_colour
from gpushare.client import ApiClient, ApiError, DaemonUnreachableError
from gpushare.model import ClientClass
from gpushare.mpsenv import slo_problem
from gpushare.units import parse_duration, parse_size

SocketOpt = Annotated[
    str | None,
    typer.Option(
        "--socket", help="API socket (default: $GPUSHARE_SOCKET, the config's, /run/gpushare)."
    ),
]


def _connect(socket: str | None) -> ApiClient:
    try:
        return ApiClient.connect(socket)
    except DaemonUnreachableError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(code=exc.exit_code) from None
    except ApiError as exc:
        typer.echo(f"gpushare: {exc.message}", err=True)
        raise typer.Exit(code=exc.code.exit_code()) from None


def _call(api: ApiClient, method: str, params: dict[str, Any] | None = None) -> Any:
    try:
        return api.call(method, params)
    except DaemonUnreachableError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(code=exc.exit_code) from None
    except ApiError as exc:
        typer.echo(f"gpushare: {exc.message}", err=True)
        raise typer.Exit(code=exc.code.exit_code()) from None


def call_once(socket: str | None, method: str, params: dict[str, Any] | None = None) -> Any:
    """Connect, make one call, close."""
    with _connect(socket) as api:
        return _call(api, method, params)


def _bad(message: str) -> typer.Exit:
    typer.echo(f"gpushare: {message}", err=True)
    return typer.Exit(code=2)


def _token_slo_ms(flag: str, text: str, online: bool) -> float:
    """A token SLO (``--slo-ttft-p99 500ms``) in milliseconds; a bad one exits with one line."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        raise _bad(f"{flag}: {exc}") from None
    cls = ClientClass.ONLINE if online else ClientClass.OFFLINE
    if (problem := slo_problem(flag, cls, seconds)) is not None:
        raise _bad(problem)
    return seconds * 1e3


def _signal_number(text: str) -> int:
    if text.isdigit():
        return int(text)
    name = text.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise _bad(f"--checkpoint-signal: unknown signal {text!r} (e.g. USR1, TERM, 10)") from None


# submit's options, one alias each (the signature stays readable).
_CmdOpt = Annotated[list[str], typer.Argument(help="The command and its arguments, after --.")]
_GpuOpt = Annotated[
    str,
    typer.Option(
        "--gpu",
        help="GPU index, UUID or 'any': the fitting GPU with the most free memory, less the "
        "--mem of clients not using it yet; then the one with the fewest clients.",
        autocompletion=completion.gpu_or_any,
    ),
]
_GpusOpt = Annotated[
    str | None,
    typer.Option(
        "--gpus",
        help="A gang over several GPUs (torchrun; with --online a tensor-parallel server): a "
        "count (8) or GPUs (0,1,2,3); each worker runs `gpushare rank-exec -- CMD` to reach its "
        "own GPU (LOCAL_RANK). An --offline gang that does not fit waits in the queue; "
        "--restartable restarts all its ranks at once.",
    ),
]
_SmOpt = Annotated[
    float | None,
    typer.Option("--sm", help="SM percentage (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)."),
]
_NameOpt = Annotated[str | None, typer.Option("--name", help="A name shown in status.")]
_LatencyFromOpt = Annotated[
    str | None,
    typer.Option(
        "--latency-from",
        help="Online: scrape latency from prometheus:http://127.0.0.1:PORT/metrics#HISTOGRAM"
        " (or an LLM server's own TTFT and TPOT histograms from vllm:, sglang: or"
        " tgi:http://127.0.0.1:PORT/metrics; TGI has no TTFT histogram).",
    ),
]
_InflightFromOpt = Annotated[
    str | None,
    typer.Option(
        "--inflight-from",
        help="Online: requests in flight from prometheus:http://127.0.0.1:PORT/metrics#GAUGE "
        "(request gating for services that cannot call gpushare.client.request_started).",
    ),
]
_QueueOpt = Annotated[
    str | None,
    typer.Option(
        "--queue",
        help="Offline: shallow (a freeze bites within [gate] inflight_kernels kernels, or one "
        "with CUDA_LAUNCH_BLOCKING=1: [gate] shallow_queue), "
        "deep, or auto (the default: shallow while request gating is on for its GPU, "
        "switched without a restart where the in-flight library is built).",
        autocompletion=completion.queue_modes,
    ),
]
_RestartableOpt = Annotated[
    bool,
    typer.Option("--restartable", help="Offline job that may be checkpointed and relaunched."),
]
_CheckpointSignalOpt = Annotated[
    str, typer.Option("--checkpoint-signal", help="Signal asking it to checkpoint and exit.")
]
_DetachOpt = Annotated[
    bool, typer.Option("--detach", help="Let the daemon run it; output to a log file.")
]
_SimProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--sim-profile",
        help="Under 'gpushare daemon --simulate': the simulated workload, e.g. resnet50-train.",
    ),
]
_RpsOpt = Annotated[
    float | None, typer.Option("--rps", help="Simulated online request rate (--sim-profile).")
]
_SimBurstOpt = Annotated[
    str | None,
    typer.Option("--sim-burst", help="Simulated burst AT_S:FOR_S:FACTOR (--sim-profile)."),
]
_NoQueueOpt = Annotated[
    bool,
    typer.Option(
        "--no-queue",
        help="Offline: refuse at once (exit 5) when no GPU can hold the job now, "
        "instead of waiting in the queue.",
    ),
]
_TimeLimitOpt = Annotated[
    str | None,
    typer.Option(
        "--time",
        metavar="DURATION",
        help="Offline: how long the job is expected to run, e.g. 2h; the queue starts "
        "shorter jobs first.",
    ),
]
_RestartCostOpt = Annotated[
    str | None,
    typer.Option(
        "--restart-cost",
        metavar="DURATION",
        help="Offline: what a restart costs the job (start-up and lost work), e.g. 90s; "
        "gpushare restarts it for a new share only when that pays ([control] restart_cost).",
    ),
]


def submit(
    cmd: _CmdOpt,
    online: OnlineOpt = False,
    offline: OfflineOpt = False,
    gpu: _GpuOpt = "any",
    gpus: _GpusOpt = None,
    sm: _SmOpt = None,
    mem: MemOpt = None,
    slo_p99: SloP99Opt = None,
    slo_ttft_p99: SloTtftP99Opt = None,
    slo_tpot_p99: SloTpotP99Opt = None,
    name: _NameOpt = None,
    latency_from: _LatencyFromOpt = None,
    inflight_from: _InflightFromOpt = None,
    queue: _QueueOpt = None,
    restartable: _RestartableOpt = False,
    checkpoint_signal: _CheckpointSignalOpt = "USR1",
    detach: _DetachOpt = False,
    sim_profile: _SimProfileOpt = None,
    rps: _RpsOpt = None,
    sim_burst: _SimBurstOpt = None,
    no_queue: _NoQueueOpt = False,
    time_limit: _TimeLimitOpt = None,
    restart_cost: _RestartCostOpt = None,
    socket: SocketOpt = None,
) -> None:
    """Run a command as an MPS client with gpushare's limits (foreground unless --detach).

    An --offline job that no GPU can hold now waits in the queue (--detach: it returns at once,
    queued, with its place; in the foreground, it waits and says so); an --online one is refused
    at once with exit 5.
    """
    _check_flags(online, offline, cmd, queue, no_queue, time_limit, inflight_from)
    params: dict[str, Any] = {
        "cls": "online" if online else "offline",
        "argv": list(cmd),
        "gpu": gpu,
        "sm_pct": sm,
        "name": name,
        "latency_from": latency_from,
        "restartable": restartable,
        "checkpoint_signal": _signal_number(checkpoint_signal),
        "detach": detach or restartable,
        "cwd": os.getcwd(),
    }
    # Sent only when given, so a daemon without these features still takes other submits.
    for key, value in (("inflight_from", inflight_from), ("queue", queue), ("gpus", gpus)):
        if value is not None:
            params[key] = value
    if no_queue:
        params["no_queue"] = True
    _add_amounts(params, online, offline, mem, slo_p99, slo_ttft_p99, slo_tpot_p99, time_limit,
                 restart_cost)  # fmt: skip
    _add_launch(params, sim_profile, rps, sim_burst)
    result = call_once(socket, protocol.SUBMIT, params)
    if result["state"] == "queued":
        from gpushare.cli.waitq import queued_line, wait_in_queue

        if params["detach"]:
            typer.echo(queued_line(result))
            return
        result = wait_in_queue(socket, result)
    if params["detach"]:
        typer.echo(
            f"{result['client_id']} started on {result['gpu_uuid']} (pid {result['pid']}); "
            f"output in {result['log_path']}"
        )
        return
    _exec_in_place(cmd, result)


def _check_flags(
    online: bool,
    offline: bool,
    cmd: list[str],
    queue: str | None,
    no_queue: bool,
    time_limit: str | None,
    inflight_from: str | None,
) -> None:
    """Refuse a submit whose flags do not go together (one line, exit 2)."""
    if online == offline:
        raise _bad("give exactly one of --online or --offline")
    if not cmd:
        raise _bad("no command: gpushare submit --offline -- CMD ARGS...")
    if queue is not None and queue not in protocol.QUEUE_MODES:
        raise _bad(f"--queue must be one of {', '.join(protocol.QUEUE_MODES)}, got {queue!r}")
    if queue is not None and not offline:
        raise _bad("--queue applies to --offline jobs (online clients are never frozen)")
    if (no_queue or time_limit is not None) and not offline:
        raise _bad("--no-queue and --time apply to --offline jobs (online clients never queue)")
    if inflight_from is not None and not online:
        raise _bad("--inflight-from applies to --online clients (their requests gate offline work)")


def _add_amounts(
    params: dict[str, Any],
    online: bool,
    offline: bool,
    mem: str | None,
    slo_p99: str | None,
    slo_ttft_p99: str | None,
    slo_tpot_p99: str | None,
    time_limit: str | None,
    restart_cost: str | None,
) -> None:
    """The sizes and durations of a submit, parsed and checked, into ``params``."""
    try:
        if time_limit is not None:
            params["expected_s"] = parse_duration(time_limit)
        if restart_cost is not None:  # issue 32
            params["restart_cost_s"] = parse_duration(restart_cost)
        params["mem_bytes"] = parse_size(mem) if mem is not None else None
        params["slo_p99_ms"] = parse_duration(slo_p99) * 1e3 if slo_p99 is not None else None
    except ValueError as exc:
        raise _bad(str(exc)) from None
    # Sent only when given, so a daemon without token SLOs still takes other submits.
    for key, flag, text in (("slo_ttft_p99_ms", "--slo-ttft-p99", slo_ttft_p99),
                            ("slo_tpot_p99_ms", "--slo-tpot-p99", slo_tpot_p99)):  # fmt: skip
        if text is not None:
            params[key] = _token_slo_ms(flag, text, online)
    if not 0 < params.get("expected_s", 1.0) < 1e9:
        raise _bad("--time must be a positive duration, e.g. 90m or 2h")
    if restart_cost is not None and not offline:
        raise _bad("--restart-cost applies to --offline jobs (online clients are never restarted)")
    if not 0 <= params.get("restart_cost_s", 0.0) <= protocol.MAX_RESTART_COST_S:
        raise _bad("--restart-cost must be a duration from 0s to 168h, e.g. 90s")


def _add_launch(
    params: dict[str, Any], sim_profile: str | None, rps: float | None, sim_burst: str | None
) -> None:
    """How the workload starts: the environment of a detached one, the pid of this process."""
    if (rps is not None or sim_burst is not None) and sim_profile is None:
        raise _bad("--rps and --sim-burst describe a simulated workload: give --sim-profile too")
    if rps is not None:
        from gpushare.sim.simenv import rate_problem as sim_rate_problem

        if (rate_error := sim_rate_problem(rps, None)) is not None:
            raise _bad(rate_error)  # the daemon refuses it too (SimWorkload.validate)
    if params["detach"]:
        params["env"] = dict(os.environ)
        if sim_profile is not None:
            from gpushare.sim.simenv import workload_env as sim_workload_env

            params["env"].update(sim_workload_env(sim_profile, rps, sim_burst))
    elif sim_profile is not None:
        raise _bad("--sim-profile needs --detach (or GPUSHARE_SIM_PROFILE in the environment)")
    else:
        params["pid"] = os.getpid()


def _exec_in_place(cmd: list[str], result: dict[str, Any]) -> None:
    """Become the workload with the environment the daemon gave (a foreground submit)."""
    env = {k: v for k, v in os.environ.items() if k not in set(result.get("unset_env", []))}
    env.update(result["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(cmd[0], list(cmd), env)
    except OSError as exc:
        typer.echo(f"gpushare: cannot run {cmd[0]!r}: {exc.strerror or exc}", err=True)
        raise typer.Exit(code=127 if isinstance(exc, FileNotFoundError) else 126) from None


OutputOpt = Annotated[
    str | None,
    typer.Option(
        "--output",
        "-o",
        metavar="FORMAT",
        help="wide: every column, ids and UUIDs whole; json: as --json.",
    ),
]


def _output(output: str | None, as_json: bool) -> tuple[bool, bool]:
    """(wide, json) from ``-o`` and ``--json``."""
    if output not in (None, "wide", "json"):
        raise _bad(f"-o/--output must be wide or json, got {output!r}")
    return output == "wide", as_json or output == "json"


def status(
    as_json: Annotated[bool, typer.Option("--json", help="JSON (docs/status-schema.md).")] = False,
    output: OutputOpt = None,
    watch: Annotated[
        float | None,
        typer.Option(
            "--watch",
            help="Refresh every this many seconds: redrawn in place on a terminal; plain "
            "snapshots (one JSON document per line with --json) when piped.",
        ),
    ] = None,
    gpu: Annotated[
        str | None,
        typer.Option(
            "--gpu", help="Only this GPU (index or UUID).", autocompletion=completion.gpus
        ),
    ] = None,
    socket: SocketOpt = None,
) -> None:
    """Show GPUs and clients; exit 1 when a shared GPU's MPS is down."""
    wide, as_json = _output(output, as_json)
    params = {"gpu": gpu} if gpu is not None else {}
    colour = use_colour()
    with _connect(socket) as api:
        if watch is not None:
            # Ctrl-C or a closed pipe is the usual way out of --watch, not a failure.
            with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
                _watch(api, params, max(0.1, watch), as_json, wide=wide, colour=colour)
            return
        result = _call(api, protocol.STATUS, params)
        emit(
            json.dumps(result, indent=2)
            if as_json
            else render_status(result, wide=wide, colour=colour)
        )
    if mps_down(result):
        raise typer.Exit(code=1)


def _watch(
    api: ApiClient, params: dict[str, Any], every_s: float, as_json: bool, *, wide: bool,
    colour: bool,
) -> None:  # fmt: skip
    tty = sys.stdout.isatty()
    while True:
        result = _call(api, protocol.STATUS, params)
        text = "" if as_json else render_status(result, wide=wide, colour=colour)
        if as_json:
            # One document per line while watching: a script reads a stream of snapshots.
            emit(json.dumps(result, separators=(",", ":")))
        elif tty:
            emit("\x1b[H\x1b[2J" + text)  # redraw in place
        else:
            stamp = datetime.now(timezone.utc).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
            emit(f"--- {stamp}\n{text}\n")
        time.sleep(every_s)


def _matches(c: dict[str, Any], user: str | None, states: set[str], cls: str | None,
             gpu: str | None) -> bool:  # fmt: skip
    if user is not None and user not in (c["user"], str(c["uid"])):
        return False
    if states and c["state"] not in states:
        return False
    if cls is not None and c["class"] != cls:
        return False
    if gpu is not None:
        uuid = c.get("gpu_uuid") or ""
        on = c.get("gpus") or [{"uuid": uuid, "index": c["gpu_index"]}]  # a gang: any of its GPUs
        return any(
            gpu == str(g["index"]) or (len(gpu) > 4 and (g["uuid"] or "").startswith(gpu))
            for g in on
        )
    return True


def list_clients(
    all_: Annotated[bool, typer.Option("--all", "-a", help="Include ended clients.")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="JSON (docs/status-schema.md, list).")
    ] = False,
    output: OutputOpt = None,
    user: Annotated[str | None, typer.Option("--user", "-u", help="Only this user's.")] = None,
    state: Annotated[
        str | None,
        typer.Option("--state", "-t", help="Only these states, e.g. queued,running."),
    ] = None,
    cls: Annotated[
        str | None, typer.Option("--class", metavar="CLASS", help="online or offline.")
    ] = None,
    gpu: Annotated[
        str | None, typer.Option("--gpu", help="Only this GPU (index or UUID prefix).")
    ] = None,
    socket: SocketOpt = None,
) -> None:
    """List clients (live and queued; --all for every one)."""
    wide, as_json = _output(output, as_json)
    if cls not in (None, "online", "offline"):
        raise _bad(f"--class must be online or offline, got {cls!r}")
    states = {x.strip() for x in (state or "").split(",") if x.strip()}
    known = {"queued", "starting", "running", "throttled", "frozen", "restarting", "exited",
             "failed", "lost"}  # fmt: skip
    if states - known:
        raise _bad(
            f"--state: unknown {', '.join(sorted(states - known))}; one of {', '.join(sorted(known))}"
        )
    # Ended clients are asked for when a filter names an ended state, as squeue -t does.
    ended = bool(states & {"exited", "failed", "lost"})
    result = call_once(socket, protocol.LIST, {"all": all_ or ended})
    clients = [c for c in result["clients"] if _matches(c, user, states, cls, gpu)]
    if as_json:
        emit(
            json.dumps(
                {"schema_version": protocol.LIST_SCHEMA_VERSION, "clients": clients}, indent=2
            )
        )
    else:
        width = shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else 100
        emit(render_list(clients, wide=wide, colour=use_colour(), width=width))


def cancel(
    client_id: Annotated[
        str, typer.Argument(help="Client id, e.g. c3.", autocompletion=completion.client_ids)
    ],
    socket: SocketOpt = None,
) -> None:
    """Stop a client: SIGTERM now, SIGKILL after daemon.cancel_grace."""
    r = call_once(socket, protocol.CANCEL, {"client_id": client_id})
    if r["grace_s"]:
        typer.echo(f"{r['client_id']}: SIGTERM sent; SIGKILL in {r['grace_s']:g}s if it stays")
    else:
        typer.echo(f"{r['client_id']}: cancelled")


def pause(
    client_id: Annotated[
        str, typer.Argument(help="Client id.", autocompletion=completion.client_ids)
    ],
    socket: SocketOpt = None,
) -> None:
    """Hold a client frozen until `gpushare resume` (its owner, root or an admin)."""
    r = call_once(socket, protocol.PAUSE, {"client_id": client_id})
    typer.echo(f"{r['client_id']}: {r['state']}")


def resume(
    client_id: Annotated[
        str, typer.Argument(help="Client id.", autocompletion=completion.client_ids)
    ],
    socket: SocketOpt = None,
) -> None:
    """Release a pause."""
    r = call_once(socket, protocol.RESUME, {"client_id": client_id})
    typer.echo(f"{r['client_id']}: {r['state']}")


def _event_line(e: dict[str, Any]) -> str:
    at = datetime.fromtimestamp(e["at"], tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    who = e["client_id"] or (e["gpu_uuid"] or "-")
    return f"{at[:-4]}Z {e['severity']:<7} {e['kind']:<22} {who:<10} {e['message']}"


def events(
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new events.")
    ] = False,
    since: Annotated[int, typer.Option("--since", help="Only events after this id.")] = 0,
    limit: Annotated[int, typer.Option("--limit", help="At most this many per page.")] = 1000,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    socket: SocketOpt = None,
) -> None:
    """Print the daemon's event log (client transitions, MPS events, alerts)."""
    with _connect(socket) as api:
        last = since
        while True:
            page = _call(api, protocol.EVENTS, {"since_id": last, "limit": limit})
            for e in page["events"]:
                emit(
                    json.dumps({"schema_version": protocol.EVENTS_SCHEMA_VERSION, **e})
                    if as_json
                    else _event_line(e)
                )
            last = page["last_id"]
            if len(page["events"]) == limit:
                continue
            if not follow:
                return
            try:
                time.sleep(0.5)
            except KeyboardInterrupt:
                return


def register(app: typer.Typer) -> None:
    """Add these commands to the root application."""
    app.command("submit", context_settings={"allow_interspersed_args": False})(submit)
    app.command("status")(status)
    app.command("list")(list_clients)
    app.command("cancel")(cancel)
    app.command("pause")(pause)
    app.command("resume")(resume)
    app.command("events")(events)
