"""Who may do what through the API, and what one user sees of another user's clients.

Rights: a client's owner, root and members of ``daemon.admin_group`` may act on it
(:func:`is_privileged`); root and the admin group also have a reserve of connections and workers
on the API socket that other users cannot exhaust (:mod:`gpushare.daemon.server`).

The view of another user's client (docs/security.md, "What other users see") is what ``ps``
already shows that user and no more:

- the command line (``argv``) is shown: ``ps`` shows every process's argv on Linux unless
  ``/proc`` is mounted with ``hidepid``; where the host's ``/proc`` hides other users' processes
  the argv of another user's client is hidden too;
- the environment, the working directory and the ``--latency-from``/``--inflight-from`` URLs are
  never in any view (the registry keeps them for the launch only);
- text the daemon fetched from a client's own URL (a scrape error that quotes the endpoint's
  answer, an HTTP reason phrase) is shown to the owner, root and the admin group only: to anyone
  else the ``latency.reason`` of a client with a ``--latency-from``/``--inflight-from`` URL says
  that it is hidden, and every field named ``*_owner_only`` is ``null``;
- the rest (state, limits, GPU, user, pid, times, log path, the daemon's own reasons) is shown
  to every user, as the design's "everyone may read status" (docs/design.md D7) wants.
"""

from __future__ import annotations

import grp
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from gpushare.daemon.dispatch import Encoded, encoded
from gpushare.node.procs.users import user_in_group
from gpushare.node.procs.visibility import hides_others


class Identity(Protocol):
    """A caller as the kernel reported it (:class:`gpushare.daemon.server.Caller`)."""

    @property
    def uid(self) -> int:
        """The caller's uid."""

    @property
    def gid(self) -> int:
        """The caller's primary gid."""

    @property
    def groups(self) -> tuple[int, ...]:
        """The caller's supplementary gids (SO_PEERGROUPS)."""


class _Record(Protocol):
    """What the view needs of a client's record (:class:`gpushare.daemon.registry.ClientRecord`)."""

    @property
    def uid(self) -> int:
        """The client's owner."""

    @property
    def latency_from(self) -> str | None:
        """Its ``--latency-from`` URL."""

    @property
    def inflight_from(self) -> str | None:
        """Its ``--inflight-from`` URL."""


class _Clients(Protocol):
    """The registry's lookup of one client (:meth:`gpushare.daemon.registry.Registry.find`)."""

    def find(self, client_id: str) -> _Record | None:
        """The client's record; ``None`` when there is none."""


C = TypeVar("C", bound=Identity)


HIDDEN = "hidden: shown to its owner, root and the admin group only"
"""What another user sees in place of text that came from a client's own endpoint."""

OWNER_ONLY_SUFFIX = "_owner_only"
"""A field of a client's entry named with this suffix is shown to its owner, root and the admin
group only (others see ``null``); a poller that keeps a detail quoting its URL's answer uses it."""

OWNER_ONLY_EVENT_KINDS = frozenset(
    {"latency_source_failed", "inflight_source_failed", "latency_scrape_failed"}
)
"""Event kinds whose message quotes what a client's own endpoint answered: their message is shown
to the client's owner, root and the admin group only (the kind, time and ids stay visible)."""


def admin_gid(admin_group: str) -> int | None:
    """The gid of ``daemon.admin_group``; ``None`` when it is empty or does not exist."""
    if not admin_group:
        return None
    try:
        return grp.getgrnam(admin_group).gr_gid
    except KeyError:
        return None


def is_privileged(caller: Identity, admin_group: str, *, by_membership: bool = True) -> bool:
    """Root, or a member of ``admin_group`` (primary or supplementary group of the connection).

    Args:
        caller: the connection's identity.
        admin_group: ``daemon.admin_group`` (empty: no admin group).
        by_membership: also ask the group database whether the uid is a member (the connecting
            process may have dropped the group). The accept path passes False: the kernel's
            answer is enough there and costs no lookup per connection.
    """
    if caller.uid == 0:
        return True
    gid = admin_gid(admin_group)
    if gid is None:
        return False
    if gid == caller.gid or gid in caller.groups:
        return True
    return by_membership and user_in_group(caller.uid, admin_group)


class Viewer:
    """One request's caller, deciding what of each client it may see (rights decided once)."""

    def __init__(self, caller: Identity, admin_group: str, *, argv_hidden: bool) -> None:
        self.uid = caller.uid
        self.privileged = is_privileged(caller, admin_group)
        self.argv_hidden = argv_hidden

    def may_see(self, owner_uid: int | None) -> bool:
        """Whether the owner-only parts of a client of ``owner_uid`` are this caller's to see."""
        return self.privileged or owner_uid == self.uid

    def client(self, view: dict[str, Any], *, owner_uid: int, url_sourced: bool) -> dict[str, Any]:
        """A client's entry as this caller may see it (:func:`redact_client` for others')."""
        if self.may_see(owner_uid):
            return view
        return redact_client(view, url_sourced=url_sourced, argv_hidden=self.argv_hidden)

    def clients(
        self, entries: list[dict[str, Any]], url_sourced: Callable[[str], bool]
    ) -> list[dict[str, Any]]:
        """``status``/``list`` entries as this caller may see them (owner from each ``uid``).

        Args:
            entries: the clients of the answer, each with its ``id`` and ``uid``.
            url_sourced: whether a client id's latency or gauge comes from a URL it gave; asked
                only for other users' clients.
        """
        return [
            e
            if self.may_see(e.get("uid"))
            else redact_client(
                e, url_sourced=url_sourced(str(e.get("id"))), argv_hidden=self.argv_hidden
            )
            for e in entries
        ]

    def events(
        self, rows: list[dict[str, Any]], owner_of: Callable[[str], int | None]
    ) -> list[dict[str, Any]]:
        """``events`` rows as this caller may see them (:func:`redact_events`).

        Args:
            rows: the rows of the ``events`` answer.
            owner_of: the uid of a client id (``None``: no such client); asked only for the
                clients of owner-only events.
        """
        ids = {r.get("client_id") for r in rows if r.get("kind") in OWNER_ONLY_EVENT_KINDS}
        may_see = {i: self.may_see(owner_of(i)) for i in ids if isinstance(i, str)}
        return redact_events(rows, may_see)


def redact_client(view: dict[str, Any], *, url_sourced: bool, argv_hidden: bool) -> dict[str, Any]:
    """Another user's view of a client's ``status``/``list`` entry (see the module docstring).

    Args:
        view: the full entry; a new dict is returned and ``view`` is left as it is.
        url_sourced: the client's latency or gauge comes from a URL it gave: its ``reason`` texts
            may quote what that endpoint answered.
        argv_hidden: the host's ``/proc`` hides other users' command lines (``hidepid``).
    """
    out = _without_owner_only(view)
    latency = out.get("latency")
    if url_sourced and isinstance(latency, Mapping) and latency.get("reason") is not None:
        out["latency"] = {**latency, "reason": HIDDEN}
    if argv_hidden:
        out["argv"] = []
    return out


def _without_owner_only(view: Mapping[str, Any]) -> dict[str, Any]:
    """``view`` with every field named ``*_owner_only`` (at any depth) set to ``None``.

    The convention for the pollers' details: a field whose name ends in ``_owner_only`` may hold
    text fetched from the client's own URL, and only its owner, root and the admin group see it.
    """
    out: dict[str, Any] = {}
    for key, value in view.items():
        if key.endswith(OWNER_ONLY_SUFFIX):
            out[key] = None
        elif isinstance(value, Mapping):
            out[key] = _without_owner_only(value)
        else:
            out[key] = value
    return out


def redact_events(
    events: Iterable[Mapping[str, Any]], may_see: Mapping[str, bool]
) -> list[dict[str, Any]]:
    """Events as a viewer sees them: owner-only messages of others' clients replaced.

    Args:
        events: the rows of ``events`` as the registry gives them.
        may_see: for each client id the events name, whether the viewer may see its private
            parts (:meth:`Viewer.may_see`); a client id not in it counts as another user's.
    """
    out = []
    for e in events:
        row = dict(e)
        cid = row.get("client_id")
        if row.get("kind") in OWNER_ONLY_EVENT_KINDS and cid is not None and not may_see.get(cid):
            row["message"] = f"{row['kind']} for client {cid} ({HIDDEN})"
        out.append(row)
    return out


def as_seen(
    handler: Callable[[C, dict[str, Any]], Any],
    admin_group: Callable[[], str],
    registry: _Clients,
    *,
    shared: bool = False,
) -> Callable[[C, dict[str, Any]], Any]:
    """``handler`` (``status``, ``list``, ``events``) with its answer as the caller may see it.

    Args:
        handler: an API handler whose answer may hold ``clients`` and ``events`` lists.
        admin_group: ``daemon.admin_group`` now (a reload may change it).
        registry: where a client's owner and URLs are looked up.
        shared: the handler hands the same answer object to many callers until something changes
            (:mod:`gpushare.daemon.views`): each viewer's view of one answer is then made and
            encoded once (:class:`gpushare.daemon.dispatch.Encoded`) and sent to every request of
            that viewer until the answer is a new one.
    """
    # (id of the shared answer, who views it) -> (that answer, its encoded view). The answer is
    # kept with its view, so its id cannot be reused by another object while the entry lives.
    memo: dict[tuple[object, ...], tuple[object, Encoded]] = {}

    def url_sourced(client_id: str) -> bool:
        rec = registry.find(client_id)
        return rec is None or rec.latency_from is not None or rec.inflight_from is not None

    def owner_of(client_id: str) -> int | None:
        rec = registry.find(client_id)
        return rec.uid if rec is not None else None

    def view(answer: Any, viewer: Viewer) -> dict[str, Any]:
        # A copy: the handler's answer may be shared with other callers (daemon/views.py).
        result = dict(answer)
        if isinstance(result.get("clients"), list):
            result["clients"] = viewer.clients(result["clients"], url_sourced)
        if isinstance(result.get("events"), list):
            result["events"] = viewer.events(result["events"], owner_of)
        return result

    def seen(caller: C, params: dict[str, Any]) -> Any:
        answer = handler(caller, params)
        group, argv_hidden = admin_group(), hides_others()
        if not shared:
            return view(answer, Viewer(caller, group, argv_hidden=argv_hidden))
        # Every input of the view: the answer (a new object when anything in it may differ, the
        # registry's records included) and the viewer's identity, rights and host setting.
        key = (id(answer), caller.uid, caller.gid, caller.groups, group, argv_hidden)
        hit = memo.get(key)
        if hit is not None and hit[0] is answer:
            return hit[1]
        out = encoded(view(answer, Viewer(caller, group, argv_hidden=argv_hidden)))
        if len(memo) > 256:
            memo.clear()  # old answers' views: drop them all rather than track their ages
        memo[key] = (answer, out)
        return out

    return seen
