"""Which endpoint served each session last: the memory behind ``kv_affinity``'s session
affinity (``coordinator.kv.session``).

A session is named by the request's session header (``coordinator.kv.session.header``,
default ``x-session-id``) or, without it, by the body's ``user`` field (OpenAI's end-user
id). :class:`SessionTable` keeps, for at most ``max_sessions`` sessions, the key of the
endpoint its last request was sent to; the least recently routed session is forgotten
first, so memory is bounded (about 100 bytes a session: an int key and a reference to the
endpoint's key string). Sessions are keyed by a hash of their name (a collision costs one
request a soft credit on the wrong endpoint, nothing more).

Each worker process has its table. With ``coordinator.workers`` > 1 a worker tells the
others where it routed a named session (a ``SESSION`` record through the feed,
:mod:`motor.coordinator.rings`), and each records it in its own table: a session's next
request finds its endpoint whichever worker it reaches, once the record has arrived
(about a millisecond; a record lost to a full ring leaves that worker's entry as it was).
Among candidates of equal cost a new session starts its rotation from a stable hash of
its name (:func:`session_start`), so a new session goes to the same endpoint whichever
worker routes it.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any


def session_of(header_value: bytes | str | None, body: dict[str, Any],
               user_field: bool) -> bytes | str | None:
    """The session name of a request: the header's value when present and non-empty, else
    the body's ``user`` when ``user_field`` and it is a non-empty string, else None."""
    if header_value:
        return header_value
    if user_field:
        u = body.get("user")
        if type(u) is str and u:
            return u
    return None


def session_start(session: bytes | str) -> int:
    """A rotation start for ``session``'s request when no endpoint is remembered for it: a
    stable hash of its name (CRC-32, the same in every worker process, unlike ``hash()``),
    so among equal candidates every worker sends a new session to the same endpoint."""
    b = session.encode("utf-8", "surrogatepass") if isinstance(session, str) else session
    return zlib.crc32(b)


def _key(session: bytes | str) -> int:
    # one hash for a name whether it came as header bytes or as the body's str
    return hash(session.encode("utf-8", "surrogatepass") if isinstance(session, str) else session)


class SessionTable:
    """LRU map session -> key of the endpoint that served its last request.

    Parameters
    ----------
    max_sessions : int
        Sessions remembered (>= 1); routing one more forgets the least recently routed.

    Raises
    ------
    ValueError
        ``max_sessions < 1``.
    """

    __slots__ = ("max_sessions", "_last")

    def __init__(self, max_sessions: int) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions is expected to be >= 1, got {max_sessions}")
        self.max_sessions = max_sessions
        self._last: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def last(self, session: bytes | str) -> str | None:
        """Key of the endpoint ``session``'s last request went to (None: not remembered).
        Does not refresh the session's place in the LRU order (:meth:`routed` does)."""
        return self._last.get(_key(session))

    def routed(self, session: bytes | str, endpoint_key: str) -> None:
        """``session``'s request was sent to the endpoint ``endpoint_key``: remember it as
        the most recently routed session, forgetting the oldest beyond ``max_sessions``."""
        k = _key(session)
        last = self._last
        last[k] = endpoint_key
        last.move_to_end(k)
        while len(last) > self.max_sessions:
            last.popitem(last=False)


__all__ = ["SessionTable", "session_of", "session_start"]
