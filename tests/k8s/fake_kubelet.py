"""A fake kubelet over real gRPC: the device manager's side of the device-plugin API v1beta1.

It does what the kubelet's device manager does with a plugin: serves ``Registration`` on
``<dir>/kubelet.sock``; on ``Register`` dials the plugin's endpoint, asks its options and keeps a
``ListAndWatch`` stream open; to admit a container it asks ``GetPreferredAllocation`` (when the
plugin offers it) and then ``Allocate``. :meth:`FakeKubelet.restart` does what a kubelet restart
does to the directory: the old server goes, every socket in the directory is removed, and a new
``kubelet.sock`` appears.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpushare.k8s.proto import api_pb2 as pb
from gpushare.k8s.proto import api_pb2_grpc as pb_grpc


@dataclass
class Endpoint:
    """One registered plugin as the kubelet keeps it."""

    resource: str
    socket: Path
    channel: Any
    options: Any
    devices: dict[str, str] = field(default_factory=dict)
    updates: int = 0
    stream_ended: bool = False


class FakeKubelet(pb_grpc.RegistrationServicer):
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.cond = threading.Condition()
        self.endpoints: dict[str, Endpoint] = {}
        self.registrations: list[tuple[str, str, str]] = []
        self.allocated: set[str] = set()
        self.server: grpc.Server | None = None
        self.start()

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.dir / 'kubelet.sock'}")
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None).wait(5)
            self.server = None
        with self.cond:
            for ep in self.endpoints.values():
                ep.channel.close()
            self.endpoints.clear()
        (self.dir / "kubelet.sock").unlink(missing_ok=True)

    def restart(self) -> None:
        """A kubelet restart: its state goes, the directory is emptied, a new socket appears."""
        self.stop()
        for p in self.dir.iterdir():
            p.unlink()
        self.start()

    # -- Registration ------------------------------------------------------------------------

    def Register(self, request: Any, context: Any) -> Any:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"version {request.version!r}")
        sock = self.dir / request.endpoint
        channel = grpc.insecure_channel(f"unix://{sock}")
        stub = pb_grpc.DevicePluginStub(channel)
        options = stub.GetDevicePluginOptions(pb.Empty(), timeout=5)
        ep = Endpoint(request.resource_name, sock, channel, options)
        with self.cond:
            old = self.endpoints.pop(request.resource_name, None)
            if old is not None:
                old.channel.close()
            self.endpoints[request.resource_name] = ep
            self.registrations.append((request.resource_name, request.endpoint, request.version))
            self.cond.notify_all()
        threading.Thread(target=self._watch, args=(ep, stub), daemon=True).start()
        return pb.Empty()

    def _watch(self, ep: Endpoint, stub: Any) -> None:
        try:
            for resp in stub.ListAndWatch(pb.Empty()):
                with self.cond:
                    ep.devices = {d.ID: d.health for d in resp.devices}
                    ep.updates += 1
                    self.cond.notify_all()
        except grpc.RpcError:
            pass
        with self.cond:
            ep.stream_ended = True
            self.cond.notify_all()

    # -- what the tests ask ------------------------------------------------------------------

    def wait(self, pred: Any, timeout_s: float = 10.0, what: str = "condition") -> Any:
        with self.cond:
            if not self.cond.wait_for(pred, timeout_s):
                raise AssertionError(f"timed out waiting for {what}")
            return pred()

    def endpoint(self, resource: str) -> Endpoint:
        return self.wait(lambda: self.endpoints.get(resource), what=f"{resource} registered")

    def admit(self, resource: str, count: int) -> tuple[list[str], Any]:
        """Admit one container asking ``count`` of ``resource``: (device ids, its response)."""
        ep = self.endpoint(resource)

        def free_now() -> list[str]:
            return [d for d, h in ep.devices.items() if h == "Healthy" and d not in self.allocated]

        # The plugin lists its devices Unhealthy until the daemon's first answer (a loaded host
        # may take a while): wait for enough healthy ones, as a pod waits to be admitted.
        self.wait(lambda: len(free_now()) >= count, what=f"{count} healthy {resource} devices")
        with self.cond:
            free = free_now()
        stub = pb_grpc.DevicePluginStub(ep.channel)
        ids = free[:count]
        if ep.options.get_preferred_allocation_available:
            pref = stub.GetPreferredAllocation(
                pb.PreferredAllocationRequest(
                    container_requests=[
                        pb.ContainerPreferredAllocationRequest(
                            available_deviceIDs=free, allocation_size=count
                        )
                    ]
                ),
                timeout=5,
            )
            ids = list(pref.container_responses[0].deviceIDs)
        resp = stub.Allocate(
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)]),
            timeout=5,
        )
        with self.cond:
            self.allocated.update(ids)
        return ids, resp.container_responses[0]
