"""The coordinator's long poll of the controller's live instance table, one loop for
every follower: a one-worker coordinator's
:class:`~motor.coordinator.endpoints.ControllerWatcher` and the feed process of a
multi-worker one (:class:`motor.coordinator.feed.Feed`).

Wire format: ``GET /v1/instances?after=<version>&timeout=<s>`` of the controller's HTTP
API, answered with an :class:`~motor.protocol.instances.InstanceTable` (JSON); see
:mod:`motor.protocol.instances` for the long-poll semantics (a version lower than
``after`` means the controller restarted: its table is taken as is). With several controllers (``controller.peers``
or a comma-separated ``--controller``) the poll goes to the leader through
:class:`motor.control_link.ControllerLink` (a follower's 307 is followed, an unreachable
controller is skipped); while none answers, the last table stays in force.
"""
from __future__ import annotations

import asyncio
import re
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import orjson

from motor.protocol.instances import InstanceTable

if TYPE_CHECKING:
    from motor.config.schema import ControlPlaneTlsConfig
    from motor.control_link import ControllerLink

logger = logging.getLogger(__name__)

#: seconds between two tries while the controller does not answer
RETRY_S = 0.5


def controller_address(url: str) -> tuple[str, int]:
    """``http(s)://HOST[:PORT]`` -> (host, port), port 80 (443 for https) by default.

    Raises
    ------
    ValueError
        for another scheme, no host or a port that is not a number.
    """
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"controller URL is expected as http://HOST:PORT or "
                         f"https://HOST:PORT, got {url!r}")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


def controller_client(urls: str, tls: ControlPlaneTlsConfig | None,
                      max_connections_per_endpoint: int, connect_timeout_s: float,
                      ) -> ControllerLink:
    """A link to the controllers at ``urls`` (comma-separated) over a new client: with
    ``controller.tls`` (``tls``) it speaks mTLS to the controllers (:mod:`motor.control_tls`),
    plain HTTP to every other endpoint (the engines' ``/v1/models``: ``link.client``).

    Raises
    ------
    ConfigError
        a scheme that does not fit ``tls`` (:func:`motor.control_tls.controller_endpoint`),
        a TLS file that is missing or does not load.
    """
    from motor.control_link import ControllerLink
    from motor.control_tls import ControlPlaneTls
    from motor.http.client import Client
    files = ControlPlaneTls(tls) if tls is not None else None
    client = Client(max_connections_per_endpoint=max_connections_per_endpoint,
                    connect_timeout_s=connect_timeout_s,
                    tls=files.client if files is not None else None)
    link = ControllerLink(urls, client, tls)
    link.tls_files = files   # re-read on change by follow_controller
    return link


async def follow_controller(link: ControllerLink,
                            on_table: Callable[[InstanceTable], None],
                            synced: asyncio.Event | None = None,
                            poll_timeout_s: float = 10.0, who: str = "") -> None:
    """Long-poll the leading controller of ``link`` for ever (until cancelled).

    ``on_table(table)`` gets the first table answered and then each one whose version
    differs from the last one passed (any difference: a lower version is a restarted
    controller). ``synced`` is set after the first answer (``on_table`` has run).
    Each poll holds at most ``poll_timeout_s`` at the controller (``timeout=``), and the
    request gives up 5 s later. A failure (no connection, a status other than 200, a
    body that is not an instance table) is logged once per outage, with the time it
    lasted once the controller answers again, and retried every ``RETRY_S`` seconds;
    the last table stays in force meanwhile. ``who``: prefix of those log lines.

    Raises
    ------
    Exception
        whatever ``on_table`` raises (the loop ends).
    """
    version: int | None = None    # of the last table passed to on_table
    down_since: float | None = None
    while True:
        path = f"/v1/instances?after={version or 0}&timeout={poll_timeout_s:g}"
        if link.tls_files is not None:   # controller.tls's files, re-read when they change
            link.tls_files.check_every(time.monotonic())
        try:
            status, body = await link.request("GET", path, None, poll_timeout_s + 5.0)
            if status != 200:
                raise ConnectionError(f"controller answered {status}")
            table = InstanceTable.model_validate(orjson.loads(body))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure: log once per outage, retry
            if down_since is None:
                down_since = time.monotonic()
                logger.warning("%sno leading controller answered (%s; controllers: %s); keeping "
                               "the last instance table (version %d) and retrying", who,
                               _describe(e), ", ".join(link.urls), version or 0)
            await asyncio.sleep(RETRY_S)
            continue
        if down_since is not None:
            logger.info("%scontroller %s reachable again after %.1f s", who, link.url,
                        time.monotonic() - down_since)
            down_since = None
        if version is None or table.version != version:
            version = table.version
            on_table(table)
        if synced is not None:
            synced.set()


__all__ = ["RETRY_S", "controller_address", "controller_client", "follow_controller"]


def _describe(e: BaseException) -> str:
    """A failure in words: the exception's kind and its message, without the transport
    objects uvloop puts in some messages (``<TCPTransport closed=True ...>``)."""
    text = re.sub(r"\s*<[A-Za-z_.]*Transport [^>]*>;?", "", str(e)).strip(" ;:") or "no detail"
    return f"{type(e).__name__}: {text}"
