"""Request gating in the daemon: one gate per GPU and the fast freeze path.

:class:`Gatekeeper` keeps a :class:`gpushare.control.gate.GateState` per GPU and applies it:

* **The fast path**: :meth:`Gatekeeper.on_inflight` runs in the latency receiver's thread for
  each request-boundary datagram. When it closes a gate, it writes ``cgroup.freeze`` of the GPU's
  gated offline clients right there (``request_frozen``: no wait for the kernel's confirmation,
  no control tick), so a request start reaches the freeze in a few hundred microseconds
  (``bench/gating_latency.py``).
* **The timer**: a thread of its own evaluates each gate when its delay, its hold or an in-flight
  timeout runs out (:func:`gpushare.control.gate.due_at`), so offline work is frozen and thawed
  on time.
* **The freezes**: a closed gate gives its gated clients the ``"gate"`` freeze reason at the
  :class:`~gpushare.daemon.freeze.FreezeArbiter`, the one owner of why each client is frozen
  (with the duty cycle's and the holds' reasons), and an open one takes it back.

The daemon tells it, every tick, which online clients exist on which GPU and which offline
clients are gated (:meth:`Gatekeeper.update_clients`), and whether gating is on per GPU
(:meth:`Gatekeeper.set_enabled`, from the controller's ``SetGating``). The receiver thread never
reads the registry.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

import structlog

from gpushare.config import GateConfig
from gpushare.control import gate
from gpushare.control.gate import GateState
from gpushare.daemon.freeze import GATE, FreezeArbiter, gate_reason
from gpushare.latency.inflight import Rejections
from gpushare.latency.receiver import renice_thread
from gpushare.model import GateReading
from gpushare.node.base import BatchPauser

log = structlog.get_logger(__name__)

__all__ = ["GATE", "Gatekeeper"]


class Gatekeeper:
    """See the module docstring.

    Args:
        config: ``[gate]``.
        pauser: the daemon's pauser.
        rejections: where rejected in-flight signals are counted.
        clock: monotonic clock (the receiver passes its own ``now`` too).
        online_gpu: the GPU of a live online client, ``None`` for anything else: asked for a
            client the last tick did not list yet (a service's first request right after its
            start), so its first boundaries are not refused.
        on_edge: the ``on_edge`` of the arbiter made here when none is given.
        arbiter: who the gates' freezes go through (default: one of its own on ``pauser``).
    """

    def __init__(
        self,
        config: GateConfig,
        pauser: BatchPauser,
        *,
        rejections: Rejections | None = None,
        clock: Callable[[], float] = time.monotonic,
        online_gpu: Callable[[str], str | None] | None = None,
        on_edge: Callable[[Sequence[str], bool, float], None] | None = None,
        arbiter: FreezeArbiter | None = None,
    ) -> None:
        self.config = config
        self.arbiter = (
            arbiter if arbiter is not None else FreezeArbiter(pauser, clock=clock, on_edge=on_edge)
        )
        self.rejections = rejections if rejections is not None else Rejections(clock)
        self._clock = clock
        self._online_gpu = online_gpu
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._gates: dict[str, GateState] = {}
        self._online: dict[str, str] = {}  # online client -> its GPU
        self._gated: dict[str, tuple[str, ...]] = {}  # GPU -> gated offline clients
        self._signalled: dict[str, set[str]] = {}  # GPU -> online clients that sent boundaries
        self._closes: dict[str, int] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._timer_restarts = 0
        self._timer_error: str | None = None
        # Online processes -> client, refreshed every tick: the receiver identifies a sender
        # without the daemon's lock (a tick holds it for milliseconds).
        self._online_pids: dict[int, str] = {}
        self._thread_nice: int | None = None
        self._thread_realtime = False
        #: Told when a gate is next due after :meth:`set_enabled` changed it (a new delay can
        #: make a gate due sooner): a runner without the timer thread (the simulator) arms its
        #: poll from it; the thread itself is woken instead.
        self.on_rearm: Callable[[float | None], None] | None = None

    # ------------------------------------------------------------------------- signals

    def on_inflight(self, client_id: str, pid: int | None, count: int, now: float) -> str | None:
        """A request-boundary datagram of ``client_id`` from ``pid``: ``None`` if accepted, else why not.

        Closing a gate freezes the GPU's gated offline clients before this returns.
        """
        return self._signal(client_id, f"{client_id}/pid:{pid}", count, now)

    def on_gauge(self, client_id: str, count: int, now: float) -> None:
        """A good poll of a client's in-flight gauge (``--inflight-from``)."""
        why = self._signal(client_id, f"{client_id}/gauge", count, now, gauge=True)
        if why is not None:
            self.rejections.reject(why, client_id=client_id)

    def _signal(
        self, client_id: str, key: str, count: int, now: float, *, gauge: bool = False
    ) -> str | None:
        late = None
        if client_id not in self._online and self._online_gpu is not None:
            late = self._online_gpu(client_id)  # outside the lock: it reads the registry
        with self._lock:
            gpu = self._online.get(client_id)
            if gpu is None and late is not None:
                gpu = self._online[client_id] = late
            if gpu is None:
                return "request boundary from a process that is not a live online client"
            state = self._gates.get(gpu, GateState())
            if count == 0 and not gauge and not gate.knows(state, key):
                return "request end without a start"
            self._signalled.setdefault(gpu, set()).add(client_id)
            self._set_gate(gpu, gate.record(state, client_id, key, count, now), now)
            self._wake.notify()
        return None

    def client_of_pid(self, pid: int) -> str | None:
        """The online client a process belongs to, as of the last tick (lock-free read)."""
        return self._online_pids.get(pid)

    def forget(self, client_id: str) -> None:
        """A client exited: its requests no longer hold any gate, its freeze reasons go."""
        now = self._clock()
        with self._lock:
            self.arbiter.forget(client_id)
            self._online_pids = {p: c for p, c in self._online_pids.items() if c != client_id}
            gpu = self._online.pop(client_id, None)
            if gpu is not None:
                self._signalled.get(gpu, set()).discard(client_id)
                self._set_gate(gpu, gate.forget(self._gates.get(gpu, GateState()), client_id), now)
            for g, ids in self._gated.items():
                if client_id in ids:
                    self._gated[g] = tuple(i for i in ids if i != client_id)

    # ------------------------------------------------------------------------- the daemon's tick

    def update_clients(
        self,
        online: Mapping[str, str],
        gated: Mapping[str, Sequence[str]],
        now: float,
        online_pids: Mapping[int, str] | None = None,
    ) -> None:
        """The daemon's view, once a tick: online client -> GPU, and GPU -> gated offline clients.

        An online client no longer listed is forgotten (its requests stop holding the gate); an
        offline client that joins a closed gate is frozen at once. ``online_pids`` maps the
        online clients' processes to them (:meth:`client_of_pid`).
        """
        if online_pids is not None:
            self._online_pids = dict(online_pids)  # replaced whole: readers never see a half
        # The caller's now was read before its lock: never evaluate a gate before a signal it had.
        now = max(now, self._clock())
        with self._lock:
            if self._settled(online, gated, now):
                # Nothing to forget, release, evaluate or freeze: no gate changes, and the timer
                # thread's next due time stands (it is not woken).
                return
            for client_id in set(self._online) - set(online):
                gpu = self._online[client_id]
                self._signalled.get(gpu, set()).discard(client_id)
                self._gates[gpu] = gate.forget(self._gates.get(gpu, GateState()), client_id)
            self._online = dict(online)
            old = self._gated
            self._gated = {g: tuple(ids) for g, ids in gated.items()}
            for g in set(old) | set(self._gated) | set(self._gates):
                left = set(old.get(g, ())) - set(self._gated.get(g, ()))
                self._release(g, left)
                self._set_gate(g, self._gates.get(g, GateState()), now, force=True)
            self._wake.notify()

    def _settled(
        self, online: Mapping[str, str], gated: Mapping[str, Sequence[str]], now: float
    ) -> bool:
        """Under the lock: whether :meth:`update_clients` would change nothing.

        The same online and gated clients as kept now (compared with what is kept, not with the
        last call's arguments: :meth:`forget` and a late online client change it in between),
        and every gate settled (:func:`gpushare.control.gate.settled`: open, idle, no
        checkpoint due) with none of its gated clients frozen by it, so the forced evaluation
        and release would return every state and reason as it is.
        """
        if online != self._online or len(gated) != len(self._gated):
            return False
        for g, ids in gated.items():
            if self._gated.get(g) != tuple(ids):
                return False
        for g in self._gated.keys() | self._gates.keys():
            state = self._gates.get(g)
            if state is None or not gate.settled(state, now, self.config):
                return False
        # One look at the arbiter for every gated client (not one locked call each, each tick).
        reasons = {g: gate_reason(g) for g in self._gated}
        gated_by = ((c, reasons[g]) for g, ids in self._gated.items() for c in ids)
        return not self.arbiter.holds_any(gated_by)

    def set_enabled(
        self, gpu_uuid: str, enabled: bool, now: float, delay_s: float | None = None
    ) -> None:
        """The controller's lever: gating on or off for one GPU, and its delay (``None``: kept).

        The timer thread is woken: a delay that now runs out sooner closes the gate on time.
        """
        now = max(now, self._clock())
        with self._lock:
            state = gate.set_enabled(self._gates.get(gpu_uuid, GateState()), enabled, delay_s)
            self._set_gate(gpu_uuid, state, now)
            self._wake.notify()
            due = self._next_due(now)
        if self.on_rearm is not None:
            self.on_rearm(due)

    def view(self, gpu_uuid: str, now: float) -> GateReading:
        """The gate of one GPU for status and the controller's observation."""
        with self._lock:
            state = self._gates.get(gpu_uuid, GateState())
            return GateReading(
                enabled=state.enabled,
                closed=state.closed,
                inflight=gate.inflight(state, now, self.config),
                signalled_clients=len(self._signalled.get(gpu_uuid, ())),
                busy_fraction=gate.busy_fraction(state, now, self.config),
                max_busy=self.config.max_busy,
                closes=self._closes.get(gpu_uuid, 0),
                delay_s=state.delay_s,
            )

    # ------------------------------------------------------------------------- the freezes

    def _release(self, gpu: str, client_ids: Iterable[str]) -> None:
        self.arbiter.set_quietly(client_ids, gate_reason(gpu), False)

    def _set_gate(self, gpu: str, state: GateState, now: float, *, force: bool = False) -> None:
        """Under the lock: evaluate the gate and freeze or thaw its clients as it says."""
        before = self._gates.get(gpu, GateState()).closed
        state = gate.evaluate(state, now, self.config)
        self._gates[gpu] = state
        if state.closed and not before:
            self._closes[gpu] = self._closes.get(gpu, 0) + 1
        if state.closed and (force or not before):
            self.arbiter.set_quietly(self._gated.get(gpu, ()), gate_reason(gpu), True)
        elif not state.closed and (force or before):
            self._release(gpu, self._gated.get(gpu, ()))

    # ------------------------------------------------------------------------- the timer

    def start(self, *, thread_nice: int | None = None, thread_realtime: bool = False) -> None:
        """Start the thread that opens gates when their hold or a timeout runs out.

        Args:
            thread_nice: its nice value (``latency.receiver.renice_thread``): a hold of 2 ms ends
                on time only if the thread gets a CPU when it wakes.
            thread_realtime: ``SCHED_FIFO`` for it instead, where allowed.
        """
        self._thread_nice = thread_nice
        self._thread_realtime = thread_realtime
        self._thread = threading.Thread(target=self._run, name="gate-timer", daemon=True)
        self._thread.start()

    def timer_health(self) -> tuple[bool, int, str | None]:
        """The timer thread's ``(alive, restarts, last_error)`` (``daemon.threads`` in status)."""
        alive = self._thread is not None and self._thread.is_alive()
        return alive, self._timer_restarts, self._timer_error

    def _run(self) -> None:
        if self._thread_nice is not None:
            renice_thread(self._thread_nice, realtime=self._thread_realtime)
        while not self._stop:
            try:
                self._time_gates()
            except Exception as exc:  # a bug must not leave every gate without its timer
                self._timer_restarts += 1
                self._timer_error = type(exc).__name__
                log.exception("gate_timer_failed", restarts=self._timer_restarts)
                time.sleep(min(5.0, 0.01 * 2 ** min(self._timer_restarts, 9)))

    def _time_gates(self) -> None:
        with self._lock:
            while not self._stop:
                now = self._clock()
                due: float | None = None
                for gpu, state in list(self._gates.items()):
                    if not state.busy:
                        continue
                    # The gate's next change: it closes (a delay ran out) or opens (a hold or
                    # an in-flight timeout ran out).
                    at = gate.due_at(state, self.config)
                    if at is not None and at <= now:
                        self._set_gate(gpu, state, now)
                        state = self._gates[gpu]
                        at = gate.due_at(state, self.config) if state.busy else None
                        if at is not None and at <= now:
                            at = None  # evaluated at now; a later signal brings a new time
                    if at is not None:
                        due = at if due is None else min(due, at)
                # A hold or delay of a few ms is waited for exactly; a gate idle waits for a signal.
                self._wake.wait(None if due is None else max(0.0, due - now) + 1e-4)

    def poll(self, now: float) -> float | None:
        """Evaluate every gate at ``now`` (what the timer thread does; for runners without it).

        Returns when a gate is next due (its hold or a timeout runs out), ``None`` when none is
        busy: a runner without the thread (the simulator, in virtual time) polls again then.
        """
        with self._lock:
            for gpu, state in list(self._gates.items()):
                self._set_gate(gpu, state, now)
            return self._next_due(now)

    def next_due(self, now: float) -> float | None:
        """When a gate is next due after ``now`` without a further signal (see :meth:`poll`)."""
        with self._lock:
            return self._next_due(now)

    def _next_due(self, now: float) -> float | None:
        due: float | None = None
        for state in self._gates.values():
            if not (state.busy or state.sources):
                continue
            at = gate.due_at(state, self.config)
            if at is not None and at > now:
                due = at if due is None else min(due, at)
        return due

    def close(self) -> None:
        """Stop the timer thread and thaw what the gates froze (the daemon is going away)."""
        with self._lock:
            self._stop = True
            for gpu, state in list(self._gates.items()):
                self._gates[gpu] = replace(state, enabled=False)
                self._release(gpu, self._gated.get(gpu, ()))
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
