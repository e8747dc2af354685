"""The null behaviour of every pauser capability a pauser does not have.

:mod:`gpushare.node.base` declares the capabilities beyond the core :class:`~gpushare.node.base.Pauser`
(batches, requests without a wait, process tracking, joining before exec, adoption). A pauser
without one of them (the simulated node's, the fakes) inherits :class:`PauserDefaults`, whose
methods do what the daemon did before these were declared, when it found the method missing:
one client at a time, waiting; no members beyond :meth:`pids`; no owner; nothing to join; an
adopted process attached as a launched one.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpushare.model import PauseMechanism
from gpushare.node.base import Pauser
from gpushare.node.cgroups.route import FreezeRoute
from gpushare.node.pauser_base import PauserError

_PAUSE_ERRORS = (OSError, PauserError)


class PauserDefaults:
    """The null capabilities of a :class:`~gpushare.node.base.NodePauser` (a mixin).

    A subclass implements the core :class:`~gpushare.node.base.Pauser` (``mechanism`` and six
    methods: the ``self: Pauser`` below makes mypy require them); every capability it does not
    override is done in their terms (or is empty), so it is a ``NodePauser``.
    """

    mechanism: PauseMechanism
    #: :meth:`request_frozen` waits: it is :meth:`freeze`, one client at a time.
    request_waits: bool = True

    # BatchPauser
    def freeze_many(self: Pauser, client_ids: Sequence[str]) -> None:
        """Freeze each client in turn."""
        for client_id in client_ids:
            self.freeze(client_id)

    def thaw_many(self: Pauser, client_ids: Sequence[str]) -> None:
        """Thaw each client in turn."""
        for client_id in client_ids:
            self.thaw(client_id)

    def request_frozen(self: Pauser, client_ids: Sequence[str], frozen: bool) -> list[str]:
        """Freeze (or thaw) each client, waiting; those whose pauser call failed are returned."""
        failed: list[str] = []
        for client_id in client_ids:
            try:
                (self.freeze if frozen else self.thaw)(client_id)
            except _PAUSE_ERRORS:
                failed.append(client_id)
        return failed

    def is_frozen(self, client_id: str) -> bool:
        """Unknown: ``False``."""
        return False

    # TrackingPauser
    def members(self: Pauser, client_id: str) -> Sequence[int]:
        """The client's :meth:`pids` (no fresher reading)."""
        return list(self.pids(client_id))

    def owner_of(self, pid: int) -> str | None:
        """Cannot tell: ``None``."""
        return None

    def clients(self) -> dict[str, list[int]]:
        """Cannot list: empty."""
        return {}

    # SpawnPauser
    def open_procs_fd(self, client_id: str) -> int | None:
        """Nothing to join before exec."""
        return None

    # AdoptPauser
    def adopt(
        self: Pauser, client_id: str, pid: int, *, owner_uid: int | None = None
    ) -> FreezeRoute:
        """Attach the process as a launched client (this pauser cannot pause one where it is)."""
        self.attach(client_id, pid, owner_uid=owner_uid)
        mechanism = self.mechanism
        return FreezeRoute(mechanism, None, f"{mechanism.value} (the daemon's pauser)")

    def route(self, client_id: str) -> FreezeRoute | None:
        """No client is adopted where it is: ``None``."""
        return None

    def mechanism_of(self: Pauser, client_id: str) -> PauseMechanism:
        """The pauser's own mechanism."""
        return self.mechanism
