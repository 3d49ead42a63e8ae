"""Liveness and readiness answers of the coordinator, shared by every process that serves
them (each worker, :mod:`motor.coordinator.server`, and the feed's management API,
:mod:`motor.coordinator.feed`). Bodies are JSON (``application/json``):

* ``GET /health``, ``GET /liveness``: 200 ``{"status":"ok"}`` (:func:`health`);
* ``GET /readiness`` (:func:`readiness`): 200 ``{"status":"ready","routable_endpoints":N}``
  when some endpoint is routable and the instance table is synced, else 503
  ``{"status":"not ready","routable_endpoints":N,"instance_table_synced":BOOL}``;
  a caller may append fields of its own to both. ``motor up`` and load balancers read
  the status and ``routable_endpoints``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from motor.http.server import Request, Response

_OK = b'{"status":"ok"}'


async def health(req: Request, resp: Response) -> None:
    """A route handler (:class:`motor.http.server.Router`): 200 ``{"status":"ok"}``."""
    resp.send(200, _OK)


def readiness(resp: Response, routable: int, synced: bool, **extra: Any) -> None:
    """Send the readiness answer: 200 ``{"status":"ready","routable_endpoints":routable}``
    when ``routable > 0`` and ``synced``, else 503 ``{"status":"not ready",
    "routable_endpoints":routable,"instance_table_synced":synced}``.

    ``routable``: endpoints that would be routed to now; ``synced``: the instance table
    (or whatever this process needs before it serves) is in place. ``extra``: more fields
    (JSON-serialisable by orjson) appended to either body.
    """
    if routable > 0 and synced:
        body: dict[str, Any] = {"status": "ready", "routable_endpoints": routable}
        status = 200
    else:
        body = {"status": "not ready", "routable_endpoints": routable,
                "instance_table_synced": synced}
        status = 503
    body.update(extra)
    resp.send(status, orjson.dumps(body))


__all__ = ["health", "readiness"]
