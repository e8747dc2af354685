"""Online latency signals of one GPU, normalised so that 1.0 means "exactly at the SLO".

Every policy reads the same numbers: each online client's app-reported p99 over its declared SLO
(``p99_ms / slo_p99_ms``; for an LLM server the worst of that and its TTFT and TPOT p99s over their
SLOs, :func:`client_signal`) and the probe's latency ratio over its own SLO
(``probe.ratio / control.probe_slo_ratio``). A signal that cannot be computed (no SLO declared, no
report yet, no probe reading) is left out rather than guessed; :class:`Signals` says which were
missing so a policy can explain why it held still.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare.model import ClientView, Observation


@dataclass(frozen=True, slots=True)
class Signals:
    """The normalised online signals of one observation.

    Attributes:
        worst: the largest normalised signal, ``None`` when no signal could be computed.
        worst_source: what produced ``worst`` (``"probe"`` or ``"client <id>"``), for reasons.
        count: how many signals were computed.
        online: how many live online clients the GPU has.
        app_worst: the largest app-reported signal alone (``None``: no online client reports).
        app_source: what produced ``app_worst``.
        app_complete: every live online client declares an SLO and reports a p99 (there is at
            least one): app latency then covers all the online work of the GPU.
        probe: the probe's normalised signal (``None``: no reading or no online client).
    """

    worst: float | None
    worst_source: str
    count: int
    online: int
    app_worst: float | None = None
    app_source: str = ""
    app_complete: bool = False
    probe: float | None = None

    def describe(self) -> str:
        """A short human phrase for action reasons: ``"probe at 1.73x its SLO"``."""
        if self.worst is None:
            return "no online latency signal"
        return f"{self.worst_source} at {self.worst:.2f}x its SLO"


def online_signals(observation: Observation, probe_slo_ratio: float) -> Signals:
    """Normalise every online latency signal of one GPU observation.

    Args:
        observation: the GPU's observation for this tick.
        probe_slo_ratio: the probe's SLO as a multiple of its baseline (``control.probe_slo_ratio``).

    Returns:
        The worst signal and where it came from. The probe counts only while an online client is
        live: with no online client there is nothing to protect.
    """
    online = observation.online()
    worst: float | None = None
    source = ""
    count = 0
    for client in online:
        found = client_signal(client)
        if found is None:
            continue
        value, what = found
        count += 1
        if worst is None or value > worst:
            worst, source = value, f"client {client.client_id} {what}"
    app_worst, app_source, app_count = worst, source, count
    ratio = observation.probe.ratio
    probe: float | None = None
    if online and ratio is not None:
        probe = ratio / probe_slo_ratio
        count += 1
        if worst is None or probe > worst:
            worst, source = probe, f"probe ratio {ratio:.2f}"
    return Signals(
        worst=worst,
        worst_source=source,
        count=count,
        online=len(online),
        app_worst=app_worst,
        app_source=app_source,
        app_complete=bool(online) and app_count == len(online),
        probe=probe,
    )


def client_signal(client: ClientView) -> tuple[float, str] | None:
    """One online client's worst ratio of observed p99 over SLO, across the SLOs it declares.

    A request p99 (``--slo-p99``), an LLM server's time to first token (``--slo-ttft-p99``) and
    time per output token (``--slo-tpot-p99``): the controller protects whichever a service has
    by taking the worst of them as the client's one signal (docs/controller.md, "LLM servers").
    An SLO without a p99 yet is left out; ``None`` when none can be computed.

    Returns:
        The ratio and what produced it (``"p99 41.0ms"``, ``"TTFT p99 612.0ms"``).
    """
    best: tuple[float, str] | None = None
    for label, observed, slo in (
        ("p99", client.p99_ms, client.slo_p99_ms),
        ("TTFT p99", client.ttft_p99_ms, client.slo_ttft_p99_ms),
        ("TPOT p99", client.tpot_p99_ms, client.slo_tpot_p99_ms),
    ):
        if slo is None or observed is None or slo <= 0:
            continue
        value = observed / slo
        if best is None or value > best[0]:
            best = value, f"{label} {observed:.1f}ms"
    return best


def free_memory_bytes(observation: Observation) -> int | None:
    """Free GPU memory of an observation, derived from total and used when free is missing."""
    sample = observation.sample
    if sample.mem_free_bytes is not None:
        return sample.mem_free_bytes
    if sample.mem_total_bytes is not None and sample.mem_used_bytes is not None:
        return max(0, sample.mem_total_bytes - sample.mem_used_bytes)
    return None
