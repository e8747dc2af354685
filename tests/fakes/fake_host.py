"""A doctor Host whose facts are set per test."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpushare.cli.doctor import DirFacts, Probe


@dataclass
class FakeHost:
    version: tuple[int, int, int] = (3, 11, 7)
    nvml_probe: Probe = field(default_factory=lambda: Probe(True, "driver 550.54.15, 2 GPUs"))
    cuda_probe: Probe = field(
        default_factory=lambda: Probe(True, "driver 550.54.15 supports CUDA 12.4, 2 device(s)")
    )
    bindings_probe: Probe = field(
        default_factory=lambda: Probe(True, "cuda-bindings 12.9.10, needs driver >= 525.60.13")
    )
    nvrtc_probe: Probe = field(
        default_factory=lambda: Probe(True, "probe kernel compiled (3368-byte CUBIN for sm_75)")
    )
    mps_probe: Probe = field(
        default_factory=lambda: Probe(True, "/usr/bin/nvidia-cuda-mps-control")
    )
    multiuser: bool | None = True
    freezer_probe: Probe = field(default_factory=lambda: Probe(True, "/sys/fs/cgroup (writable)"))
    inflight_probe: Probe = field(
        default_factory=lambda: Probe(True, "/opt/gs/gpushare/native/libgpushare_inflight.so")
    )
    dirs: dict[Path, DirFacts] = field(default_factory=dict)
    booted_systemd: bool = True
    asked_binary: list[str] = field(default_factory=list)
    untrusted_files: dict[Path, str] = field(default_factory=dict)
    package_probe: Probe = field(
        default_factory=lambda: Probe(True, "/opt/gs/gpushare (root's, not writable by others)")
    )

    def python_version(self) -> tuple[int, int, int]:
        return self.version

    def nvml(self) -> Probe:
        return self.nvml_probe

    def cuda_driver(self) -> Probe:
        return self.cuda_probe

    def cuda_bindings(self) -> Probe:
        return self.bindings_probe

    def nvrtc(self) -> Probe:
        return self.nvrtc_probe

    def mps_binary(self, name: str) -> Probe:
        self.asked_binary.append(name)
        return self.mps_probe

    def mps_multiuser(self, name: str) -> bool | None:
        return self.multiuser

    def inflight_bound(self) -> Probe:
        return self.inflight_probe

    def package(self) -> Probe:
        return self.package_probe

    def cgroup_freezer(self) -> Probe:
        return self.freezer_probe

    def directory(self, path: Path) -> DirFacts:
        return self.dirs.get(path, DirFacts(True, True, False))

    def systemd(self) -> bool:
        return self.booted_systemd

    def untrusted(self, path: Path, what: str) -> str | None:
        return self.untrusted_files.get(path)
