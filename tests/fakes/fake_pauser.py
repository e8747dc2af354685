"""A fake :class:`gpushare.node.base.NodePauser`: records what it is asked, touches no process.

Freezes and thaws are bookkeeping (:attr:`FakePauser.frozen`); :meth:`FakePauser.request_frozen`
only asks (``request_waits`` is False, as for the cgroup freezer), so a caller that must know a
client is stopped calls :meth:`FakePauser.freeze` after it, as the gate does. The capabilities a
fake needs no behaviour for are the null ones (:class:`~gpushare.node.pauser_defaults.PauserDefaults`).
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.model import PauseMechanism
from gpushare.node.pauser_base import FreezeTimeoutError
from gpushare.node.pauser_defaults import PauserDefaults


class FakePauser(PauserDefaults):
    """Records ``request_frozen`` calls in :attr:`calls` and who is frozen in :attr:`frozen`.

    ``fail``: clients whose requests fail (returned as failed, left as they were); ``timeout``:
    a waiting :meth:`freeze` raises ``FreezeTimeoutError`` (the kernel did not confirm it).
    """

    mechanism = PauseMechanism.CGROUP
    request_waits = False

    def __init__(self) -> None:
        self.frozen: set[str] = set()
        self.calls: list[tuple[tuple[str, ...], bool]] = []
        self.attached: dict[str, int] = {}
        self.fail: set[str] = set()
        self.timeout = False

    def attach(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
        self.attached[client_id] = pid

    def freeze(self, client_id: str) -> None:
        if self.timeout:
            raise FreezeTimeoutError(f"{client_id}: the kernel did not confirm the freeze")
        self.frozen.add(client_id)

    def thaw(self, client_id: str) -> None:
        self.frozen.discard(client_id)

    def kill(self, client_id: str) -> None:
        self.attached.pop(client_id, None)

    def pids(self, client_id: str) -> Sequence[int]:
        pid = self.attached.get(client_id)
        return [] if pid is None else [pid]

    def release(self, client_id: str) -> None:
        self.attached.pop(client_id, None)
        self.frozen.discard(client_id)

    def request_frozen(self, client_ids: Sequence[str], frozen: bool) -> list[str]:
        self.calls.append((tuple(client_ids), frozen))
        asked = [c for c in client_ids if c not in self.fail]
        if frozen:
            self.frozen.update(asked)
        else:
            self.frozen.difference_update(asked)
        return [c for c in client_ids if c in self.fail]

    def is_frozen(self, client_id: str) -> bool:
        return client_id in self.frozen
