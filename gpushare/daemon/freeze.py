"""The one owner of why each client is frozen: :class:`FreezeArbiter`.

A client is frozen while it has any freeze reason and thawed when it has none:

* :data:`DUTY`: the offline duty cycle (frozen between its duty edge and the next period, or for
  the whole period at duty 0; :mod:`gpushare.daemon.dutycycle`);
* :data:`HOLD`: a user's ``gpushare pause`` or the controller's ``Freeze``, until resumed or
  thawed (the registry persists it as the client's ``held``, so a restarted daemon restores it);
* :data:`GATE`: a GPU's request gate is closed (:mod:`gpushare.daemon.gating`, which sets and
  clears it from the latency receiver's thread and its timer), one reason per GPU
  (:func:`gate_reason`): a gang (``submit --gpus``) is gated by every GPU it uses, and one GPU's
  gate opening must not thaw it while another's is closed;
* :data:`STOP`: ``daemon.on_stop = "freeze"`` as the daemon stops.

Every change of reasons and the pauser request it makes happen under one lock, so one reason's
removal never thaws a client another reason still holds (the duty cycle's thaw never undoes a
gate's freeze, or the other way round). The arbiter is also the one place that knows when a
client really is frozen or thawed: it tells ``on_edge`` (the operators' thawed time).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence

import structlog

from gpushare.node.base import BatchPauser
from gpushare.node.pauser_base import PauserError

log = structlog.get_logger(__name__)

DUTY = "duty"
HOLD = "hold"
GATE = "gate"
STOP = "stop"


def gate_reason(gpu_uuid: str) -> str:
    """The freeze reason of one GPU's closed request gate (``gate:<uuid>``)."""
    return f"{GATE}:{gpu_uuid}"


def by_gate(reasons: Iterable[str]) -> bool:
    """Whether any of ``reasons`` is a GPU's request gate (:func:`gate_reason`)."""
    return any(r.startswith(f"{GATE}:") for r in reasons)


#: The reasons the daemon itself sets (all but the gates').
DAEMON_REASONS: frozenset[str] = frozenset({DUTY, HOLD, STOP})


def _requester(pauser: BatchPauser) -> tuple[Callable[[Sequence[str], bool], list[str]], bool]:
    """The pauser's request, and whether it only asks (then a waiting freeze confirms it)."""
    return pauser.request_frozen, not pauser.request_waits


class FreezeArbiter:
    """Each client's freeze reasons, and the pauser requests they make; see the module docstring.

    Args:
        pauser: the daemon's pauser.
        clock: monotonic clock, for ``on_edge``.
        on_edge: told ``(clients, frozen, now)`` under the arbiter's lock whenever clients'
            frozen state changes, whoever caused it (the receiver thread included).
    """

    def __init__(
        self,
        pauser: BatchPauser,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_edge: Callable[[Sequence[str], bool, float], None] | None = None,
    ) -> None:
        self.pauser = pauser
        self._request, self._confirms = _requester(pauser)
        self._clock = clock
        self._on_edge = on_edge
        self._lock = threading.Lock()
        self._reasons: dict[str, set[str]] = {}

    # ------------------------------------------------------------------------- queries

    def frozen(self, client_id: str) -> bool:
        """Whether the client has any freeze reason."""
        with self._lock:
            return bool(self._reasons.get(client_id))

    def reasons(self, client_id: str) -> frozenset[str]:
        """Why the client is frozen (empty: it is not)."""
        with self._lock:
            return frozenset(self._reasons.get(client_id, ()))

    def has_any(self, client_id: str, reasons: Collection[str]) -> bool:
        """Whether the client has any of ``reasons``."""
        with self._lock:
            mine = self._reasons.get(client_id)
            return mine is not None and not mine.isdisjoint(reasons)

    def holding(self, reasons: Collection[str]) -> frozenset[str]:
        """The clients that have any of ``reasons``."""
        with self._lock:
            return frozenset(c for c, r in self._reasons.items() if not r.isdisjoint(reasons))

    def reasons_among(self, among: Collection[str]) -> dict[str, frozenset[str]]:
        """Each client that has any of ``among``, and which of them: one look under the lock.

        For a caller that settles many clients at once (the duty cycle, every tick) and asks
        for a change only where it would change something, instead of one locked call each.
        """
        with self._lock:
            return {
                c: frozenset(r.intersection(among))
                for c, r in self._reasons.items()
                if not r.isdisjoint(among)
            }

    def holds_any(self, pairs: Iterable[tuple[str, str]]) -> bool:
        """Whether any ``(client, reason)`` of ``pairs`` is held: one look under the lock."""
        with self._lock:
            reasons = self._reasons
            # No client frozen for any reason (an idle node): nothing to look through.
            return bool(reasons) and any(
                reason in reasons.get(client_id, ()) for client_id, reason in pairs
            )

    # ------------------------------------------------------------------------- changes

    def set(self, client_ids: Sequence[str], reason: str, on: bool, *, wait: bool = True) -> None:
        """Add (``on``) or remove one reason of several clients, one request for all.

        A freeze is requested under the lock and then, with ``wait``, confirmed outside it (the
        kernel's wait never delays a gate).

        Raises:
            PauserError: the request failed (the reason is not recorded: call again to retry).
            FreezeTimeoutError: the kernel did not confirm the freeze in time (it stays
                requested, the reason recorded).
        """
        add, drop = ((reason,), ()) if on else ((), (reason,))
        self.change(client_ids, add=add, drop=drop, wait=wait)

    def change(
        self,
        client_ids: Sequence[str],
        *,
        add: Collection[str] = (),
        drop: Collection[str] = (),
        wait: bool = True,
    ) -> None:
        """Add ``add`` and remove ``drop`` (one step: no thaw in between) for several clients.

        Raises:
            PauserError: see :meth:`set`.
            FreezeTimeoutError: see :meth:`set`.
        """
        with self._lock:
            changed, failed = self._change(client_ids, add, drop, strict=True)
        if add and wait and self._confirms:
            for client_id in changed:
                # Idempotent write plus the wait; no thaw can come between: only this caller
                # removes these reasons.
                self.pauser.freeze(client_id)
        if failed:
            raise PauserError(
                f"cannot {'freeze' if add else 'thaw'} clients {failed} (no cgroup or gone)"
            )

    def set_quietly(self, client_ids: Iterable[str], reason: str, on: bool) -> None:
        """:meth:`set` without the wait, a failed request logged and the reason kept.

        For the gates' own bookkeeping: a gate's reasons follow the gate whatever the pauser did.
        """
        add, drop = ((reason,), ()) if on else ((), (reason,))
        with self._lock:
            self._change(list(client_ids), add, drop, strict=False)

    def forget(self, client_id: str) -> None:
        """The client is gone: its reasons go, and nothing is requested."""
        with self._lock:
            self._reasons.pop(client_id, None)

    def _change(
        self,
        client_ids: Iterable[str],
        add: Collection[str],
        drop: Collection[str],
        *,
        strict: bool,
    ) -> tuple[list[str], list[str]]:
        """Under the lock: (clients whose frozen state changed and was requested, failures).

        A call that adds a reason can only freeze (a client goes from none to some), one that
        only removes can only thaw: every request of one call goes the same way. With
        ``strict`` a failed request takes the change back (the caller retries later); otherwise
        it is logged and the reasons kept.
        """
        frozen = bool(add)
        changed: list[str] = []
        before: dict[str, frozenset[str]] = {}
        for client_id in client_ids:
            reasons = self._reasons.setdefault(client_id, set())
            was = frozenset(reasons)
            reasons.difference_update(drop)
            reasons.update(add)
            if bool(reasons) != bool(was):
                changed.append(client_id)
                before[client_id] = was
            if not reasons:
                del self._reasons[client_id]
        failed = self._request(changed, frozen) if changed else []
        if failed:
            why = ",".join(sorted(add or drop))
            log.warning("pause_request_failed", clients=failed, paused=frozen, reason=why)
            if strict:
                for client_id in failed:
                    if before[client_id]:
                        self._reasons[client_id] = set(before[client_id])
                    else:
                        self._reasons.pop(client_id, None)
        done = [c for c in changed if c not in failed]
        if done and self._on_edge is not None:
            self._on_edge(done, frozen, self._clock())
        return done, failed
