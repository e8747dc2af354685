"""Every adapter and every fake implements the Protocols it claims, signatures included.

mypy checks the package's adapters against their Protocols (the ``_conforms`` functions next to
them, e.g. ``gpushare/node/nvml.py``), but not the fakes: ``tests/`` is not type-checked, and
``isinstance`` against a ``runtime_checkable`` Protocol only looks for names. This test compares,
for each class and each Protocol it claims, every member the Protocol declares:

- a method must exist with the same parameters: names, kinds (positional, keyword-only, ...)
  and defaults; it may add parameters only with defaults (a caller of the Protocol never
  passes them). Annotations are mypy's to check.
- an attribute or property must exist on the class, as a class attribute, a property, an
  annotation, or an assignment ``self.NAME = ...`` in ``__init__`` (an instance attribute).

A new adapter or fake goes into :data:`CLAIMS`; a Protocol member it lacks fails here, with the
name of the member and what differs.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Any, Protocol

import pytest

from gpushare.cli.doctor import Host
from gpushare.cli.doctor_cmd import RealHost
from gpushare.control import baselines
from gpushare.control.controller import GpushareController
from gpushare.control.policy import Policy
from gpushare.daemon.state import NoopPolicy
from gpushare.node.adopted import AdoptingPauser
from gpushare.node.base import (
    AdoptPauser,
    BatchPauser,
    Clock,
    ComputeModeControl,
    DaemonGpuBackend,
    DaemonMpsNode,
    DescribedMpsNode,
    GpuBackend,
    LatencyProbe,
    LaunchPauser,
    ManagedMpsNode,
    MpsNode,
    MultiuserInfo,
    NodePauser,
    Pauser,
    ProcessHost,
    SimulatedFlag,
    SlotHoldingProbe,
    SpawnPauser,
    TrackingPauser,
)
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.clock import SystemClock
from gpushare.node.mps.manager import MpsNodeManager
from gpushare.node.mps.supervisor import MpsSupervisor
from gpushare.node.nvml import NvmlBackend
from gpushare.node.probe_manager import ProbeManager
from gpushare.node.procs.host import HostProcesses
from gpushare.node.signal_pauser import SignalPauser
from gpushare.sim import adapters, realtime
from gpushare.sim.daemon_node import SimulatedPauser
from gpushare.sim.hybrid_mps import HybridMpsNode
from tests.fakes.fake_compute_mode import FakeComputeMode
from tests.fakes.fake_dutyprobe import DutyGpu, DutyProbe
from tests.fakes.fake_gpu import FakeGpuBackend
from tests.fakes.fake_host import FakeHost
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_pauser import FakePauser
from tests.fakes.fake_policy import FixedPolicy, ScriptedPolicy
from tests.fakes.fake_probe import FakeProbe

_NODE_PAUSER = (
    Pauser,
    BatchPauser,
    TrackingPauser,
    SpawnPauser,
    LaunchPauser,
    AdoptPauser,
    NodePauser,
)
_DAEMON_MPS = (MpsNode, ManagedMpsNode, DescribedMpsNode, DaemonMpsNode)
_DAEMON_GPU = (GpuBackend, SimulatedFlag, DaemonGpuBackend)

#: Each implementation and the Protocols it claims (the daemon holds it by the last one).
CLAIMS: list[tuple[type, tuple[type, ...]]] = [
    # Pausers: the real ones, the wrappers, the simulated ones, the fake.
    (CgroupPauser, _NODE_PAUSER),
    (SignalPauser, _NODE_PAUSER),
    (AdoptingPauser, _NODE_PAUSER),
    (SimulatedPauser, _NODE_PAUSER),
    (adapters.SimPauser, _NODE_PAUSER),
    (realtime.RealTimePauser, _NODE_PAUSER),
    (FakePauser, _NODE_PAUSER),
    # GPU backends.
    (NvmlBackend, (*_DAEMON_GPU, ComputeModeControl)),
    (FakeComputeMode, (ComputeModeControl,)),
    (adapters.SimGpuBackend, _DAEMON_GPU),
    (realtime.RealTimeGpuBackend, _DAEMON_GPU),
    (FakeGpuBackend, _DAEMON_GPU),
    (DutyGpu, _DAEMON_GPU),
    # Latency probes.
    (ProbeManager, (LatencyProbe, SlotHoldingProbe)),
    (adapters.SimLatencyProbe, (LatencyProbe,)),
    (realtime.RealTimeLatencyProbe, (LatencyProbe,)),
    (FakeProbe, (LatencyProbe, SlotHoldingProbe)),
    (DutyProbe, (LatencyProbe,)),
    # MPS.
    (MpsNodeManager, _DAEMON_MPS),
    (HybridMpsNode, _DAEMON_MPS),
    (adapters.SimMpsNode, _DAEMON_MPS),
    (realtime.RealTimeMpsNode, _DAEMON_MPS),
    (FakeMpsNode, _DAEMON_MPS),
    (MpsSupervisor, (MultiuserInfo,)),
    # Processes and clocks.
    (HostProcesses, (ProcessHost,)),
    (adapters.SimProcesses, (ProcessHost,)),
    (SystemClock, (Clock,)),
    (adapters.VirtualClock, (Clock,)),
    # Policies.
    (GpushareController, (Policy,)),
    (baselines.ExclusivePolicy, (Policy,)),
    (baselines.TimeSlicingPolicy, (Policy,)),
    (baselines.StaticSharePolicy, (Policy,)),
    (baselines.TgsPolicy, (Policy,)),
    (baselines.TallyLikePolicy, (Policy,)),
    (NoopPolicy, (Policy,)),
    (FixedPolicy, (Policy,)),
    (ScriptedPolicy, (Policy,)),
    # The doctor's host.
    (RealHost, (Host,)),
    (FakeHost, (Host,)),
]

_SKIP = {"__init__", "__class_getitem__", "__init_subclass__", "__subclasshook__"}


def protocol_members(proto: type) -> dict[str, Any]:
    """The members a Protocol declares (its own and its Protocol bases'): name -> declaration."""
    members: dict[str, Any] = {}
    for cls in reversed(proto.__mro__):
        if cls in (object, Protocol) or not getattr(cls, "_is_protocol", False):
            continue
        for name in getattr(cls, "__annotations__", {}):
            members[name] = None
        for name, value in vars(cls).items():
            if name.startswith("_") or name in _SKIP:
                continue
            members[name] = value
    return members


def _init_assigns(cls: type) -> set[str]:
    """Names ``self.NAME = ...`` (or annotated) assigns in the ``__init__`` of ``cls`` or a base."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            for t in targets:
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                ):
                    names.add(t.attr)
    return names


def _has_attribute(cls: type, name: str) -> bool:
    if any(name in vars(k) or name in getattr(k, "__annotations__", {}) for k in cls.__mro__):
        return True
    fields = getattr(cls, "__dataclass_fields__", {})
    return name in fields or name in _init_assigns(cls)


def signature_problems(proto_fn: Any, impl_fn: Any) -> list[str]:
    """How ``impl_fn`` cannot be called as the Protocol's ``proto_fn`` is (empty: it can)."""
    want = list(inspect.signature(proto_fn).parameters.values())[1:]  # without self
    have = list(inspect.signature(impl_fn).parameters.values())[1:]
    problems: list[str] = []
    by_name = {p.name: p for p in have}
    for i, p in enumerate(want):
        q = by_name.get(p.name)
        if q is None:
            if not any(h.kind is inspect.Parameter.VAR_KEYWORD for h in have):
                problems.append(f"no parameter {p.name!r}")
            continue
        if q.kind is not p.kind:
            problems.append(f"{p.name!r} is {q.kind.description}, not {p.kind.description}")
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if p.kind in positional and (i >= len(have) or have[i].name != p.name):
            problems.append(f"{p.name!r} is not parameter {i + 1}")
        if p.default is not inspect.Parameter.empty and q.default != p.default:
            problems.append(f"{p.name!r} defaults to {q.default!r}, not {p.default!r}")
    extra = [q for q in have if q.name not in {p.name for p in want}]
    for q in extra:
        if q.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if q.default is inspect.Parameter.empty:
            problems.append(f"extra parameter {q.name!r} without a default")
    return problems


def conformance_problems(cls: type, proto: type) -> list[str]:
    """Every way ``cls`` does not implement ``proto`` (empty: it does)."""
    problems: list[str] = []
    for name, decl in protocol_members(proto).items():
        if inspect.isfunction(decl):
            impl = inspect.getattr_static(cls, name, None)
            if impl is None:
                problems.append(f"{name}(): missing")
                continue
            if isinstance(impl, staticmethod | classmethod):
                impl = impl.__func__
            if not inspect.isfunction(impl):
                problems.append(f"{name}(): not a method ({type(impl).__name__})")
                continue
            problems += [f"{name}(): {p}" for p in signature_problems(decl, impl)]
        elif not _has_attribute(cls, name):
            problems.append(f"{name}: missing attribute")
    return problems


@pytest.mark.parametrize(
    ("cls", "proto"),
    [(cls, proto) for cls, protos in CLAIMS for proto in protos],
    ids=lambda x: x.__name__,
)
def test_implements_the_protocol(cls: type, proto: type) -> None:
    assert conformance_problems(cls, proto) == []


# ----------------------------------------------------------------------------- the check itself


class _Proto(Protocol):
    flag: bool

    def act(self, client_id: str, pid: int, *, owner_uid: int | None = None) -> None: ...

    @property
    def backend(self) -> str | None: ...


class _Good:
    backend = "real"

    def __init__(self) -> None:
        self.flag = True

    def act(
        self, client_id: str, pid: int, *, owner_uid: int | None = None, extra: int = 0
    ) -> None:
        pass


class _Bad:
    def act(self, client: str, pid: int, owner_uid: int | None = 5, *, more: int) -> None:
        pass


def test_the_check_accepts_a_conforming_class_and_names_what_differs() -> None:
    assert conformance_problems(_Good, _Proto) == []
    assert conformance_problems(_Bad, _Proto) == [
        "flag: missing attribute",
        "act(): no parameter 'client_id'",
        "act(): 'owner_uid' is positional or keyword, not keyword-only",
        "act(): 'owner_uid' defaults to 5, not None",
        "act(): extra parameter 'client' without a default",
        "act(): extra parameter 'more' without a default",
        "backend: missing attribute",
    ]


def test_every_protocol_of_node_base_has_an_implementation_here() -> None:
    from gpushare.node import base

    protocols = {
        obj
        for obj in vars(base).values()
        if isinstance(obj, type)
        and getattr(obj, "_is_protocol", False)
        and obj.__module__ == base.__name__
    }
    claimed = {proto for _, protos in CLAIMS for proto in protos}
    assert protocols - claimed == set()


# ----------------------------------------------------------------------------- no probing


def declared_capabilities() -> set[str]:
    """Every member name of the node Protocols and of the Policy Protocol."""
    from gpushare.node import base

    protos = [
        obj
        for obj in vars(base).values()
        if isinstance(obj, type) and getattr(obj, "_is_protocol", False)
    ]
    names = {name for proto in [*protos, Policy] for name in protocol_members(proto)}
    # Every enum has a ``name`` too (cuda-python's status codes are read by it): not a capability.
    return names - {"name"}


def capability_probes(tree: ast.AST, declared: set[str]) -> list[str]:
    """``getattr(x, "name", ...)`` / ``hasattr(x, "name")`` of a declared Protocol member."""
    found: list[str] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in declared
        ):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_module_probes_for_a_declared_capability() -> None:
    """A capability is called through its Protocol, never looked up by name (mypy sees it)."""
    declared = declared_capabilities()
    assert {
        "freeze_many",
        "request_frozen",
        "adopt",
        "supervisors",
        "offline_mps_priority",
    } <= declared
    package = Path(__file__).resolve().parent.parent / "gpushare"
    offenders = {
        str(path.relative_to(package.parent)): found
        for path in sorted(package.rglob("*.py"))
        if (found := capability_probes(ast.parse(path.read_text()), declared))
    }
    assert not offenders, f"getattr probes for capabilities the Protocols declare: {offenders}"


def test_the_probe_check_sees_a_probe() -> None:
    code = 'many = getattr(pauser, "freeze_many", None)\nx = getattr(obj, "unrelated")\n'
    assert capability_probes(ast.parse(code), {"freeze_many"}) == [
        "line 1: getattr(..., 'freeze_many')"
    ]
