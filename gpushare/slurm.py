"""Slurm: the Prolog, TaskProlog and Epilog that make a job's tasks gpushare clients.

A job declares its class in its comment (``docs/slurm.md``)::

    sbatch --comment gpushare=offline job.sh
    srun --comment gpushare=online,slo-p99=40ms,sm=60,mem=20G serve.sh

The one word of the comment that starts with ``gpushare=`` is gpushare's; the rest of the comment
is left to the site. A job that asks for Slurm's own MPS sharing (``--gres=mps:N``) is a gpushare
client too, without a comment (:func:`job_class`): Slurm gives its Prolog the share it allotted
(``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, N out of the GPU's ``mps`` count), which becomes an offline
job's SM share; its class is online when its partition or QOS is one the site named
(``gpushare slurm prolog --online-partitions serve --online-qos interactive``), else offline.
Slurm 22.05 gives the Prolog the partition but not the QOS: when the class depends on it, the
Prolog asks ``squeue`` for that one job's QOS (:func:`squeue_qos`), and says so when it cannot.
The three scripts, run by Slurm (``deploy/slurm/``):

- **Prolog** (slurmd, root, once per job and node, before its first task): validates the
  declaration, writes it to ``<runtime_dir>/slurm/job-<id>.json`` for the TaskProlog, and
  registers the job with the daemon (an ``adopt`` request: the job owner's processes whose
  environment has ``SLURM_JOB_ID=<id>`` and the class marker the TaskProlog exports). It never fails: a failing Prolog drains the node, and
  a user's typo must not do that. A bad declaration is recorded and fails the job's tasks instead.
- **TaskProlog** (slurmstepd, as the job's user, before each task): prints the ``export`` and
  ``unset`` lines Slurm applies to the task (``gpushare env --format slurm``: MPS limits, the pipe
  directory of the task's GPU, the class marker). For a bad declaration it prints the reason to the
  job's output and exits 1, which fails the task before it runs.
- **Epilog** (slurmd, root, after the job): ``release`` the registration, remove the job file.

Run as ``gpushare slurm prolog|task-prolog|epilog`` (answered without Typer, see
:mod:`gpushare.cli.fast`: a TaskProlog runs before every task).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from gpushare import config, mpsenv, protocol
from gpushare.model import ClientClass
from gpushare.roots import envresolve
from gpushare.units import parse_duration, parse_size

COMMENT_KEY = "gpushare"
SOURCE = "slurm"
JOB_DIR = "slurm"
REQUEST_TIMEOUT_S = 5.0
_OPTIONS = {"slo-p99", "sm", "mem"}
_EXAMPLE = "--comment gpushare=offline (or gpushare=online,slo-p99=40ms,sm=60,mem=20G)"


@dataclass(frozen=True, slots=True)
class JobClass:
    """What a job declared: its class and the limits its tasks start with."""

    cls: ClientClass
    slo_p99_s: float | None = None
    sm_pct: float | None = None
    mem_bytes: int | None = None


def parse_comment(comment: str | None) -> JobClass | None:
    """The declaration in a job's comment; ``None`` when the comment has none.

    Raises:
        ValueError: a declaration gpushare cannot use; the message names the fix.
    """
    words = _declarations(comment)
    if not words:
        return None
    if len(words) > 1:
        raise ValueError(f"the comment declares gpushare twice ({' '.join(words)}); keep one")
    first, *rest = words[0].removeprefix(f"{COMMENT_KEY}=").split(",")
    try:
        cls = ClientClass(first)
    except ValueError:
        raise ValueError(f"{first!r} is not a gpushare class: use {_EXAMPLE}") from None
    opts: dict[str, str] = {}
    for item in rest:
        key, eq, value = item.partition("=")
        if not eq or key not in _OPTIONS:
            raise ValueError(
                f"{item!r} in the comment is not one of slo-p99=, sm=, mem=: {_EXAMPLE}"
            )
        opts[key] = value
    try:
        slo = parse_duration(opts["slo-p99"]) if "slo-p99" in opts else None
        sm = float(opts["sm"]) if "sm" in opts else None
        mem = parse_size(opts["mem"]) if "mem" in opts else None
    except ValueError as exc:
        raise ValueError(f"in the comment's {words[0]!r}: {exc}") from None
    try:
        mpsenv.check_limits(cls, sm, mem, slo)
    except ValueError as exc:
        raise ValueError(f"in the comment's {words[0]!r}: {exc}") from None
    return JobClass(cls, slo, sm, mem)


@dataclass(frozen=True, slots=True)
class OnlineRule:
    """Which gres/mps jobs without a ``gpushare=`` comment are online: by partition or QOS."""

    partitions: frozenset[str] = frozenset()
    qos: frozenset[str] = frozenset()


NO_ONLINE = OnlineRule()
"""The default: every gres/mps job without a comment is offline."""

GRES_MPS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
"""What slurmd's gres/mps plugin gives the Prolog: the job's share of its GPU, in percent."""
QOS_ENV = "SLURM_JOB_QOS"
"""The job's QOS where Slurm gives it (22.05 gives its Prolog none: :func:`with_qos`)."""


def job_class(env: Mapping[str, str], online: OnlineRule = NO_ONLINE) -> JobClass | None:
    """A job's class and limits: its comment's declaration, else its gres/mps request.

    The rule: a ``gpushare=`` comment wins (its class, its ``sm=``); otherwise a job with a
    gres/mps share (``--gres=mps:N``) is online when its partition (``SLURM_JOB_PARTITION``) or
    QOS (``SLURM_JOB_QOS``, where Slurm gives it) is in ``online``, else offline. An offline job's
    SM share is the gres/mps share unless its comment gives ``sm=``; an online job runs uncapped
    (gpushare protects it by throttling offline work; the gres only counts in Slurm's scheduling).
    ``None``: neither a declaration nor a gres/mps share (not a gpushare job).

    Raises:
        ValueError: a bad declaration, or a gres/mps share gpushare cannot use.
    """
    declared = parse_comment(env.get("SLURM_JOB_COMMENT"))
    raw = env.get(GRES_MPS_ENV)
    if raw is None or not raw.strip():
        return declared
    try:
        share = float(raw)
    except ValueError:
        raise ValueError(f"gres/mps gave {GRES_MPS_ENV}={raw!r}, which is no percentage") from None
    if (problem := mpsenv.sm_pct_problem(share)) is not None:
        raise ValueError(
            f"the job's gres/mps share ({GRES_MPS_ENV}={raw}) is no SM share gpushare can give: "
            f"{problem.removeprefix('--sm ')}; ask for a larger --gres=mps:N"
        )
    if declared is None:
        partition = env.get("SLURM_JOB_PARTITION", "")
        qos = env.get(QOS_ENV, "")
        is_online = partition in online.partitions or (qos != "" and qos in online.qos)
        declared = JobClass(ClientClass.ONLINE if is_online else ClientClass.OFFLINE)
    if declared.cls is ClientClass.OFFLINE and declared.sm_pct is None:
        declared = replace(declared, sm_pct=share)
    return declared


SLURM_BIN_PATH = "/usr/bin:/usr/local/bin:/opt/slurm/bin"
"""Where ``squeue`` is looked for when the Prolog has no PATH (Slurm gives it none)."""

QosOf = Callable[[str], str]
"""A job's QOS by its id; raises :class:`LookupError` (one line) when it cannot be known."""


def squeue_qos(squeue: str | None = None, timeout_s: float = REQUEST_TIMEOUT_S) -> QosOf:
    """Ask ``squeue`` for a job's QOS: ``squeue --noheader --jobs=<id> --format=%q``.

    The one field, not ``scontrol show job -o``: there the job's name comes before its QOS, and
    a user who names a job ``x QOS=interactive`` would be read as that QOS. The Prolog runs as
    root with Slurm's ``SLURM_CONF``; a QOS exists only where Slurm keeps accounting (slurmdbd),
    else squeue prints ``(null)``.
    """

    def qos_of(job: str) -> str:
        path = os.environ.get("PATH") or SLURM_BIN_PATH
        prog = squeue or shutil.which("squeue", path=path)
        if prog is None:
            raise LookupError(f"squeue is not in {path}: pass --squeue")
        argv = [prog, "--noheader", f"--jobs={job}", "--format=%q"]
        # subprocess as gpushare.node.exec runs it (no shell, a timeout, LC_ALL=C), without its
        # logging: the Slurm scripts import only what the daemon's client needs.
        import subprocess

        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, "LC_ALL": "C"}, check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise LookupError(f"{' '.join(argv)}: timed out after {timeout_s:g} s") from None
        except OSError as exc:
            raise LookupError(f"{prog}: {exc}") from None
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise LookupError(f"{' '.join(argv)}: {last}")
        words = done.stdout.split()
        if len(words) != 1 or words[0] == "(null)":
            raise LookupError(
                f"{' '.join(argv)} gave no QOS ({done.stdout.strip()!r}): a QOS needs Slurm "
                "accounting (AccountingStorageType=accounting_storage/slurmdbd)"
            )
        return words[0]

    return qos_of


def with_qos(
    env: Mapping[str, str], online: OnlineRule, qos_of: QosOf, log: TextIO
) -> dict[str, str]:
    """``env`` with the job's QOS when its class depends on it and Slurm did not give it.

    Asked only for a gres/mps job without a ``gpushare=`` comment, outside the online
    partitions, when the site named online QOS: Slurm's docs ask Prologs not to call Slurm's
    commands, so the common jobs cost nothing. When the QOS cannot be learned, one line says so
    and the job is classed by its partition alone (offline unless its partition is online).
    """
    out = dict(env)
    needed = (
        online.qos
        and not env.get(QOS_ENV)
        and (env.get(GRES_MPS_ENV) or "").strip()
        and not _declarations(env.get("SLURM_JOB_COMMENT"))
        and env.get("SLURM_JOB_PARTITION", "") not in online.partitions
    )
    if not needed:
        return out
    job = env.get("SLURM_JOB_ID", "")
    try:
        out[QOS_ENV] = qos_of(job)
    except LookupError as exc:
        print(f"gpushare prolog: job {job}: its QOS is unknown ({exc}); classed by its "
              "partition alone", file=log)  # fmt: skip
    return out


def _declarations(comment: str | None) -> list[str]:
    return [w for w in (comment or "").split() if w.startswith(f"{COMMENT_KEY}=")]


def job_file(cfg: config.Config, job_id: str) -> Path:
    """Where the Prolog leaves a job's declaration for its TaskProlog."""
    return cfg.paths.runtime_dir / JOB_DIR / f"job-{job_id}.json"


def _job_id(env: Mapping[str, str]) -> str:
    job = env.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise ValueError(f"SLURM_JOB_ID={job!r}: not run by Slurm for a job?")
    return job


def adopt_request(job: str, uid: int, declared: JobClass) -> dict[str, Any]:
    """The ``adopt`` parameters that register a job's processes (:class:`protocol.AdoptRequest`)."""
    req = protocol.AdoptRequest(
        source=SOURCE, job=job, uid=uid, cls=declared.cls.value,
        # The class marker too: only what the TaskProlog started is the job's workload, not the
        # TaskProlog itself or slurmstepd's helpers, which carry SLURM_JOB_ID as well.
        match_env={"SLURM_JOB_ID": job, mpsenv.ENV_CLASS: declared.cls.value},
        slo_p99_ms=declared.slo_p99_s * 1000 if declared.slo_p99_s is not None else None,
        sm_pct=declared.sm_pct, mem_bytes=declared.mem_bytes,
    )  # fmt: skip
    return protocol.as_dict(req)


Send = Callable[[str, dict[str, Any]], str | None]
"""Sends one request to the daemon; returns why it failed, or ``None``."""


def daemon_sender(cfg: config.Config) -> Send:
    """A :data:`Send` over the daemon's API socket, with a short timeout."""

    def send(method: str, params: dict[str, Any]) -> str | None:
        from gpushare.client import ApiClient, ApiError, DaemonUnreachableError

        sock = cfg.paths.resolved("socket")
        try:
            with ApiClient.connect(sock, timeout_s=REQUEST_TIMEOUT_S, name="slurm") as api:
                api.call(method, params)
        except (DaemonUnreachableError, ApiError, OSError) as exc:
            return f"{method} to {sock}: {exc}"
        return None

    return send


def prolog(
    env: Mapping[str, str],
    cfg: config.Config,
    send: Send,
    log: TextIO,
    online: OnlineRule = NO_ONLINE,
    qos_of: QosOf | None = None,
) -> int:
    """Record and register a job's class (:func:`job_class`); always 0 (a failing Prolog drains the node).

    ``qos_of``: how to learn the job's QOS when Slurm does not give it (:func:`with_qos`);
    ``None``: never asked.
    """
    try:
        job = _job_id(env)
        uid = int(env.get("SLURM_JOB_UID", ""))
    except ValueError as exc:
        print(f"gpushare prolog: {exc}", file=log)
        return 0
    if qos_of is not None:
        env = with_qos(env, online, qos_of, log)
    try:
        declared = job_class(env, online)
    except ValueError as exc:
        record: dict[str, Any] = {"job": job, "uid": uid, "error": str(exc)}
        print(f"gpushare prolog: job {job}: {exc}; its tasks will fail with this message", file=log)
        _write_job(cfg, job, record, log)
        return 0
    if declared is None:
        return 0
    record = {"job": job, "uid": uid, **asdict(declared), "cls": declared.cls.value}
    _write_job(cfg, job, record, log)
    failed = send(protocol.ADOPT, adopt_request(job, uid, declared))
    if failed is not None:
        # The tasks still start with the MPS environment; the marker rule adopts them once the
        # daemon answers.
        print(f"gpushare prolog: job {job}: not registered: {failed}", file=log)
    return 0


def _write_job(cfg: config.Config, job: str, record: dict[str, Any], log: TextIO) -> None:
    target = job_file(cfg, job)
    try:
        target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(record) + "\n")
        tmp.chmod(0o644)  # read by the TaskProlog, which runs as the job's user
        os.replace(tmp, target)
    except OSError as exc:
        print(f"gpushare prolog: job {job}: cannot write {target}: {exc}", file=log)


def task_prolog(
    env: Mapping[str, str],
    cfg: config.Config,
    out: TextIO,
    sources: Sequence[Callable[[], list[envresolve.Gpu] | str]] | None = None,
) -> int:
    """Print the task's ``export``/``unset`` lines; 1 (the task fails) for a bad declaration."""

    def fail(message: str) -> int:
        out.write(f"print gpushare: {message}\n")
        return 1

    try:
        job = _job_id(env)
    except ValueError as exc:
        return fail(str(exc))
    try:
        record = json.loads(job_file(cfg, job).read_text())
    except FileNotFoundError:
        return 0  # not a gpushare job
    except (OSError, ValueError) as exc:
        return fail(f"job {job}: cannot read {job_file(cfg, job)}: {exc}")
    if "error" in record:
        return fail(f"job {job} not started: {record['error']}")
    declared = JobClass(ClientClass(record["cls"]), record["slo_p99_s"], record["sm_pct"],
                        record["mem_bytes"])  # fmt: skip
    try:
        key = task_gpu(env)
        _index, uuid = envresolve.resolve_gpu(key, sources or envresolve.gpu_sources(cfg))
    except (ValueError, envresolve.GpuLookupError) as exc:
        return fail(f"job {job}: {exc}")
    variables = envresolve.workload_env(cfg, declared.cls, uuid, sm_pct=declared.sm_pct,
                                        mem_bytes=declared.mem_bytes, slo_p99_s=declared.slo_p99_s)  # fmt: skip
    try:
        out.write(mpsenv.render(variables, "slurm", envresolve.UNSET))
    except ValueError as exc:
        return fail(f"job {job}: {exc}")
    return 0


def task_gpu(env: Mapping[str, str]) -> str | None:
    """The one GPU a task runs on (an index or a UUID), or ``None`` when Slurm gave it none.

    ``SLURM_STEP_GPUS``/``SLURM_JOB_GPUS`` hold the node's own indices; ``CUDA_VISIBLE_DEVICES``
    may be renumbered from 0 (``ConstrainDevices=yes``), or set per task (``--gpus-per-task``).

    Raises:
        ValueError: the task sees several GPUs; an MPS client uses one GPU's control daemon.
    """
    step = [
        g for g in (env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS") or "").split(",") if g
    ]
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    if len(visible) > 1 or (not visible and len(step) > 1):
        seen = ",".join(visible or step)
        raise ValueError(
            f"the task sees GPUs {seen}; a gpushare client runs on one GPU: give each task one "
            "(--gpus-per-task=1) or drop the gpushare= comment"
        )
    if visible and (visible[0].startswith(("GPU-", "MIG-")) or len(step) != 1):
        if len(step) > 1 and visible[0] not in step:
            raise ValueError(
                f"CUDA_VISIBLE_DEVICES={visible[0]} is not one of the step's GPUs {step}"
            )
        return visible[0]
    return step[0] if step else None


def epilog(env: Mapping[str, str], cfg: config.Config, send: Send, log: TextIO) -> int:
    """Release a job's registration and remove its file; always 0."""
    try:
        job = _job_id(env)
    except ValueError as exc:
        print(f"gpushare epilog: {exc}", file=log)
        return 0
    target = job_file(cfg, job)
    recorded = target.exists()
    with contextlib.suppress(FileNotFoundError):
        target.unlink()
    # The comment too: the Prolog may have registered the job without managing to write its file.
    if not recorded and not _declarations(env.get("SLURM_JOB_COMMENT")):
        return 0
    failed = send(protocol.RELEASE, protocol.as_dict(protocol.ReleaseRequest(SOURCE, job)))
    if failed is not None:
        print(f"gpushare epilog: job {job}: not released: {failed}", file=log)
    return 0


def main(argv: Sequence[str]) -> int:
    """``gpushare slurm prolog|task-prolog|epilog [--config FILE]``."""
    parser = argparse.ArgumentParser(prog="gpushare slurm", description=__doc__.split("\n")[0])
    parser.add_argument("script", choices=["prolog", "task-prolog", "epilog"])
    parser.add_argument("--config", type=Path, default=None, help="config file")
    parser.add_argument(
        "--online-partitions", default="", metavar="P[,P]",
        help="prolog: gres/mps jobs of these partitions are online (without a gpushare= comment)",
    )  # fmt: skip
    parser.add_argument(
        "--online-qos", default="", metavar="Q[,Q]",
        help="prolog: gres/mps jobs of these QOS are online (the QOS is asked of squeue when "
        "Slurm does not give it; it needs accounting)",
    )  # fmt: skip
    parser.add_argument(
        "--squeue", default=None, metavar="PATH",
        help=f"prolog: the squeue that tells a job's QOS (default: found in {SLURM_BIN_PATH})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    online = OnlineRule(
        frozenset(p for p in args.online_partitions.split(",") if p),
        frozenset(q for q in args.online_qos.split(",") if q),
    )
    try:
        cfg = envresolve.load_config(args.config)
    except config.ConfigError as exc:
        if args.script == "task-prolog":
            print(f"print gpushare: {exc}")
            return 1
        print(f"gpushare {args.script}: {exc}", file=sys.stderr)
        return 0
    env = dict(os.environ)
    if args.script == "task-prolog":
        return task_prolog(env, cfg, sys.stdout)
    try:
        if args.script == "prolog":
            return prolog(env, cfg, daemon_sender(cfg), sys.stderr, online, squeue_qos(args.squeue))
        return epilog(env, cfg, daemon_sender(cfg), sys.stderr)
    except Exception as exc:  # noqa: BLE001 - a failing Prolog/Epilog drains the node: never fail
        print(f"gpushare {args.script}: unexpected {type(exc).__name__}: {exc}", file=sys.stderr)
        return 0
