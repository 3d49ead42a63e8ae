"""Start an in-process coordinator in front of fake backends (standalone mode)."""
from __future__ import annotations

import asyncio
import functools
import os
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from motor.config.schema import ClusterConfig, CoordinatorConfig, Role
from motor.coordinator.endpoints import EndpointTable, StaticBackends
from motor.coordinator.policy import make_policy
from motor.coordinator.server import Coordinator
from motor.http.client import Client
from motor.http.server import HttpServer


def run_async(fn: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test body in a fresh event loop, bounded to 60 s."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        async def bounded() -> None:
            await asyncio.wait_for(fn(*args, **kwargs), 60)
        asyncio.run(bounded())
    return wrapper


def serve_until_listening(cfg: ClusterConfig, backends: list[str]) -> None:
    """Run :func:`motor.coordinator.app.serve` in this process until it listens, then stop
    it and wait for its end (bounded to 60 s)."""
    from motor.coordinator.app import serve

    async def run() -> None:
        stop = asyncio.Event()
        with tempfile.TemporaryDirectory() as d:
            ready = os.path.join(d, "ready")
            task = asyncio.ensure_future(serve(cfg, backends, stop=stop, ready_file=ready))
            while not os.path.exists(ready):
                assert not task.done(), task.exception()
                await asyncio.sleep(0.02)
        stop.set()
        await task

    asyncio.run(asyncio.wait_for(run(), 60))


class Gateway:
    def __init__(self, backends: list[tuple[Role, str, int]], probe: bool = False,
                 server_tls: Any = None, upstream_tls: Any = None, https: bool = False,
                 **cfg: Any) -> None:
        """``server_tls``: the API port's server context; ``upstream_tls`` + ``https``: the
        backends are HTTPS with that client context."""
        self.cfg = CoordinatorConfig(**cfg)
        self.client = Client(self.cfg.max_connections_per_endpoint, self.cfg.timeouts.connect_s,
                             tls=upstream_tls, pool_wait_s=self.cfg.timeouts.pool_wait_s,
                             max_idle_per_endpoint=self.cfg.max_idle_connections_per_endpoint)
        if https:
            for _role, host, port in backends:
                self.client.use_tls(host, port)
        self.server_tls = server_tls
        self.table = EndpointTable(self.client)
        self.table.set_static(backends)
        self.coord = Coordinator(self.cfg, self.table, make_policy(self.cfg.policy.value))
        self.server = HttpServer(self.coord.router, max_body_bytes=self.cfg.max_body_bytes,
                                 send_timeout_s=self.cfg.send_timeout_s)
        self.server.expect_check = self.coord.expect_check
        self.server.on_handler_error = self.coord.handler_failed
        self.probe = StaticBackends(self.table, self.cfg.health_check_interval_s,
                                    self.cfg.health_check_timeout_s, self.cfg.health_failures) \
            if probe else None
        self._task: asyncio.Task[None] | None = None
        self.port = 0

    async def start(self) -> Gateway:
        self.port = await self.server.listen("127.0.0.1", 0, tls=self.server_tls)
        if self.probe is not None:
            self._task = asyncio.ensure_future(self.probe.run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self.probe.close()  # type: ignore[union-attr]
        await self.server.shutdown(1.0)
        self.coord.close()
        self.client.close()

    def inflight(self) -> int:
        return sum(e.inflight for e in self.table.endpoints.values()) + \
            sum(e.inflight_tokens for e in self.table.endpoints.values())


async def http(port: int, method: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection with a raw HTTP/1.1 client; returns (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    h = {"host": f"127.0.0.1:{port}", "content-length": str(len(body)), "connection": "close"}
    h.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    writer.write(head.encode() + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(-1), timeout)
    writer.close()
    head_b, _, rest = raw.partition(b"\r\n\r\n")
    lines = head_b.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    if hdrs.get("transfer-encoding") == "chunked":
        out = b""
        while rest:
            size_s, _, rest = rest.partition(b"\r\n")
            size = int(size_s, 16)
            if size == 0:
                break
            out += rest[:size]
            rest = rest[size + 2:]
        rest = out
    return status, hdrs, rest
