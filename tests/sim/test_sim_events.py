"""The event loop: timed callbacks and kernel completions run in (time, scheduling) order.

A kernel's completion is kept on its :class:`Run` and moved or cancelled in place
(``EventLoop.arm``/``disarm``) instead of being a heap entry; these tests check that the order
of everything that runs is the order of one queue sorted by time, then by when it was scheduled,
ties and re-arming included.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare.sim.gpu import EventLoop, Gpu, Run, Stream


class _Client:
    """Records when its kernel completes."""

    def __init__(self, name: str, log: list[tuple[str, float]], gpu: Gpu) -> None:
        self.name = name
        self.log = log
        self.gpu = gpu
        self.stream = Stream(self, name, 1, 1)

    def on_kernel_done(self, now: float) -> None:
        self.log.append((self.name, now))


def _setup(n_runs: int) -> tuple[EventLoop, Gpu, list[Run], list[tuple[str, float]]]:
    loop = EventLoop()
    gpu = Gpu(loop, uuid="GPU-e", index=0)
    log: list[tuple[str, float]] = []
    runs = []
    for i in range(n_runs):
        client = _Client(f"run{i}", log, gpu)
        gpu.attach(client)
        run = Run(client.stream, gpu, 1.0, 1, 0.25, 0, 0.0)  # wants no slots: never dispatched
        client.stream.run = run
        gpu.runs.append(run)  # holding no slots (g = 0): completing it frees none
        runs.append(run)
    return loop, gpu, runs, log


# An operation: ("at", event id, time), ("arm", run index, time) or ("disarm", run index, 0).
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("at"), st.integers(0, 99), st.sampled_from([0.5, 1.0, 1.5, 2.0])),
        st.tuples(st.just("arm"), st.integers(0, 3), st.sampled_from([0.5, 1.0, 1.5, 2.0])),
        st.tuples(st.just("disarm"), st.integers(0, 3), st.just(0.0)),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_completions_and_callbacks_run_in_time_then_scheduling_order(
    ops: list[tuple[str, int, float]],
) -> None:
    loop, _, runs, log = _setup(4)
    loop.run_until(0.0)  # the attach wake-ups
    log.clear()
    expected: dict[str, tuple[float, int]] = {}  # what should run: name -> (time, order)
    for order, (op, k, t) in enumerate(ops):
        if op == "at":
            name = f"event{k}.{order}"
            loop.at(t, lambda _, name=name: log.append((name, loop.now)))
            expected[name] = (t, order)
        elif op == "arm":
            loop.arm(runs[k].done, t)
            expected[f"run{k}"] = (t, order)  # a re-arm replaces the completion it had
        else:
            loop.disarm(runs[k].done)
            expected.pop(f"run{k}", None)
    loop.run_until(10.0)
    want = sorted(expected, key=lambda name: expected[name])
    assert [name for name, _ in log] == want
    assert [now for _, now in log] == [expected[name][0] for name in want]


def test_a_completion_moved_later_lets_an_earlier_one_go_first() -> None:
    loop, _, runs, log = _setup(2)
    loop.run_until(0.0)
    loop.arm(runs[0].done, 1.0)
    loop.arm(runs[1].done, 2.0)
    loop.arm(runs[0].done, 3.0)  # re-rated: now due after the other
    loop.run_until(2.5)
    assert log == [("run1", 2.0)]
    loop.run_until(5.0)
    assert log == [("run1", 2.0), ("run0", 3.0)]
