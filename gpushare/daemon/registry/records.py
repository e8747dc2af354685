"""What the registry stores: client records, registrations and events, and how a row becomes one.

Kept apart from the SQLite code so that a change can be applied to a record in memory exactly as
the database would apply it (:func:`applied`): while the database cannot be written (a full disk,
a lock held too long) the registry keeps the changed record in memory and writes it later.
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.model import ClientClass, ClientState

S = ClientState
ALLOWED: Mapping[ClientState, frozenset[ClientState]] = {
    S.QUEUED: frozenset({S.STARTING, S.EXITED, S.FAILED, S.LOST}),
    # QUEUED: a launch the daemon died in the middle of goes back to the queue (lifecycle.readopt).
    S.STARTING: frozenset({S.RUNNING, S.THROTTLED, S.FROZEN, S.QUEUED, S.EXITED, S.FAILED, S.LOST}),
    S.RUNNING: frozenset(
        {S.THROTTLED, S.FROZEN, S.RESTARTING, S.QUEUED, S.EXITED, S.FAILED, S.LOST}
    ),
    S.THROTTLED: frozenset(
        {S.RUNNING, S.FROZEN, S.RESTARTING, S.QUEUED, S.EXITED, S.FAILED, S.LOST}
    ),
    S.FROZEN: frozenset(
        {S.RUNNING, S.THROTTLED, S.RESTARTING, S.QUEUED, S.EXITED, S.FAILED, S.LOST}
    ),
    S.RESTARTING: frozenset({S.STARTING, S.RUNNING, S.QUEUED, S.EXITED, S.FAILED, S.LOST}),
    S.EXITED: frozenset(),
    S.FAILED: frozenset(),
    S.LOST: frozenset(),
}
"""Transitions the registry accepts; every other one raises :class:`TransitionError`."""


class RegistryError(Exception):
    """The registry cannot do what was asked (unknown client, database failure)."""


class TransitionError(RegistryError):
    """A state change that :data:`ALLOWED` does not permit."""


class RegistryUnavailableError(RegistryError):
    """The database cannot be written now (disk full, read-only, locked): new work is refused.

    Changes to known clients are not refused: they wait in memory (see the package docstring).
    """


@dataclass(frozen=True, slots=True)
class ClientRecord:
    """One client as the registry stores it. Times are wall-clock seconds since the epoch."""

    id: str
    name: str | None
    cls: ClientClass
    argv: tuple[str, ...]
    uid: int
    gid: int
    user: str
    gpu_request: str | None
    gpu_uuid: str | None
    gpu_index: int | None
    sm_ceiling: float | None
    sm_pct: float | None
    mem_bytes: int | None
    priority: int
    slo_p99_ms: float | None
    latency_from: str | None
    restartable: bool
    checkpoint_signal: int
    detach: bool
    env: Mapping[str, str]
    cwd: str | None
    state: ClientState
    reason: str | None
    pid: int | None
    start_time: float | None
    exit_code: int | None
    pause_mechanism: str | None
    log_path: str | None
    held: bool
    restarts: int
    failures: int
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    adopted_by: str | None = None
    """For a process gpushare adopted rather than launched: the rule that adopted it
    (``rule 'marker' (/etc/gpushare/gpushare.toml)``, ``slurm job 42``); ``None`` for a launched one."""
    # Request gating (docs/controller.md): an online client's --inflight-from gauge, an offline
    # client's --queue mode (None: deep).
    inflight_from: str | None = None
    queue: str | None = None
    expected_s: float | None = None
    """An offline job's declared length (``submit --time``): the queue starts shorter jobs first."""
    restart_cost_s: float | None = None
    """What a restart costs the job (``submit --restart-cost``, issue 32); ``None``: the default."""
    gang: tuple[str, ...] = ()
    """A gang's GPUs (``submit --gpus``), by UUID in rank order: rank ``k`` runs on ``gang[k]``,
    and ``gpu_uuid`` is rank 0's. Empty for a one-GPU client, a gang of one (:meth:`gpus`)."""

    def gpus(self) -> tuple[str, ...]:
        """Every GPU the client uses, in rank order (a one-GPU client's one; none while queued)."""
        if self.gang:
            return self.gang
        return () if self.gpu_uuid is None else (self.gpu_uuid,)

    slo_ttft_p99_ms: float | None = None
    """An LLM server's p99 SLO on the time to its first token (``submit --slo-ttft-p99``)."""
    slo_tpot_p99_ms: float | None = None
    """An LLM server's p99 SLO on the time per further token (``submit --slo-tpot-p99``)."""
    startup_s: float | None = None
    """Its start-up measured by the daemon, relaunch to first GPU work, smoothed and capped
    (issue 32, ``gpushare.daemon.startcost``); ``None``: not measured yet."""


@dataclass(frozen=True, slots=True)
class Registration:
    """A scheduler job registered by an ``adopt`` request, kept until its ``release``."""

    source: str
    job: str
    owner_uid: int
    """Who registered it (the caller's uid): 0 may adopt anyone's processes in any class."""
    params: Mapping[str, Any]
    """The request's parameters (:class:`gpushare.protocol.AdoptRequest`)."""
    at: float


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the event log."""

    id: int
    at: float
    kind: str
    severity: str
    client_id: str | None
    gpu_uuid: str | None
    message: str
    data: Mapping[str, Any] | None


@dataclass(frozen=True, slots=True)
class EventRow:
    """An event not written yet: what :class:`Event` holds but the id the database gives it."""

    at: float
    kind: str
    severity: str
    client_id: str | None
    gpu_uuid: str | None
    message: str
    data: Mapping[str, Any] | None


JSON_FIELDS = frozenset({"argv", "env", "gang"})
BOOL_FIELDS = frozenset({"restartable", "detach", "held"})
UPDATABLE = frozenset(f.name for f in dataclasses.fields(ClientRecord)) - {
    "id",
    "state",
    "submitted_at",
}


def check_fields(updates: Mapping[str, Any]) -> None:
    """Refuse a field the record does not have (or may not change).

    Raises:
        RegistryError: an unknown field.
    """
    bad = set(updates) - UPDATABLE
    if bad:
        raise RegistryError(f"unknown client field(s): {', '.join(sorted(bad))}")


def column_value(key: str, value: Any) -> Any:
    """A field's value as its column stores it."""
    if key in JSON_FIELDS:
        return json.dumps(list(value) if key in ("argv", "gang") else dict(value))
    if key in BOOL_FIELDS:
        return int(bool(value))
    if key == "cls":
        return ClientClass(value).value
    return value


def applied(rec: ClientRecord, updates: Mapping[str, Any], state: ClientState) -> ClientRecord:
    """``rec`` with ``updates`` and ``state`` as the database would store and read them back."""
    fields: dict[str, Any] = {"state": state}
    for key, value in updates.items():
        if key in ("argv", "gang"):
            value = tuple(value)
        elif key == "env":
            value = dict(value)
        elif key in BOOL_FIELDS:
            value = bool(value)
        elif key == "cls":
            value = ClientClass(value)
        fields[key] = value
    return dataclasses.replace(rec, **fields)


def record(row: sqlite3.Row) -> ClientRecord:
    """A ``clients`` row as a record."""
    return ClientRecord(
        id=row["id"], name=row["name"], cls=ClientClass(row["cls"]),
        argv=tuple(json.loads(row["argv"])), uid=row["uid"], gid=row["gid"], user=row["user"],
        gpu_request=row["gpu_request"], gpu_uuid=row["gpu_uuid"], gpu_index=row["gpu_index"],
        sm_ceiling=row["sm_ceiling"], sm_pct=row["sm_pct"],
        mem_bytes=row["mem_bytes"], priority=row["priority"], slo_p99_ms=row["slo_p99_ms"],
        latency_from=row["latency_from"],
        inflight_from=row["inflight_from"], queue=row["queue"], expected_s=row["expected_s"],
        restart_cost_s=row["restart_cost_s"],
        slo_ttft_p99_ms=row["slo_ttft_p99_ms"], slo_tpot_p99_ms=row["slo_tpot_p99_ms"],
        restartable=bool(row["restartable"]), checkpoint_signal=row["checkpoint_signal"],
        detach=bool(row["detach"]), env=json.loads(row["env"]), cwd=row["cwd"],
        state=ClientState(row["state"]), reason=row["reason"], pid=row["pid"],
        start_time=row["start_time"], exit_code=row["exit_code"],
        pause_mechanism=row["pause_mechanism"], log_path=row["log_path"], held=bool(row["held"]),
        restarts=row["restarts"], failures=row["failures"], submitted_at=row["submitted_at"],
        started_at=row["started_at"], ended_at=row["ended_at"], adopted_by=row["adopted_by"],
        gang=tuple(json.loads(row["gang"])) if row["gang"] else (),
        startup_s=row["startup_s"],
    )  # fmt: skip


def event(row: sqlite3.Row) -> Event:
    """An ``events`` row as an event."""
    return Event(
        id=row["id"], at=row["at"], kind=row["kind"], severity=row["severity"],
        client_id=row["client_id"], gpu_uuid=row["gpu_uuid"], message=row["message"],
        data=json.loads(row["data"]) if row["data"] else None,
    )  # fmt: skip
