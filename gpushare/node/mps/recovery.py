"""Recovery of a faulted MPS server: which servers faulted, and the steps that bring them back.

A server that hits a fatal GPU exception stays in FAULT and refuses new clients until every client
of it has gone (NVIDIA's MPS documentation, docs/sources.md). :class:`FaultRecord` keeps the servers the supervisor saw fault
(``FATAL_EXCEPTION`` lines of the ``-f`` output), for daemons that cannot report the state
themselves (R535 has no ``get_server_status``). :class:`ServerRecovery` runs the steps through the
command adapter; :meth:`gpushare.node.mps.supervisor.MpsSupervisor.recover` runs it for one GPU and
:meth:`gpushare.node.mps.manager.MpsNodeManager.recover` on a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

from gpushare.node.mps.commands import MpsControl
from gpushare.node.mps.errors import MpsError, ServerNotFound, UnknownCommand
from gpushare.node.mps.parse import ServerStatus


class FaultRecord:
    """The servers of one GPU that reported a fatal exception since the last recovery (thread-safe).

    A fault whose server PID the line did not name is kept as ``None`` (it stands for every server).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._servers: set[int | None] = set()

    def mark(self, server_pid: int | None) -> None:
        """Record a fault of ``server_pid`` (None: the line named no server)."""
        with self._lock:
            self._servers.add(server_pid)

    def any(self) -> bool:
        """Whether a fault is recorded."""
        with self._lock:
            return bool(self._servers)

    def servers(self) -> set[int | None]:
        """A copy of the faulted servers."""
        with self._lock:
            return set(self._servers)

    def clear(self) -> None:
        """Forget every fault (recovered, or the daemon was restarted)."""
        with self._lock:
            self._servers.clear()


class StepReporter(Protocol):
    """Logs and emits one recovery step (``RECOVERY_STEP`` events)."""

    def __call__(
        self,
        step: str,
        detail: str,
        *,
        server_pid: int | None = None,
        client_pid: int | None = None,
    ) -> None:
        """Report ``step`` (a short name such as ``client_terminated``) with its ``detail``."""


class ServerRecovery:
    """Recover the faulted servers of one control daemon: offline clients terminated first.

    Finds the server in FAULT (``get_server_status`` where the daemon has it, else the servers
    named by ``FATAL_EXCEPTION`` events), runs ``terminate_client`` on its offline clients, then
    on its online and remaining clients, then waits for ACTIVE; where that cannot be observed or
    does not come in time the server is shut down (``-f``) so the next client starts a fresh
    one. Every step goes to ``step`` (logged and emitted as ``RECOVERY_STEP`` by the supervisor).
    """

    def __init__(
        self,
        control: MpsControl,
        faults: FaultRecord,
        stop: threading.Event,
        step: StepReporter,
    ) -> None:
        """Args: the daemon's front end, its fault record, the supervisor's stop, the reporter."""
        self.control = control
        self.faults = faults
        self._stop = stop
        self._step = step

    def run(
        self,
        offline_pids: Sequence[int] = (),
        online_pids: Sequence[int] = (),
        *,
        wait_s: float,
    ) -> bool:
        """Run the recovery; ``wait_s`` bounds each wait for the server (ACTIVE, then gone).

        Returns:
            True when no faulted server is left.
        """
        wait = wait_s
        ctl = self.control
        try:
            servers = ctl.get_server_list()
        except MpsError as exc:
            self._step("recovery_failed", f"cannot list servers: {exc}")
            return False
        has_status = True
        faulted: list[int] = []
        for spid in servers:
            try:
                if ctl.get_server_status(spid) is ServerStatus.FAULT:
                    faulted.append(spid)
            except UnknownCommand:
                has_status = False
                break
            except MpsError as exc:
                self._step("status_unreadable", f"server {spid}: {exc}", server_pid=spid)
        if not has_status:
            named = self.faults.servers()
            faulted = [s for s in servers if s in named or (None in named)]
        if not faulted:
            self._step("no_faulted_server", f"servers {list(servers)}: none in FAULT")
            self.faults.clear()
            return True
        ok = True
        for spid in faulted:
            ok = self._recover_server(spid, offline_pids, online_pids, has_status, wait) and ok
        if ok:
            self.faults.clear()
        return ok

    def _recover_server(
        self,
        spid: int,
        offline_pids: Sequence[int],
        online_pids: Sequence[int],
        has_status: bool,
        wait_s: float,
    ) -> bool:
        ctl = self.control
        self._step("server_faulted", f"server {spid} in FAULT", server_pid=spid)
        try:
            clients = set(ctl.get_client_list(spid))
        except MpsError as exc:
            self._step("clients_unreadable", f"server {spid}: {exc}", server_pid=spid)
            clients = set(offline_pids) | set(online_pids)
        order = [p for p in offline_pids if p in clients]
        order += [p for p in online_pids if p in clients and p not in order]
        order += sorted(clients - set(order))
        for cpid in order:
            which = (
                "offline"
                if cpid in offline_pids
                else "online"
                if cpid in online_pids
                else "unknown"
            )
            try:
                ctl.terminate_client(spid, cpid)
                self._step(
                    "client_terminated", f"{which} client {cpid}", server_pid=spid, client_pid=cpid
                )
            except MpsError as exc:
                self._step(
                    "terminate_failed",
                    f"{which} client {cpid}: {exc}",
                    server_pid=spid,
                    client_pid=cpid,
                )
        if has_status:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not self._stop.is_set():
                try:
                    if ctl.get_server_status(spid) is ServerStatus.ACTIVE:
                        self._step(
                            "server_active", f"server {spid} back to ACTIVE", server_pid=spid
                        )
                        return True
                except ServerNotFound:
                    self._step("server_gone", f"server {spid} exited", server_pid=spid)
                    return True
                except MpsError as exc:
                    self._step("status_unreadable", str(exc), server_pid=spid)
                self._stop.wait(0.1)
        try:
            ctl.shutdown_server(spid, force=True)
            self._step("server_shutdown", f"server {spid} shut down (-f); the next client starts a new one",
                       server_pid=spid)  # fmt: skip
        except ServerNotFound:
            self._step("server_gone", f"server {spid} already exited", server_pid=spid)
            return True
        except MpsError as exc:
            self._step("shutdown_failed", f"server {spid}: {exc}", server_pid=spid)
            return False
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                if spid not in ctl.get_server_list():
                    self._step("server_gone", f"server {spid} exited", server_pid=spid)
                    return True
            except MpsError as exc:
                self._step("server_list_unreadable", str(exc), server_pid=spid)
            self._stop.wait(0.05)
        self._step(
            "server_still_running", f"server {spid} did not exit within {wait_s}s", server_pid=spid
        )
        return False
