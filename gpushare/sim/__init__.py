"""A simulated GPU node: a discrete-event, kernel-level model of GPUs shared through MPS.

The simulator runs gpushare's controller and the baselines against the same simulated node in
virtual time (``gpushare sim``), so that their effect on online latency and offline throughput can be
compared on machines without a GPU. Every modelling assumption and its source is written down in
``docs/simulator.md``.

Modules:
    data: find the shared data directory; load kernel profiles and arrival traces.
    gpu: the GPU model (SM slots, MPS caps and priority, kernels' rates, bandwidth, accounting).
    events: the event loop (virtual clock, timed callbacks, kernels' completion and wave timers).
    dispatch: who gets a GPU's free SM slots at a dispatch point, and the exact fast path.
    waves: wave ends and partial last waves, where running kernels give slots to waiting ones.
    timeslice: the default compute mode without MPS (time slices, compute preemption).
    engine: whether the compiled build of those five modules or their pure-Python source runs.
    workloads: online (open-loop requests) and offline (closed-loop training) clients.
    scenario: TOML scenario files, validated with errors that name the file and key.
    runner: runs one policy on one scenario and collects the metrics.
    gating: online services' request boundaries to the daemon's request gate, in virtual time.
    node: the node Protocols of :mod:`gpushare.node.base` implemented on the simulated node.
    report: tables, JSON and plots.
"""

from gpushare.sim import engine as _engine

#: The GPU model's implementation this process loads (see :mod:`gpushare.sim.engine`).
ENGINE = _engine.select(__path__)
