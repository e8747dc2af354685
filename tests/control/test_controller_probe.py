"""gpushare's controller: the probe yields to app latency while the app SLOs have room, and keeps
its say where it must (hard ratio, an online client without latency reports).
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.support.observations import GPU, observation, offline, online, with_p99
from gpushare.control.controller import GpushareController, GpuState
from gpushare.model import SetDuty
from tests.support.controller_steps import CFG

# Scenarios and properties: the probe yields to app latency while the app SLOs have room -------


def _after_quiet(app_quiet: float, duty: float = 1.0) -> GpuState:
    """A GPU whose online work was measured alone at ``app_quiet`` x its SLO, running at ``duty``."""
    state = GpushareController(CFG).initial_state(GPU, 0.0)
    return replace(state, duty=duty, duty_emitted=duty, app_quiet_signals=((0.0, app_quiet),))


def test_probe_yields_to_app_latency_when_the_app_slo_has_room() -> None:
    ctl = GpushareController(CFG)
    # The probe at 1.03x its SLO: a violation on its own, under cut_ratio (1.05), so the duty
    # halves (at 1.05x and over it would be cut to 0 at once, test_a_clear_breach_cuts_at_once).
    probe_over = CFG.probe_slo_ratio * 1.03
    calm = observation((online(p99_ms=20.0), offline()), probe_ratio=probe_over)  # app at 0.5x
    # Online alone at 0.5x its SLO and at 0.5x now: the probe yields, the duty holds at 1 (the
    # app signal is comfortable, so after the usual wait it would even grow).
    state, actions = ctl.step(_after_quiet(0.5), calm, 0.1)
    assert state.duty == 1.0 and not [a for a in actions if isinstance(a, SetDuty)]
    assert state.violation_ticks == 0
    # A tight SLO (online alone at 0.9x its SLO): the probe is in charge, the duty halves.
    state, actions = ctl.step(_after_quiet(0.9), calm, 0.1)
    (set_duty,) = [a for a in actions if isinstance(a, SetDuty)]
    assert set_duty.duty == 0.5 and "probe ratio" in set_duty.reason
    # App latency near its SLO (0.85x): the probe is the early warning again.
    state, _ = ctl.step(_after_quiet(0.5), with_p99(calm, 34.0), 0.1)
    assert state.duty == 0.5
    # An online client that reports no latency: only the probe sees it, so it stays in charge.
    blind = observation(
        (online(p99_ms=20.0), online("on2", p99_ms=None), offline()), probe_ratio=probe_over
    )
    state, _ = ctl.step(_after_quiet(0.5), blind, 0.1)
    assert state.duty == 0.5
    # No quiet measurement of the app yet: the probe is in charge.
    state, _ = ctl.step(ctl.initial_state(GPU, 0.0), calm, 0.1)
    assert state.duty == 0.5
    # At the hard ratio the probe freezes offline work whatever the app says.
    severe = observation(
        (online(p99_ms=20.0), offline()), probe_ratio=CFG.probe_slo_ratio * CFG.hard_ratio
    )
    state, actions = ctl.step(_after_quiet(0.5), severe, 0.1)
    assert state.duty == 0.0
    assert "hard ratio" in next(a.reason for a in actions if isinstance(a, SetDuty))


def test_a_probe_over_its_slo_alone_yields_to_app_latency_past_the_hard_ratio() -> None:
    # An LLM server with a batch always in flight: the probe waits behind the server's own
    # kernels and reads over its SLO with offline work quiet (1.8x here), with spikes of 10-80x
    # behind a long prefill. Such a reading says nothing of offline work, even at hard_ratio:
    # where the app SLOs have room, app latency decides (a 2x SLO at 30 % load: the freezes it
    # forced halved the trainer's duty, 0.405 -> 0.476 of its speed alone without them).
    ctl = GpushareController(CFG)
    spike = CFG.probe_slo_ratio * CFG.hard_ratio * 4.0
    calm = observation((online(p99_ms=20.0), offline()), probe_ratio=spike)  # app at 0.5x
    saturated = replace(_after_quiet(0.5), quiet_signals=((0.0, 1.8),))
    state, actions = ctl.step(saturated, calm, 0.1)
    assert state.duty == 1.0 and not [a for a in actions if isinstance(a, SetDuty)]
    # A probe under its SLO alone keeps its hard-ratio freeze: the spike is offline work's.
    quiet_probe = replace(_after_quiet(0.5), quiet_signals=((0.0, 0.7),))
    state, _ = ctl.step(quiet_probe, calm, 0.1)
    assert state.duty == 0.0
    # App latency near its SLO, or an online client without reports: the probe counts.
    state, _ = ctl.step(saturated, with_p99(calm, 34.0), 0.1)
    assert state.duty == 0.0
    silent = observation(
        (online(p99_ms=20.0), online("on2", p99_ms=None), offline()), probe_ratio=spike
    )
    state, _ = ctl.step(saturated, silent, 0.1)
    assert state.duty == 0.0


def test_yielding_probe_is_named_in_the_duty_reason() -> None:
    ctl = GpushareController(CFG)
    calm = observation((online(p99_ms=20.0), offline()), probe_ratio=CFG.probe_slo_ratio * 1.2)
    state = _after_quiet(0.5, duty=0.0)
    for i in range(CFG.increase_after_ticks):
        state, actions = ctl.step(state, calm, 0.1 * (i + 1))
    (set_duty,) = [a for a in actions if isinstance(a, SetDuty)]
    assert set_duty.duty == CFG.duty_increase_step
    assert "yields to app latency" in set_duty.reason and "0.50x" in set_duty.reason


@settings(max_examples=150, deadline=None)
@given(
    app_quiet=st.floats(0.01, 2.0),
    app_now=st.lists(st.floats(0.01, 3.0), min_size=1, max_size=3),
    probe_norm=st.floats(0.0, 5.0),
    duty=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    blind=st.booleans(),
)
def test_the_probe_keeps_its_say_when_it_must(
    app_quiet: float, app_now: list[float], probe_norm: float, duty: float, blind: bool
) -> None:
    # Whatever the app SLOs leave: a probe at or over the hard ratio freezes offline work; with
    # an online client that reports no latency, a probe over the violation ratio cuts the duty
    # (the probe is the only signal that covers that client); so does an app over its SLO.
    ctl = GpushareController(CFG)
    clients = [online(f"on{i}", p99_ms=v * 40.0) for i, v in enumerate(app_now)]
    if blind:
        clients.append(online("silent", p99_ms=None))
    obs = observation((*clients, offline()), probe_ratio=probe_norm * CFG.probe_slo_ratio)
    state, _ = ctl.step(_after_quiet(app_quiet, duty), obs, 0.1)
    if probe_norm >= CFG.hard_ratio:
        assert state.duty == 0.0
    if (blind and probe_norm > CFG.violation_ratio) or max(app_now) > CFG.violation_ratio:
        assert state.duty < duty or duty == 0.0
