"""A client's way to whichever controller leads (node managers, coordinators, ``motor ctl``).

Controllers with etcd (``controller.etcd``) elect one leader; the others answer every API
request with ``307 Temporary Redirect`` (``Location`` = the leader's URL + the same path) and
a JSON body ``{"error": {...}, "leader": "http://HOST:PORT"}``, or ``503`` with ``"leader":
null`` while no leader is known (an election is under way). :class:`ControllerLink` is given
every controller's URL (``controller.peers``, or a comma-separated ``--controller``), asks the
one that answered last, follows a leader hint at once, and tries the next URL on a connection
error or a 503 without a hint. A single controller without etcd never redirects: the link is
then a plain client of one address.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import orjson

from motor.control_tls import controller_endpoint

if TYPE_CHECKING:
    from motor.config.schema import ControlPlaneTlsConfig
    from motor.control_tls import ControlPlaneTls
    from motor.http.client import Client

#: redirects followed for one request (a leader that changes while we follow it)
MAX_HOPS = 3


def controller_urls(spec: str | Iterable[str]) -> list[str]:
    """``"http://a:1,http://b:2"`` or a list -> the URLs, blanks dropped, order kept."""
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    return [p.strip() for p in parts if p.strip()]


class NoController(ConnectionError):
    """No controller answered with a result (all unreachable, or no leader elected)."""


class ControllerLink:
    """Requests to the leading controller among ``urls``.

    Parameters
    ----------
    urls : str or list of str
        Every controller's URL (a comma-separated string is split).
    client : motor.http.client.Client
        The HTTP client to send with (its TLS context with ``controller.tls``).
    tls : ControlPlaneTlsConfig or None
        ``controller.tls``: every URL must then be ``https://``.
    field : str
        The option / field the URLs came from, for error messages.

    Raises
    ------
    ConfigError
        a URL that is not ``http(s)://HOST:PORT`` or whose scheme does not fit ``tls``; no URL.
    """

    def __init__(self, urls: str | Iterable[str], client: Client,
                 tls: ControlPlaneTlsConfig | None = None, field: str = "--controller") -> None:
        from motor.errors import ConfigError
        self.urls = controller_urls(urls)
        if not self.urls:
            raise ConfigError(f"{field}: expected at least one controller URL, got none")
        self.client = client
        self.tls = tls
        self.addrs: list[tuple[str, int]] = []
        for u in self.urls:
            host, port, https = controller_endpoint(u, tls, field)
            self.addrs.append((host, port))
            if https:
                client.use_tls(host, port)
        self.current: tuple[str, int] = self.addrs[0]
        #: the leader's URL as the last answer told it (None: not known)
        self.leader: str | None = None
        self.redirects = 0  #: leader hints followed so far (diagnostics)
        #: ``controller.tls``'s contexts when the owner keeps them current
        #: (:class:`motor.control_tls.ControlPlaneTls`); None otherwise
        self.tls_files: ControlPlaneTls | None = None

    @property
    def url(self) -> str:
        """URL of the controller asked last (the leader once one answered)."""
        host, port = self.current
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    def _follow(self, leader: str) -> tuple[str, int] | None:
        try:
            host, port, https = controller_endpoint(leader, self.tls, "leader")
        except Exception:  # noqa: BLE001 - a hint we cannot use: try the others
            return None
        if https:
            self.client.use_tls(host, port)
        return host, port

    async def request(self, method: str, path: str, body: bytes | None,
                      timeout_s: float) -> tuple[int, bytes]:
        """One request to the leader: ``(status, body)`` of the first answer that is not a
        redirect or a leaderless 503. ``timeout_s`` bounds each try.

        Raises
        ------
        NoController
            every URL failed or none knows a leader; the message says what each did.
        """
        order = [self.current] + [a for a in self.addrs if a != self.current]
        tried: list[str] = []
        #: address -> the follower that named it leader (to word a dead leader once)
        via: dict[tuple[str, int], tuple[str, int]] = {}
        hops = 0
        i = 0
        deadline = time.monotonic() + timeout_s * (len(order) + MAX_HOPS)
        while i < len(order) and time.monotonic() < deadline:
            host, port = order[i]
            try:
                if body is None:
                    status, raw = await self.client.get_json_bytes(host, port, path, timeout_s)
                else:
                    status, raw = await self.client.post_json_bytes(host, port, path, body,
                                                                    timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - unreachable: the next one
                what = f"{host}:{port}: {_describe(e)}"
                if (host, port) in via:
                    f_host, f_port = via[(host, port)]
                    what = (f"leader {host}:{port} (named by {f_host}:{f_port}, a follower): "
                            f"{_describe(e)}")
                if what not in tried:
                    tried.append(what)
                i += 1
                continue
            if status in (307, 503):
                hint = _leader_hint(raw)
                if hint is not None and hops < MAX_HOPS:
                    target = self._follow(hint[0]) if hint[0] else None
                    if target is not None and target != (host, port):
                        hops += 1
                        self.redirects += 1
                        self.leader = hint[0]
                        via.setdefault(target, (host, port))
                        order.insert(i + 1, target)
                        i += 1
                        continue
                if hint is not None:   # a follower without a leader: the next one
                    tried.append(f"{host}:{port}: no leader elected yet")
                    i += 1
                    continue
            self.current = (host, port)
            if status == 200:
                self.leader = self.url
            return status, raw
        raise NoController("; ".join(tried) or "no controller answered in time")


def _leader_hint(raw: bytes) -> tuple[str | None] | None:
    """``(leader URL or None,)`` from a follower's answer, None when the body is not one."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or "leader" not in doc:
        return None
    leader = doc["leader"]
    return (leader if isinstance(leader, str) and leader else None,)


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "no answer in time"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


__all__ = ["ControllerLink", "MAX_HOPS", "NoController", "controller_urls"]
