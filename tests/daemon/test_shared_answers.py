"""``status`` and ``list`` answers shared by many callers: each viewer's view encoded once.

:func:`gpushare.daemon.rights.as_seen` with ``shared=True`` keeps, per shared answer and viewer,
the view encoded (:class:`gpushare.daemon.dispatch.Encoded`); :func:`response_line` sends it
as :func:`gpushare.protocol.encode` would have written the whole response (issue 29, "Answers
at scale").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gpushare import protocol
from gpushare.daemon import rights
from gpushare.daemon.dispatch import Caller, Dispatcher, Encoded, encoded, response_line


@dataclass(frozen=True)
class _Rec:
    uid: int
    latency_from: str | None = None
    inflight_from: str | None = None


class _Registry:
    def __init__(self) -> None:
        self.recs = {"c1": _Rec(1000, latency_from="http://x/metrics")}

    def find(self, client_id: str) -> _Rec | None:
        return self.recs.get(client_id)


def _answer(reason: str = "scrape failed: 500 secret") -> dict[str, Any]:
    client = {"id": "c1", "uid": 1000, "argv": ["train"], "latency": {"reason": reason}}
    return {"schema_version": 3, "clients": [client]}


def _decoded(result: Any) -> Any:
    assert isinstance(result, Encoded)
    return json.loads(result.json)


def test_one_encoded_view_per_viewer_and_answer():
    answers = [_answer()]
    builds = []

    def handler(caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        builds.append(caller.uid)
        return answers[-1]

    seen = rights.as_seen(handler, lambda: "", _Registry(), shared=True)
    owner, other = Caller(1, 1000, 1000), Caller(2, 2000, 2000)
    first = seen(owner, {})
    # The same answer and viewer: the same encoded view, not encoded again.
    assert seen(owner, {}) is first
    assert seen(Caller(3, 1000, 1000), {}) is first  # another connection of the same user
    assert _decoded(first)["clients"][0]["latency"]["reason"] == "scrape failed: 500 secret"
    # Another user sees its own view of the same answer: the owner-only text hidden.
    theirs = seen(other, {})
    assert theirs is not first
    assert _decoded(theirs)["clients"][0]["latency"]["reason"] == rights.HIDDEN
    assert seen(other, {}) is theirs
    # A new answer (something changed): a new view, at once.
    answers.append(_answer("scrape failed: 503"))
    assert _decoded(seen(owner, {}))["clients"][0]["latency"]["reason"] == "scrape failed: 503"
    assert _decoded(seen(other, {}))["clients"][0]["latency"]["reason"] == rights.HIDDEN
    # The shared answer itself is never changed by a view.
    assert answers[0]["clients"][0]["latency"]["reason"] == "scrape failed: 500 secret"
    assert len(builds) == 7


def test_an_answer_not_shared_is_viewed_each_time():
    seen = rights.as_seen(lambda c, p: _answer(), lambda: "", _Registry())
    out = seen(Caller(2, 2000, 2000), {})
    assert isinstance(out, dict)
    assert out["clients"][0]["latency"]["reason"] == rights.HIDDEN


def test_an_encoded_result_goes_out_as_encode_would_write_the_response():
    result = {"schema_version": 3, "clients": [{"id": "c1", "name": "é \u2028"}], "x": 1.5}
    for req_id in (None, 7, 'a"b'):
        want = protocol.encode(protocol.ok_response(req_id, result))
        assert response_line(req_id, encoded(result)) == want
        assert response_line(req_id, result) == want


def test_the_dispatcher_sends_an_encoded_result_whole():
    dispatcher = Dispatcher({"status": lambda c, p: encoded({"gpus": []})}, "test")
    line, greeted = dispatcher.handle(b'{"id":4,"method":"status"}', Caller(1, 0, 0), True)
    assert greeted
    assert json.loads(line) == {"id": 4, "result": {"gpus": []}}
    assert line.endswith(b"}\n")


def test_every_user_gets_the_one_answer_built_for_this_state():
    """48 monitors of 48 users wait for one build per tick, not 48 (daemon/views.py)."""
    from types import SimpleNamespace

    from gpushare.daemon.views import Views

    state = SimpleNamespace(
        clock=SimpleNamespace(monotonic=lambda: 1.0),
        registry=SimpleNamespace(clients=lambda: [], event_counts=lambda: {}),
        gate=SimpleNamespace(view=lambda uuid, now: None),
        samples=[],
    )
    views = Views(
        state,  # type: ignore[arg-type]
        SimpleNamespace(paused=set()),  # type: ignore[arg-type]
        SimpleNamespace(ticks=7),  # type: ignore[arg-type]
        0.0,
        SimpleNamespace(view=lambda uuid: None),  # type: ignore[arg-type]
    )
    builds: list[str | None] = []

    def build(gpu: str | None) -> dict[str, Any]:
        builds.append(gpu)
        return {"gpus": [], "clients": []}

    views._status = build  # type: ignore[method-assign]
    first = views.status(None, viewer=1000)
    assert views.status(None, viewer=2000) is first
    assert views.status(None, viewer=0) is first
    assert builds == [None]
