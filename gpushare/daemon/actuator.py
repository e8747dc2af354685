"""Carrying out the controller's actions: one handler per action type, in one table.

:class:`Actuator` owns the table from each :data:`~gpushare.model.Action` type to the handler
that carries it out (the GPU levers here; the client moves through the
:class:`~gpushare.daemon.lifecycle.Lifecycle`), what the operator sees of each (``ops.acted``: the
GPU's "why" in ``gpushare status``, and the event log), and the count of actions applied by kind
(the simulator reports them). A new action type is one handler and one row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import structlog

from gpushare import mpsenv
from gpushare.daemon.lifecycle import Lifecycle
from gpushare.daemon.opstats import LastAction
from gpushare.daemon.reporter import Reporter
from gpushare.daemon.state import NodeState
from gpushare.daemon.tick import Tick
from gpushare.model import (
    Action,
    Admit,
    Alert,
    ClientClass,
    ClientState,
    Evict,
    Freeze,
    RecoverMps,
    RestartClient,
    SetDuty,
    SetGating,
    SetOfflinePriority,
    SetOfflineShare,
    Thaw,
)

log = structlog.get_logger(__name__)

# Duty steps between leaving 1 and coming back are recorded as events at most this often per GPU.
_DUTY_EVENT_INTERVAL_S = 5.0
# A gate delay that moves by less than this factor from the one last logged at info is logged at
# debug: held to the room the SLO leaves, it creeps up a few percent every raise.
_DELAY_LOG_FACTOR = 1.25


class Actuator:
    """Applies actions through its table; see the module docstring."""

    def __init__(self, state: NodeState, lifecycle: Lifecycle, reporter: Reporter) -> None:
        self.s = state
        self.life = lifecycle
        self._reporter = reporter
        #: Actions applied so far, by kind.
        self.applied: dict[str, int] = {}
        self._duty_event_at: dict[str, float] = {}
        #: Per gang, the GPUs whose controller holds it now (a Freeze not yet thawed).
        self._gang_holds: dict[str, set[str]] = {}
        #: Per GPU, the gate delay last logged at info (``gating_set``).
        self._delay_logged: dict[str, float] = {}
        self._table: dict[type[Any], Callable[[Any, Tick], None]] = {
            SetDuty: self._set_duty,
            SetGating: self._set_gating,
            Freeze: self._hold,
            Thaw: self._hold,
            SetOfflineShare: self._set_offline_share,
            SetOfflinePriority: self._set_offline_priority,
            RestartClient: self._restart,
            Evict: self._evict,
            Admit: self._admit,
            RecoverMps: self._recover,
            Alert: self._alert,
        }

    def apply(self, action: Action, tick: Tick, gpu_uuid: str | None = None) -> None:
        """Carry out one controller action (under the state's lock).

        ``gpu_uuid``: the GPU whose controller chose it (a gang's holds are per GPU, see _hold).
        """
        kind = type(action).__name__
        self.applied[kind] = self.applied.get(kind, 0) + 1
        with self.s.lock:
            if isinstance(action, Freeze | Thaw):
                self._hold(action, tick, gpu_uuid)
            else:
                self._table[type(action)](action, tick)

    # ----------------------------------------------------------------------------- GPU levers

    def _set_duty(self, action: SetDuty, tick: Tick) -> None:
        gpu = action.gpu_uuid
        duty = min(1.0, max(0.0, action.duty))
        old = self.s.duty.get(gpu, 1.0)
        self.s.duty[gpu] = duty
        log.info("offline_duty_set", gpu=gpu, duty=duty, previous=old, reason=action.reason)
        if duty == old:
            return
        self._acted(gpu, "set_duty", action.reason, tick)
        if duty < old:
            self._reporter.throttled(gpu)
        # Leaving and reaching 1 are always recorded; the steps between (several a second
        # while a burst lasts) at most once per interval, so the event log stays readable.
        now = tick.monotonic_s
        if old >= 1.0:
            kind = "offline_throttled"
        elif duty >= 1.0:
            kind = "offline_released"
        elif now - self._duty_event_at.get(gpu, -math.inf) >= _DUTY_EVENT_INTERVAL_S:
            kind = "offline_duty"
        else:
            return
        self._duty_event_at[gpu] = now
        self.s.registry.add_event(
            kind, action.reason, gpu_uuid=gpu, data={"duty": duty, "previous": old}
        )

    def _set_gating(self, action: SetGating, tick: Tick) -> None:
        s, now = self.s, tick.monotonic_s
        was = s.gate.view(action.gpu_uuid, now).enabled
        s.gate.set_enabled(action.gpu_uuid, action.on, now, action.delay_s)
        self.life.live.gating(action.gpu_uuid, action.on, s.config.gate, now)  # issue 32
        emit = log.info if self._delay_news(action, was) else log.debug
        emit(
            "gating_set", gpu=action.gpu_uuid, on=action.on, delay_s=action.delay_s,
            reason=action.reason,
        )  # fmt: skip
        if was != action.on:
            self._acted(action.gpu_uuid, "set_gating", action.reason, tick)
            s.registry.add_event(
                "gating_on" if action.on else "gating_off", action.reason,
                gpu_uuid=action.gpu_uuid,
            )  # fmt: skip

    def _delay_news(self, action: SetGating, was_on: bool) -> bool:
        """Whether a ``SetGating`` is worth an info line.

        It is when gating turned on or off, or its delay left or reached 0 or moved by
        ``_DELAY_LOG_FACTOR`` since the last such line.
        """
        last = self._delay_logged.get(action.gpu_uuid, 0.0)
        delay = action.delay_s
        news = (
            was_on != action.on
            or (delay == 0.0) != (last == 0.0)
            or (delay > 0.0 and not last / _DELAY_LOG_FACTOR < delay < last * _DELAY_LOG_FACTOR)
        )
        if news:
            self._delay_logged[action.gpu_uuid] = delay
        return news

    def _set_offline_share(self, action: SetOfflineShare, tick: Tick) -> None:
        s = self.s
        if s.offline_share.get(action.gpu_uuid) != action.sm_pct:
            self._acted(action.gpu_uuid, "set_offline_share", action.reason, tick)
            s.set_offline_share(action.gpu_uuid, action.sm_pct)
            s.registry.add_event(
                "offline_share_changed",
                f"offline SM share {mpsenv.format_pct(action.sm_pct)}%: {action.reason}",
                gpu_uuid=action.gpu_uuid,
            )

    def _set_offline_priority(self, action: SetOfflinePriority, tick: Tick) -> None:
        s, gpu = self.s, action.gpu_uuid
        if s.priority(ClientClass.OFFLINE, (gpu,)) == action.priority:
            return
        self._acted(gpu, "set_offline_priority", action.reason, tick)
        s.offline_priority[gpu] = action.priority
        s.registry.add_event(
            "offline_priority_changed",
            f"offline MPS priority {action.priority} for new launches: {action.reason}",
            gpu_uuid=gpu,
        )

    def _recover(self, action: RecoverMps, tick: Tick) -> None:
        self._acted(action.gpu_uuid, "recover_mps", action.reason, tick)
        self.life.recover(action, tick.monotonic_s)

    def _alert(self, action: Alert, tick: Tick) -> None:
        self.s.registry.add_event(
            "alert", action.reason, severity=action.severity.value, gpu_uuid=action.gpu_uuid
        )

    # ----------------------------------------------------------------------------- clients

    def _hold(self, action: Freeze | Thaw, tick: Tick, gpu_uuid: str | None = None) -> None:
        held = isinstance(action, Freeze)
        rec = self.s.registry.find(action.client_id)
        if rec is None or not rec.state.is_live:
            self._gang_holds.pop(action.client_id, None)
        elif gpu_uuid is not None and len(rec.gpus()) > 1:
            # A gang has a controller on each of its GPUs: it is held while any of them holds it
            # (its ranks wait for each other), so one GPU's Thaw never ends another's Freeze.
            votes = self._gang_holds.setdefault(rec.id, set())
            (votes.add if held else votes.discard)(gpu_uuid)
            if not held and votes:
                log.info("gang_hold_kept", client_id=rec.id, thawed_by=gpu_uuid,
                         held_by=sorted(votes))  # fmt: skip
                return
            if not votes:
                del self._gang_holds[rec.id]
        if rec is not None and rec.state.is_live and rec.held != held:
            self._acted_on(action.client_id, "freeze" if held else "thaw", action.reason, tick)
        self.life.hold(action.client_id, held, action.reason)

    def _restart(self, action: RestartClient, tick: Tick) -> None:
        self._acted_on(action.client_id, "restart_client", action.reason, tick)
        self.life.restart(action, tick.monotonic_s)

    def _evict(self, action: Evict, tick: Tick) -> None:
        self._acted_on(action.client_id, "evict", action.reason, tick)
        self.life.evict(action, tick.monotonic_s)

    def _admit(self, action: Admit, tick: Tick) -> None:
        s, life = self.s, self.life
        rec = s.registry.get(action.client_id)
        if rec.state is not ClientState.QUEUED:
            return
        s.ops.admitted(rec.id, tick.wall_s)
        if action.gang:  # a gang's GPUs, recorded before its launch reads them (issue 35)
            rec = s.registry.update(rec.id, gang=action.gang)
        if not rec.detach:
            # Its submitter execs it: STARTING on this GPU, adopted when it asks again.
            life.prepare_launch(rec, action.gpu_uuid, action.sm_pct, action.reason)
        else:
            life.launch_detached(rec, action.gpu_uuid, action.sm_pct, action.reason)

    # ----------------------------------------------------------------------------- the "why"

    def _acted(
        self, gpu_uuid: str, kind: str, reason: str, tick: Tick, client_id: str | None = None
    ) -> None:
        # What `gpushare status` gives as the GPU's "why": the last action that changed something.
        self.s.ops.acted(
            gpu_uuid, LastAction(kind, reason, tick.wall_s, tick.monotonic_s, client_id)
        )

    def _acted_on(self, client_id: str, kind: str, reason: str, tick: Tick) -> None:
        rec = self.s.registry.find(client_id)
        for gpu in rec.gpus() if rec is not None else ():  # a gang's: on every GPU it uses
            self._acted(gpu, kind, reason, tick, client_id)
