"""The controller's HTTP API (see :mod:`motor.protocol.instances` for the contract).

Library use (in-process, e.g. from ``motor up`` or a test)::

    server = ControllerServer(config.controller)
    port = await server.start()          # host/port default to the config; port=0 = any
    ...
    await server.stop()

or blocking, with SIGTERM / SIGINT handling: :func:`run_controller`.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from motor.http.server import ListenError, bind_error_reason  # noqa: F401
from motor.config.schema import ControllerConfig
from motor.control_tls import server_context
from motor.controller.registry import Clock, Registry, RegistryConflict, Transition
from motor.http import HttpServer, Request, Response, Router, install_uvloop
from motor.protocol.instances import Heartbeat, InstanceState, NodeRegistration
from motor.protocol.openai import error_body

logger = logging.getLogger(__name__)

_JSON = b"application/json"


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.instances = Gauge("motor_controller_instances", "instances by state", ["state"],
                               registry=r)
        self.version = Gauge("motor_controller_table_version", "version of the instance table",
                             registry=r)
        self.nodes = Gauge("motor_controller_nodes", "registered nodes", registry=r)
        self.watchers = Gauge("motor_controller_watchers", "long polls waiting now", registry=r)
        self.registrations = Counter("motor_controller_registrations", "node registrations",
                                     registry=r)
        self.deregistrations = Counter("motor_controller_deregistrations",
                                       "node deregistrations", registry=r)
        self.heartbeats = Counter("motor_controller_heartbeats", "heartbeats received",
                                  ["known"], registry=r)
        self.transitions = Counter("motor_controller_transitions",
                                   "instance state transitions by new state", ["state"], registry=r)

    def on_transitions(self, changes: list[Transition]) -> None:
        for t in changes:
            self.transitions.labels(t.new.value).inc()


def _bad(resp: Response, status: int, message: str) -> None:
    resp.send(status, error_body(status, message))


class ControllerServer:
    """Registry + HTTP API + the timeout checker.

    Parameters
    ----------
    config : ControllerConfig
    clock : callable
        Monotonic clock for the registry (tests inject one).
    """

    def __init__(self, config: ControllerConfig, clock: Clock = time.monotonic) -> None:
        self.config = config
        self.registry = Registry(config.heartbeat_timeout_s, config.remove_after_s, clock,
                                 initial_version=int(time.time() * 1000))
        self.metrics = _Metrics()
        self.registry.listeners.append(self.metrics.on_transitions)
        self._http = HttpServer(self._route())
        #: mTLS with ``controller.tls`` (raises ConfigError naming a bad file)
        self._tls = server_context(config.tls) if config.tls is not None else None
        self._checker: asyncio.Task[None] | None = None
        self._table_bytes: tuple[int, bytes] = (-1, b"")
        self._watchers = 0
        self.port: int | None = None
        self.host = config.host

    # -------------------------------------------------------------- lifecycle
    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Listen (``port=0``: any free port) and start the timeout checker; returns the port."""
        self.host = host if host is not None else self.config.host
        want = self.config.port if port is None else port
        try:
            self.port = await self._http.listen(self.host, want, tls=self._tls)
        except OSError as e:
            raise ListenError(self.host, want, e) from e
        self._checker = asyncio.create_task(self._check_loop())
        logger.info("controller listening on %s (heartbeat timeout %gs, remove after %gs%s)",
                    self.url, self.config.heartbeat_timeout_s, self.config.remove_after_s,
                    ", mTLS: client certificates signed by controller.tls.ca_file"
                    if self._tls is not None else "")
        return self.port

    async def stop(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            try:
                await self._checker
            except asyncio.CancelledError:
                pass
            self._checker = None
        await self._http.shutdown(drain_timeout_s=0.5)
        logger.info("controller stopped")

    @property
    def url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def _check_loop(self) -> None:
        period = max(0.05, min(1.0, self.config.heartbeat_timeout_s / 10))
        while True:
            await asyncio.sleep(period)
            try:
                self.registry.check()
            except Exception:  # pragma: no cover - a bug; keep the controller alive
                logger.exception("timeout check failed")

    # ----------------------------------------------------------------- routes
    def _route(self) -> Router:
        r = Router()
        r.add("POST", "/v1/nodes/register", self._register)
        r.add("POST", "/v1/nodes/heartbeat", self._heartbeat)
        r.add("POST", "/v1/nodes/deregister", self._deregister)
        r.add("GET", "/v1/instances", self._instances)
        r.add("GET", "/v1/nodes", self._nodes)
        r.add("GET", "/health", self._health)
        r.add("GET", "/readiness", self._health)
        r.add("GET", "/metrics", self._metrics)
        return r

    async def _register(self, req: Request, resp: Response) -> None:
        try:
            reg = NodeRegistration.model_validate_json(req.body)
        except ValidationError as e:
            return _bad(resp, 400, f"invalid registration: {_first_error(e)}")
        try:
            version = self.registry.register(reg)
        except RegistryConflict as e:
            return _bad(resp, 409, str(e))
        self.metrics.registrations.inc()
        resp.send(200, orjson.dumps({"version": version}))

    async def _heartbeat(self, req: Request, resp: Response) -> None:
        try:
            hb = Heartbeat.model_validate_json(req.body)
        except ValidationError as e:
            return _bad(resp, 400, f"invalid heartbeat: {_first_error(e)}")
        known, version = self.registry.heartbeat(hb)
        self.metrics.heartbeats.labels("true" if known else "false").inc()
        if not known:
            logger.info("heartbeat from unknown node %s: asking it to register", hb.node)
        resp.send(200, orjson.dumps({"known": known, "version": version}))

    async def _deregister(self, req: Request, resp: Response) -> None:
        try:
            body = orjson.loads(req.body or b"null")
        except orjson.JSONDecodeError as e:
            return _bad(resp, 400, f"invalid JSON body: {e}")
        if not isinstance(body, dict) or not isinstance(body.get("node"), str):
            return _bad(resp, 400, 'expected {"node": str}')
        known, version = self.registry.deregister(body["node"])
        if known:
            self.metrics.deregistrations.inc()
        resp.send(200, orjson.dumps({"known": known, "version": version}))

    async def _instances(self, req: Request, resp: Response) -> None:
        q = req.query_params()
        after: int | None = None
        timeout = self.config.watch_timeout_s
        try:
            if "after" in q:
                after = int(q["after"])
            if "timeout" in q:
                timeout = float(q["timeout"])
        except ValueError:
            return _bad(resp, 400, "after must be an integer and timeout a number of seconds")
        timeout = max(0.0, min(timeout, self.config.watch_timeout_s))
        self._watchers += 1
        try:
            table = await self.registry.wait(after, timeout)
        finally:
            self._watchers -= 1
        if self._table_bytes[0] != table.version:
            self._table_bytes = (table.version, table.model_dump_json().encode())
        resp.send(200, self._table_bytes[1])

    async def _nodes(self, req: Request, resp: Response) -> None:
        resp.send(200, orjson.dumps({"version": self.registry.version,
                                     "nodes": self.registry.nodes()}))

    async def _health(self, req: Request, resp: Response) -> None:
        resp.send(200, b'{"status":"ok"}')

    async def _metrics(self, req: Request, resp: Response) -> None:
        m = self.metrics
        for state, n in self.registry.counts().items():
            m.instances.labels(state.value).set(n)
        m.instances.labels(InstanceState.REMOVED.value).set(0)
        m.version.set(self.registry.version)
        m.nodes.set(len(self.registry.nodes()))
        m.watchers.set(self._watchers)
        resp.send(200, generate_latest(m.registry), content_type=CONTENT_TYPE_LATEST.encode())


def _first_error(e: ValidationError) -> str:
    """``field.path: what was expected (got <the value received>)`` of the first error."""
    errs = e.errors()
    if not errs:
        return str(e)
    err = errs[0]
    loc = ".".join(str(p) for p in err["loc"]) or "(body)"
    # the input of a missing field, a bad JSON document or a whole-object check is the
    # enclosing object or the body: not worth repeating
    if err["type"] in ("missing", "json_invalid", "value_error", "assertion_error"):
        return f"{loc}: {err['msg']}"
    got = repr(err.get("input"))
    if len(got) > 80:
        got = got[:77] + "..."
    return f"{loc}: {err['msg']} (got {got})"


async def serve_controller(config: ControllerConfig, host: str | None = None,
                           port: int | None = None, stop: asyncio.Event | None = None) -> None:
    """Run a controller until ``stop`` is set (or forever)."""
    server = ControllerServer(config)
    await server.start(host, port)
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await server.stop()


def run_controller(config: ControllerConfig, host: str | None = None, port: int | None = None) -> int:
    """Blocking entry point: uvloop, SIGTERM/SIGINT -> clean stop, returns exit status 0."""
    install_uvloop()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_controller(config, host, port, stop)

    asyncio.run(main())
    return 0
