"""The controller's HTTP API (see :mod:`motor.protocol.instances` for the contract).

With ``controller.etcd`` the controller is one of several (:mod:`motor.controller.ha`): only
the leader serves the API; a follower answers every API request with ``307`` (``Location``:
the leader's URL and the same path; body ``{"error": ..., "leader": URL}``), or ``503`` with
``"leader": null`` while none is known. ``/health``, ``/readiness``, ``/metrics``,
``/v1/leader`` and ``/openapi.json`` answer on every controller. The leader writes every change
of the registry to etcd in one fenced transaction before it answers the request that made it
(a write that fails because etcd is unreachable is retried by the timeout checker while the
lease lasts; one that fails the fence deposes the leader).

Lifecycle: ``POST /v1/instances/{id}/{drain|stop|start|restart}`` (body optional: ``{"drain":
bool, "timeout_s": s, "grace_s": s}``) is forwarded to the node manager's management API,
then the instance's state is set (:meth:`~motor.controller.registry.Registry.act`).

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
from urllib.parse import quote, unquote

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from motor.http.server import ListenError, bind_error_reason  # noqa: F401
from motor.config.schema import ControllerConfig
from motor.control_tls import ControlPlaneTls
from motor.controller import engine_metrics, page
from motor.controller.ha import Leadership
from motor.controller.registry import (ACTIONS, Clock, Registry, RegistryConflict, Transition,
                                      UnknownInstance)
from motor.http import Client, HttpServer, Request, Response, Router, install_uvloop
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
        self.is_leader = Gauge("motor_controller_is_leader",
                               "1 while this controller leads (always 1 without etcd)", registry=r)
        self.leader_changes = Counter("motor_controller_leader_changes",
                                      "leaders seen by this controller (its own elections "
                                      "included)", registry=r)
        self.etcd_up = Gauge("motor_controller_etcd_reachable",
                             "by etcd member: 1 when the last request sent to it succeeded, 0 "
                             "when it failed (members not tried yet are absent; absent "
                             "without etcd)", ["endpoint"], registry=r)
        self.etcd_writes = Counter("motor_controller_etcd_writes",
                                   "fenced registry writes to etcd by result (ok, fenced, "
                                   "unavailable)", ["result"], registry=r)
        self.actions = Counter("motor_controller_lifecycle_actions",
                               "operator actions by action and result (ok, refused, unreachable)",
                               ["action", "result"], registry=r)

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

    def __init__(self, config: ControllerConfig, clock: Clock = time.monotonic,
                 advertise_host: str | None = None) -> None:
        self.config = config
        self.clock = clock
        self.metrics = _Metrics()
        self.registry = self._new_registry()
        self._http = HttpServer(self._route())
        #: mTLS with ``controller.tls`` (raises ConfigError naming a bad file); the files are
        #: re-read when they change (:meth:`reload_tls`)
        self.tls_files = ControlPlaneTls(config.tls) if config.tls is not None else None
        self._tls = self.tls_files.server if self.tls_files is not None else None
        #: to the node managers' management APIs (lifecycle), mTLS with ``controller.tls``
        self._nm_client = Client(connect_timeout_s=2.0, tls=self.tls_files.client
                                 if self.tls_files is not None else None)
        self._checker: asyncio.Task[None] | None = None
        self._table_bytes: tuple[int, bytes] = (-1, b"")
        self._watchers = 0
        self.port: int | None = None
        self.host = config.host
        self.advertise_host = advertise_host or config.advertise_host
        #: leader election with ``controller.etcd`` (created at :meth:`start`, once the URL
        #: is known)
        self.ha: Leadership | None = None
        self._flush_lock = asyncio.Lock()
        #: the engines' /metrics scraper (made on the first /metrics/engines or /v1/engines)
        self._engines: engine_metrics.EngineScraper | None = None
        #: drains of spanning instances under way (kept referenced until done)
        self._drains: set[asyncio.Task[None]] = set()

    def _new_registry(self) -> Registry:
        reg = Registry(self.config.heartbeat_timeout_s, self.config.remove_after_s, self.clock,
                       initial_version=int(time.time() * 1000),
                       warmup_s=0.0 if self.config.etcd is not None else None)
        reg.listeners.append(self.metrics.on_transitions)
        return reg

    @property
    def leading(self) -> bool:
        """True when this controller serves the API (always without etcd): elected, and its
        registry restored from etcd (:attr:`Leadership.serves`)."""
        return self.ha is None or self.ha.serves

    # -------------------------------------------------------------- lifecycle
    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Listen (``port=0``: any free port) and start the timeout checker; returns the port."""
        self.host = host if host is not None else self.config.host
        want = self.config.port if port is None else port
        try:
            self.port = await self._http.listen(self.host, want, tls=self._tls)
        except OSError as e:
            raise ListenError(self.host, want, e) from e
        if self.config.etcd is not None:
            self.ha = Leadership(self.config.etcd, self.url, self._on_elected, self._on_deposed)
            self.ha.start()
            logger.info("controller %s: etcd %s (prefix %s, lease TTL %d s): campaigning",
                        self.url, ", ".join(self.config.etcd.endpoints),
                        self.config.etcd.prefix, self.config.etcd.lease_ttl_s)
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
        for t in list(self._drains):
            t.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)
        if self.ha is not None:
            if self.ha.is_leader:
                try:   # what the last requests changed, before the lease goes
                    await asyncio.wait_for(self._persist(), 1.0)
                except Exception as e:  # noqa: BLE001 - the next leader re-learns from heartbeats
                    logger.info("controller %s: last write to etcd failed: %s", self.url, e)
            await self.ha.stop()
        await self._http.shutdown(drain_timeout_s=0.5)
        self._nm_client.close()
        logger.info("controller stopped")

    @property
    def url(self) -> str:
        """This controller's URL as others reach it (``advertise_host``, else the listen
        host; a wildcard listen host without an advertise host gives 127.0.0.1)."""
        scheme = "https" if self._tls is not None else "http"
        host = self.advertise_host or self.host
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        return f"{scheme}://{host}:{self.port}"

    def reload_tls(self, force: bool = False) -> bool:
        """Re-read ``controller.tls``'s files if they changed (``force``: whatever; SIGHUP);
        True when new material is in use."""
        return self.tls_files.check(force) if self.tls_files is not None else False

    async def _check_loop(self) -> None:
        period = max(0.05, min(1.0, self.config.heartbeat_timeout_s / 10))
        # the lease's validity by this clock (Leadership.is_leader), not `leading`: a leader
        # re-elected between two turns is not serving yet during its takeover, and that
        # must not read as its lease running out
        held = self.ha is not None and self.ha.is_leader
        while True:
            await asyncio.sleep(period)
            if self.tls_files is not None:
                self.tls_files.check_every(time.monotonic())
            lead = self.leading
            self.metrics.is_leader.set(1 if lead else 0)
            now_held = self.ha is not None and self.ha.is_leader
            if self.ha is not None and held and not now_held:
                self.ha.step_down("lease no longer valid by this controller's clock")
            held = now_held
            if not lead:
                continue
            try:
                self.registry.check()
                await self._persist()
            except Exception as e:  # noqa: BLE001 - logged; keep the controller alive
                logger.debug("timeout check / etcd write failed: %s", e)

    # ------------------------------------------------------------------- HA
    async def _on_elected(self) -> None:
        """Leader now: rebuild the registry from what the last leader wrote."""
        from motor.controller.etcd_store import load_state
        assert self.ha is not None
        version, records = await load_state(self.ha.session)
        reg = self._new_registry()
        reg.restore(records, version)
        old, self.registry = self.registry, reg
        old.wake()
        self.metrics.leader_changes.inc()
        self.metrics.is_leader.set(1)
        logger.info("controller %s: leading with %d node(s) from etcd (version %d)", self.url,
                    len(records), reg.version)

    def _on_deposed(self, reason: str) -> None:
        old, self.registry = self.registry, self._new_registry()
        old.wake()   # long polls answer (with a redirect) instead of holding
        self.metrics.is_leader.set(0)

    async def _persist(self) -> None:
        """Write the nodes changed since the last write, in one fenced transaction.

        Raises
        ------
        NotLeader
            the fence failed: this controller stepped down.
        EtcdUnavailable
            no etcd member answered; the changes are kept for the next write.
        """
        if self.ha is None:
            return
        from motor.controller.etcd_store import EtcdUnavailable, NotLeader, fenced_write
        async with self._flush_lock:
            reg = self.registry
            dirty = reg.take_dirty()
            token = self.ha.token
            if not dirty or token is None:
                return
            puts, deletes = [], []
            for name in sorted(dirty):
                rec = reg.node_record(name)
                if rec is None:
                    deletes.append(name)
                else:
                    puts.append((name, rec))
            try:
                await fenced_write(self.ha.session, token, reg.version, puts, deletes)
            except NotLeader:
                self.metrics.etcd_writes.labels("fenced").inc()
                self.ha.step_down("a fenced write failed: another controller leads")
                raise
            except EtcdUnavailable:
                self.metrics.etcd_writes.labels("unavailable").inc()
                reg.mark_dirty(dirty)
                raise
            self.metrics.etcd_writes.labels("ok").inc()

    async def _persisted(self, resp: Response) -> bool:
        """Persist after a change; False (and a redirect / 503 sent) when no longer leader."""
        from motor.controller.etcd_store import EtcdUnavailable, NotLeader
        try:
            await self._persist()
        except NotLeader:
            self._redirect(None, resp)
            return False
        except EtcdUnavailable:
            pass   # kept dirty; retried by the checker while the lease lasts
        return True

    def _follower(self, req: Request | None, resp: Response) -> bool:
        """Answer for the leader when this controller does not lead; True if it answered."""
        if self.leading:
            return False
        self._redirect(req, resp)
        return True

    def _redirect(self, req: Request | None, resp: Response) -> None:
        leader = self.ha.leader_url if self.ha is not None else None
        if leader is not None and leader != self.url and req is not None:
            target = leader + req.path + (f"?{req.query}" if req.query else "")
            body = error_body(307, f"this controller follows; the leader is {leader}")
            resp.send(307, _with_leader(body, leader, "RedirectToLeader"),
                      headers=((b"location", target.encode()),))
            return
        body = error_body(503, "no controller leads at the moment (an election is under way "
                               "or etcd is unreachable); retry")
        resp.send(503, _with_leader(body, None), headers=((b"retry-after", b"1"),))

    # ----------------------------------------------------------------- routes
    def _route(self) -> Router:
        r = Router()
        r.add("POST", "/v1/nodes/register", self._register)
        r.add("POST", "/v1/nodes/heartbeat", self._heartbeat)
        r.add("POST", "/v1/nodes/deregister", self._deregister)
        r.add("GET", "/v1/instances", self._instances)
        r.add_prefix("POST", "/v1/instances/", self._lifecycle)
        r.add("GET", "/v1/nodes", self._nodes)
        r.add("GET", "/v1/leader", self._leader)
        r.add("GET", "/openapi.json", self._openapi)
        r.add("GET", "/health", self._health)
        r.add("GET", "/readiness", self._readiness)
        r.add("GET", "/metrics", self._metrics)
        r.add("GET", "/metrics/engines", self._engine_metrics)
        r.add("GET", "/v1/engines", self._engine_summary)
        r.add("GET", "/cluster", self._cluster_page)
        return r

    async def _register(self, req: Request, resp: Response) -> None:
        if self._follower(req, resp):
            return
        try:
            reg = NodeRegistration.model_validate_json(req.body)
        except ValidationError as e:
            return _bad(resp, 400, f"invalid registration: {_first_error(e)}")
        try:
            version = self.registry.register(reg)
        except RegistryConflict as e:
            return _bad(resp, 409, str(e))
        if not await self._persisted(resp):
            return
        self.metrics.registrations.inc()
        resp.send(200, orjson.dumps({"version": version, **self._orders(reg.node)}))

    async def _heartbeat(self, req: Request, resp: Response) -> None:
        if self._follower(req, resp):
            return
        try:
            hb = Heartbeat.model_validate_json(req.body)
        except ValidationError as e:
            return _bad(resp, 400, f"invalid heartbeat: {_first_error(e)}")
        known, version = self.registry.heartbeat(hb)
        if not await self._persisted(resp):
            return
        self.metrics.heartbeats.labels("true" if known else "false").inc()
        if not known:
            logger.info("heartbeat from unknown node %s: asking it to register", hb.node)
        resp.send(200, orjson.dumps({"known": known, "version": version,
                                     **self._orders(hb.node)}))

    def _orders(self, node: str) -> dict[str, object]:
        """``{"parts": [orders]}`` for a node with parts of instances spanning nodes
        (:mod:`motor.controller.assembly`), else nothing."""
        orders = self.registry.orders(node)
        return {"parts": [o.model_dump() for o in orders]} if orders else {}

    async def _deregister(self, req: Request, resp: Response) -> None:
        if self._follower(req, resp):
            return
        try:
            body = orjson.loads(req.body or b"null")
        except orjson.JSONDecodeError as e:
            return _bad(resp, 400, f"invalid JSON body: {e}")
        if not isinstance(body, dict) or not isinstance(body.get("node"), str):
            return _bad(resp, 400, 'expected {"node": str}')
        known, version = self.registry.deregister(body["node"])
        if not await self._persisted(resp):
            return
        if known:
            self.metrics.deregistrations.inc()
        resp.send(200, orjson.dumps({"known": known, "version": version}))

    async def _lifecycle(self, req: Request, resp: Response) -> None:
        """``POST /v1/instances/{id}/{action}``: forward to the node manager, then set the
        state. 200 with ``{"instance", "action", "state", "version", "node_manager": <its
        answer>}``; 404 unknown instance or action; 400 bad body; 409 the node has no
        management API; the node manager's own 4xx / 5xx passed on; 502 when it is
        unreachable."""
        if self._follower(req, resp):
            return
        rest = req.path[len("/v1/instances/"):]
        iid, _, action = rest.rpartition("/")
        iid = unquote(iid)
        if not iid or action not in ACTIONS:
            return _bad(resp, 404, f"no route POST {req.path}: expected "
                                   f"/v1/instances/{{id}}/{{{'|'.join(ACTIONS)}}}")
        try:
            body = orjson.loads(req.body) if req.body.strip() else {}
        except orjson.JSONDecodeError as e:
            return _bad(resp, 400, f"invalid JSON body: {e}")
        if not isinstance(body, dict):
            return _bad(resp, 400, f"expected a JSON object, got {type(body).__name__}")
        drain = body.get("drain", True)
        if not isinstance(drain, bool):
            return _bad(resp, 400, f"drain: expected true or false, got {drain!r}")
        if self.registry.spanning(iid):
            return await self._lifecycle_spanning(iid, action, drain, body, resp)
        try:
            node, host, mgmt_port = self.registry.node_of(iid)
        except UnknownInstance:
            return _bad(resp, 404, f"instance {iid!r} is not registered")
        if mgmt_port is None:
            self.metrics.actions.labels(action, "refused").inc()
            return _bad(resp, 409, f"node {node!r} has no management API (set "
                                   f"nodes[].mgmt_port of node {node!r}): cannot {action} "
                                   f"instance {iid!r}")
        if self._tls is not None:
            self._nm_client.use_tls(host, mgmt_port)
        path = f"/v1/instances/{quote(iid, safe='')}/{action}"
        try:
            # a stop answers once the engine is down: stop_timeout_s (10 s default) + SIGKILL
            status, raw = await self._nm_client.post_json_bytes(host, mgmt_port, path,
                                                                req.body or b"{}", 60.0)
        except Exception as e:  # noqa: BLE001 - unreachable node manager: 502
            self.metrics.actions.labels(action, "unreachable").inc()
            return _bad(resp, 502, f"node manager of {node!r} at {host}:{mgmt_port} did not "
                                   f"answer {action} of {iid!r}: {type(e).__name__}: {e}")
        if status >= 300:
            self.metrics.actions.labels(action, "refused").inc()
            return resp.send(status, raw)
        try:
            answer = orjson.loads(raw)
        except orjson.JSONDecodeError:
            answer = None
        try:
            version = self.registry.act(iid, action, drain)
        except UnknownInstance:   # deregistered meanwhile
            return _bad(resp, 404, f"instance {iid!r} is not registered")
        if not await self._persisted(resp):
            return
        self.metrics.actions.labels(action, "ok").inc()
        logger.info("instance %s: operator %s (node %s)", iid, action, node)
        resp.send(200, orjson.dumps({"instance": iid, "action": action,
                                     "state": self.registry.state(iid).value,
                                     "version": version, "node_manager": answer}))

    async def _lifecycle_spanning(self, iid: str, action: str, drain: bool,
                                  body: dict[str, object], resp: Response) -> None:
        """The lifecycle of an instance spanning nodes: the controller orders every part
        itself (:meth:`motor.controller.assembly.Assembler.act`). A drain (and a restart's)
        waits ``grace_s`` (default 2 x heartbeat interval), then until the DP master's engine
        has no running or waiting request (``timeout_s``, default 60), then stops (and for a
        restart starts the instance again at a new epoch), in the background."""
        timeout_s, grace_s = body.get("timeout_s", 60.0), body.get("grace_s")
        for name, v in (("timeout_s", timeout_s), ("grace_s", grace_s)):
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                                  or v < 0):
                return _bad(resp, 400, f"{name}: expected a number of seconds >= 0, got {v!r}")
        if grace_s is None:
            grace_s = 2 * self.config.heartbeat_interval_s
        first = "drain" if action in ("drain", "restart") and drain else action
        try:
            version = self.registry.act(iid, first)
        except UnknownInstance:
            return _bad(resp, 409, f"instance {iid!r} spans nodes and is not assembled: "
                                   f"nothing to {action}")
        if not await self._persisted(resp):
            return
        if first == "drain":
            then = "restart" if action == "restart" else None
            task = asyncio.create_task(self._drain_spanning(
                iid, then, float(timeout_s), float(grace_s)))  # type: ignore[arg-type]
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        self.metrics.actions.labels(action, "ok").inc()
        logger.info("instance %s (spanning nodes): operator %s", iid, action)
        resp.send(200, orjson.dumps({"instance": iid, "action": action,
                                     "state": self.registry.state(iid).value,
                                     "version": version, "node_manager": None}))

    async def _drain_spanning(self, iid: str, then: str | None, timeout_s: float,
                              grace_s: float) -> None:
        from motor.protocol.engine_metrics import parse_engine_metrics
        reg = self.registry
        await asyncio.sleep(grace_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            busy = 0.0
            for host, port in reg.assembly.master_endpoints(iid):
                try:
                    status, raw = await self._nm_client.get_json_bytes(host, port, "/metrics",
                                                                       2.0)
                except Exception:  # noqa: BLE001 - a dead engine has nothing in flight
                    continue
                if status == 200:
                    waiting, running, _ = parse_engine_metrics(raw.decode("utf-8", "replace"))
                    busy += waiting + running
            if busy == 0:
                break
            await asyncio.sleep(0.2)
        else:
            logger.warning("instance %s: drain timed out after %g s with requests in flight; "
                           "stopping it anyway", iid, timeout_s)
        if reg is not self.registry or not self.leading \
                or reg.state(iid) is not InstanceState.DRAINING:
            return   # deposed, or another action came first
        try:
            reg.act(iid, "stop")
            if then == "restart":
                reg.act(iid, "restart")
            await self._persist()
        except Exception as e:  # noqa: BLE001 - logged; the operator sees the state
            logger.warning("instance %s: end of drain failed: %s", iid, e)

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
        if self._follower(req, resp):
            return
        self._watchers += 1
        try:
            table = await self.registry.wait(after, timeout)
        finally:
            self._watchers -= 1
        if self._follower(req, resp):   # deposed while the poll was held
            return
        if self._table_bytes[0] != table.version:
            self._table_bytes = (table.version, table.model_dump_json().encode())
        resp.send(200, self._table_bytes[1])

    async def _nodes(self, req: Request, resp: Response) -> None:
        if self._follower(req, resp):
            return
        resp.send(200, orjson.dumps({"version": self.registry.version,
                                     "nodes": self.registry.nodes()}))

    async def _leader(self, req: Request, resp: Response) -> None:
        """``{"self", "leader", "is_leader", "peers", "etcd": {...} | null}`` on every
        controller; any origin may read it (the cluster page of a controller that died asks
        the others who leads now)."""
        ha = self.ha
        resp.send(200, orjson.dumps({
            "self": self.url, "is_leader": self.leading,
            "leader": self.url if ha is None else ha.leader_url,
            "peers": list(self.config.peers),
            "etcd": None if ha is None else {
                "endpoint": ha.session.endpoint, "reachable": ha.etcd_reachable,
                "prefix": self.config.etcd.prefix if self.config.etcd else None,
                "lease_ttl_s": ha.config.lease_ttl_s, "leader_changes": ha.leader_changes}}),
            headers=((b"access-control-allow-origin", b"*"),))

    async def _openapi(self, req: Request, resp: Response) -> None:
        from motor.controller.openapi import document
        resp.send(200, orjson.dumps(document()))

    async def _health(self, req: Request, resp: Response) -> None:
        resp.send(200, b'{"status":"ok"}')

    async def _readiness(self, req: Request, resp: Response) -> None:
        """200 on the leader and on a follower that knows the leader (it redirects);
        503 while no leader is known."""
        if self.leading:
            return resp.send(200, b'{"status":"ok","role":"leader"}')
        leader = self.ha.leader_url if self.ha is not None else None
        if leader is not None and leader != self.url:
            return resp.send(200, orjson.dumps({"status": "ok", "role": "follower",
                                                "leader": leader}))
        resp.send(503, _with_leader(error_body(503, "no leader known"), None))

    async def _metrics(self, req: Request, resp: Response) -> None:
        m = self.metrics
        for state, n in self.registry.counts().items():
            m.instances.labels(state.value).set(n)
        m.instances.labels(InstanceState.REMOVED.value).set(0)
        m.version.set(self.registry.version)
        m.nodes.set(len(self.registry.nodes()))
        m.watchers.set(self._watchers)
        m.is_leader.set(1 if self.leading else 0)
        if self.ha is not None:   # every member tried so far: 1 = its last request succeeded
            for member, ok in self.ha.session.health.items():
                m.etcd_up.labels(member).set(1 if ok else 0)
        resp.send(200, generate_latest(m.registry), content_type=CONTENT_TYPE_LATEST.encode())

    # ------------------------------------------- engines' figures, the cluster page
    def _engine_scraper(self) -> engine_metrics.EngineScraper:
        """The scraper of :mod:`motor.controller.engine_metrics`, made on first use."""
        if self._engines is None:
            self._engines = engine_metrics.EngineScraper(lambda: self.registry.table())
        return self._engines

    async def _engine_metrics(self, req: Request, resp: Response) -> None:
        """``GET /metrics/engines``: the engines' /metrics with instance labels (leader)."""
        if self._follower(req, resp):
            return
        resp.send(200, await self._engine_scraper().render(),
                  content_type=engine_metrics.CONTENT_TYPE)

    async def _engine_summary(self, req: Request, resp: Response) -> None:
        """``GET /v1/engines``: the engines' load per endpoint, JSON (leader)."""
        if self._follower(req, resp):
            return
        resp.send(200, orjson.dumps(await self._engine_scraper().summary()))

    async def _cluster_page(self, req: Request, resp: Response) -> None:
        """``GET /cluster``: the live cluster page (leader; :mod:`motor.controller.page`)."""
        if self._follower(req, resp):
            return
        resp.send(200, page.PAGE_BYTES, content_type=page.CONTENT_TYPE)


def _with_leader(body: bytes, leader: str | None, kind: str | None = None) -> bytes:
    """An error body with the leader's URL added (what :mod:`motor.control_link` follows);
    ``kind``: the error ``type`` instead of the status's (a redirect is not a bad request)."""
    doc = orjson.loads(body)
    doc["leader"] = leader
    if kind is not None:
        doc["error"]["type"] = kind
    return orjson.dumps(doc)


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
                           port: int | None = None, stop: asyncio.Event | None = None,
                           advertise_host: str | None = None) -> None:
    """Run a controller until ``stop`` is set (or forever)."""
    server = ControllerServer(config, advertise_host=advertise_host)
    await server.start(host, port)
    if server.tls_files is not None:   # SIGHUP: re-read the certificate files now
        try:
            asyncio.get_running_loop().add_signal_handler(
                signal.SIGHUP, lambda: server.reload_tls(force=True))
        except (NotImplementedError, RuntimeError):   # not the main thread (tests)
            pass
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await server.stop()


def run_controller(config: ControllerConfig, host: str | None = None, port: int | None = None,
                   advertise_host: str | None = None) -> int:
    """Blocking entry point: uvloop, SIGTERM/SIGINT -> clean stop, returns exit status 0."""
    install_uvloop()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve_controller(config, host, port, stop, advertise_host)

    asyncio.run(main())
    return 0
