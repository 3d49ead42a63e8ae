"""The node manager: engines of one node + registration and heartbeats to the controller.

Library use (in-process)::

    agent = NodeAgent(config.nodes[0], config.controller.url,
                      heartbeat_interval_s=config.controller.heartbeat_interval_s)
    await agent.start()                  # engines start, registration begins
    ...
    await agent.stop()                   # engines stopped, node deregistered

or blocking with SIGTERM / SIGINT handling: :func:`run_node_manager`.

Controller traffic: register all instances on start (``healthy`` = current health, false at
first); heartbeat every ``heartbeat_interval_s`` (and at once when an engine's health changes)
with ``{node, health, failed, reasons}``; ``known: false`` -> register again (a restarted
controller learns this node's instances so, with their current health). A controller that is
down is retried with exponential backoff from 0.2 s, capped at ``heartbeat_interval_s`` (a
restarted controller hears from every node manager within about one heartbeat interval),
logged once per outage. Before the first registration a controller that does not answer yet
is logged at INFO for :data:`STARTUP_GRACE_S` (the controller may be starting too), at
WARNING after.

Lifecycle (management API, :meth:`NodeAgent.act`): ``POST /v1/instances/{id}/drain``
(heartbeats' ``draining`` at once, ``grace_s``, then wait until the engines' request gauges are
0 or ``timeout_s``, then stop -> ``stopped``), ``/stop`` (now), ``/start``, ``/restart``
(drain or stop, then start); the controller forwards its own lifecycle calls here. A stopped
instance is sent in heartbeats' ``stopped``: not restarted by the restart policy, not
``failed``. The API's OpenAPI document: :func:`openapi_document` (``GET /openapi.json``).

Instances spanning nodes (config ``engines[].span``, :class:`EnginePart`): this node's part
is registered in ``parts`` and started only when the controller's answer (register or
heartbeat) orders it to run at an epoch (``parts: [{instance, epoch, run, master_host,
master_port}]``), with the DP master's address of that order; a new epoch stops the part's
processes and starts them fresh, ``run: false`` stops them. The part's processes are never
restarted here: an exit makes the part ``failed`` in the heartbeat's ``parts`` and the
controller restarts the whole instance (:mod:`motor.controller.assembly`).

Environment: ``MOTOR_ENGINE_LOG_DIR`` (engine logs, see ``log_dir``),
``MOTOR_ENGINE_START_ATTEMPTS`` (an integer >= 1: failed starts in a row of an engine that was
never healthy after which the node manager gives up on it; ``motor up`` sets it so a bad
engine flag fails the start-up at once instead of restarting for minutes).
"""
from __future__ import annotations

import asyncio
import enum
import logging
import os
import shutil
import signal
import tempfile
import time
from typing import Any
from urllib.parse import unquote, urlsplit

import orjson
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from motor.aio import cancel_and_wait
from motor.http.server import ListenError, bind_error_reason  # noqa: F401
from motor.config.schema import ClusterConfig, ControlPlaneTlsConfig, NodeConfig
from motor.control_link import ControllerLink, controller_urls
from motor.control_tls import ControlPlaneTls
from motor.errors import ConfigError
from motor.http import Client, HttpServer, Request, Response, Router, install_uvloop
from motor.node_manager.engines import InstancePlan, plan_node
from motor.node_manager.npu import NpuMonitor
from motor.node_manager.supervisor import EngineProcess, ProcState
from motor.protocol.engine_metrics import parse_engine_metrics
from motor.protocol.instances import (EngineHealth, Heartbeat, NodeRegistration, NpuChip,
                                      PartOrder, PartReport, VirtualInferenceStatus)
from motor.protocol.openai import error_body

#: worst first: the instance's state in heartbeats is its worst process's
_SEVERITY = [ProcState.FAILED, ProcState.PORT_BUSY, ProcState.BACKOFF, ProcState.UNHEALTHY, ProcState.STARTING,
             ProcState.STOPPED, ProcState.READY]

logger = logging.getLogger(__name__)

#: engine log directory when neither the caller nor the node config gives one
ENGINE_LOG_DIR_ENV = "MOTOR_ENGINE_LOG_DIR"
#: failed starts in a row of a never-healthy engine before giving up on it (unset: no limit
#: but the restart policy's)
ENGINE_START_ATTEMPTS_ENV = "MOTOR_ENGINE_START_ATTEMPTS"
#: seconds after start during which an unreachable controller is logged at INFO (it may be
#: starting at the same time); WARNING after
STARTUP_GRACE_S = 10.0
#: seconds between two reads of a draining instance's request gauges
DRAIN_POLL_S = 0.2
#: timeout of one ``GET /metrics`` of an engine during a drain (seconds)
METRICS_TIMEOUT_S = 2.0


def check_start_attempts_env() -> None:
    """Refuse a ``$MOTOR_ENGINE_START_ATTEMPTS`` that is set but not an integer >= 1.

    Raises
    ------
    ConfigError
        ``MOTOR_ENGINE_START_ATTEMPTS: expected an integer >= 1, got '...'``.
    """
    raw = os.environ.get(ENGINE_START_ATTEMPTS_ENV)
    if raw is not None and raw.strip() and start_attempts_from_env() is None:
        raise ConfigError(f"{ENGINE_START_ATTEMPTS_ENV}: expected an integer >= 1, got {raw!r}")


def start_attempts_from_env() -> int | None:
    """``$MOTOR_ENGINE_START_ATTEMPTS`` as an integer >= 1, else None (unset or not valid:
    the node manager's command refuses an invalid one first, :func:`check_start_attempts_env`)."""
    raw = os.environ.get(ENGINE_START_ATTEMPTS_ENV, "").strip()
    try:
        n = int(raw)
    except ValueError:
        return None
    return n if n >= 1 else None


class AdminState(str, enum.Enum):
    """What an operator asked of an instance (``POST /v1/instances/{id}/{action}``)."""
    RUNNING = "running"     #: supervised as configured (the default)
    DRAINING = "draining"   #: sent in heartbeats' ``draining``: no new requests, stops once idle
    STOPPED = "stopped"     #: sent in heartbeats' ``stopped``: nothing runs, never restarted


class Action(str, enum.Enum):
    """The operator actions of the management API."""
    DRAIN = "drain"
    STOP = "stop"
    START = "start"
    RESTART = "restart"


class _Body(BaseModel):
    # unknown fields are ignored, as on the controller's wire types: a newer controller may
    # forward more than this node manager reads
    model_config = ConfigDict(extra="ignore")


class DrainRequest(_Body):
    """Body of ``POST /v1/instances/{id}/drain`` (all fields optional; an empty body is ``{}``)."""
    timeout_s: float = Field(
        60.0, ge=0, le=7 * 86400, allow_inf_nan=False,
        description="longest wait, after grace_s, for the instance's engines to have no request "
                    "running or waiting; then it is stopped anyway (seconds)")
    grace_s: float | None = Field(
        None, ge=0, le=3600, allow_inf_nan=False,
        description="wait after the first heartbeat that reports the drain, so that every "
                    "coordinator has the table without the instance before the idle check "
                    "(seconds); null = 2 x the heartbeat interval")


class RestartRequest(DrainRequest):
    """Body of ``POST /v1/instances/{id}/restart``."""
    drain: bool = Field(True, description="drain first (as POST .../drain), else stop at once")


class ActionAnswer(BaseModel):
    """The answer of an accepted action (200 done / no-op, 202 under way)."""
    instance: str = Field(description="instance id <node>/<engine>/<i>")
    action: Action
    state: str = Field(description="the instance's state now as heartbeats report it: "
                                   "draining, stopped, starting or ready")


class EngineInstance:
    """One registered instance = one or more engine processes (one per DP rank for sim).

    ``admin`` is what an operator asked (:class:`AdminState`); ``action`` the action under way
    (a drain or restart runs in ``task``; a stop is awaited by its request), else None.
    """

    def __init__(self, plan: InstancePlan, processes: list[EngineProcess]) -> None:
        self.plan = plan
        self.processes = processes
        self.admin = AdminState.RUNNING
        self.action: Action | None = None
        #: what the action under way is doing now (``waiting for 2 request(s) to finish``)
        self.action_step: str | None = None
        self.task: asyncio.Task[None] | None = None

    @property
    def id(self) -> str:
        return self.plan.id

    @property
    def healthy(self) -> bool:
        return all(p.healthy for p in self.processes)

    @property
    def failed(self) -> bool:
        """Sent in heartbeats' ``failed``: gave up, or not launched because its port is busy
        (never while stopped on an operator's request)."""
        return self.admin is not AdminState.STOPPED and \
            any(p.failed or p.port_busy for p in self.processes)

    @property
    def state(self) -> str:
        """``draining`` / ``stopped`` on an operator's request, else ``ready`` when healthy,
        else ``starting`` (how the answers of the management API word it)."""
        if self.admin is not AdminState.RUNNING:
            return str(self.admin.value)
        return "ready" if self.healthy else "starting"

    @property
    def reason(self) -> str | None:
        if self.admin is AdminState.STOPPED:
            return "stopped on an operator's request"
        if self.admin is AdminState.DRAINING:
            return f"draining on an operator's request: {self.action_step or 'under way'}"
        for p in self.processes:
            if p.state is not ProcState.READY:
                return f"{p.name}: {p.reason or p.state.value}"
        return None

    def engine_health(self) -> EngineHealth:
        state = min((p.state for p in self.processes), key=_SEVERITY.index)
        vi = next((p.vi for p in self.processes if p.vi is not None), None)
        return EngineHealth(
            state=state.value, http_healthy=all(p.http_healthy for p in self.processes),
            restarts=sum(p.restarts for p in self.processes),
            virtual_inference=VirtualInferenceStatus(**vi.status()) if vi is not None else None)

    def status(self) -> dict[str, object]:
        return {"id": self.id, "healthy": self.healthy, "failed": self.failed,
                "admin_state": self.admin.value,
                "action": None if self.action is None else self.action.value,
                "action_step": self.action_step,
                "processes": [p.status() for p in self.processes]}


class EnginePart:
    """This node's part of an instance spanning nodes: its processes run at the epoch the
    controller ordered (``epoch``; 0 = none runs), rebuilt for each epoch."""

    def __init__(self, plan: InstancePlan) -> None:
        assert plan.part is not None
        self.plan = plan
        self.processes: list[EngineProcess] = []
        self.epoch = 0
        #: the controller's latest order (applied by ``task``)
        self.order: PartOrder | None = None
        self.task: asyncio.Task[None] | None = None
        #: epochs started (the first start included)
        self.starts = 0

    @property
    def id(self) -> str:
        return self.plan.id

    @property
    def healthy(self) -> bool:
        return self.epoch > 0 and bool(self.processes) and all(p.healthy for p in self.processes)

    @property
    def failed(self) -> bool:
        return self.epoch > 0 and any(p.failed for p in self.processes)

    @property
    def reason(self) -> str | None:
        if self.epoch == 0:
            return "waiting for the controller to assemble the instance"
        for p in self.processes:
            if p.state is not ProcState.READY:
                return f"{p.name}: {p.reason or p.state.value}"
        return None

    def report(self) -> PartReport:
        return PartReport(epoch=self.epoch, healthy=self.healthy, failed=self.failed,
                          reason=self.reason)

    def status(self) -> dict[str, object]:
        pp = self.plan.part
        assert pp is not None
        return {"id": self.id, "node_rank": pp.node_rank, "master": pp.master,
                "dp_ranks": [pp.dp_start_rank, pp.dp_start_rank + pp.dp_size_local - 1],
                "epoch": self.epoch, "starts": self.starts, "healthy": self.healthy,
                "failed": self.failed, "reason": self.reason,
                "processes": [p.status() for p in self.processes]}


def parse_url(url: str) -> tuple[str, int]:
    """``http(s)://HOST[:PORT]`` (or ``HOST:PORT``) -> (host, port); port 80 / 443 by default."""
    u = urlsplit(url if "//" in url else "http://" + url)
    if u.scheme not in ("http", "https", "") or not u.hostname:
        raise ConfigError(f"controller URL must look like http://HOST:PORT or "
                          f"https://HOST:PORT, got {url!r}")
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


class NodeAgent:
    """Runs one node's engines and keeps the controller informed.

    Parameters
    ----------
    node : NodeConfig
    controller_url : str
        ``http://host:port`` of the controller; several (controllers with etcd)
        comma-separated: heartbeats go to the leader (:class:`~motor.control_link.ControllerLink`).
    heartbeat_interval_s : float
    log_dir : str or None
        Engine logs; default ``node.log_dir``, else ``$MOTOR_ENGINE_LOG_DIR``, else a fresh
        temp dir, which :meth:`stop` removes unless an engine failed (then it is kept and its
        path logged).
    mgmt_host, mgmt_port : management API (``/health``, ``/metrics``, ``/v1/instances``);
        ``mgmt_port=None`` = ``node.mgmt_port`` (None there too = off), 0 = any free port.
    tls : ControlPlaneTlsConfig or None
        ``controller.tls``: the controller is reached over mTLS (``controller_url`` must be
        ``https://``) and the management API is served with mTLS.
    cluster : ClusterConfig or None
        The config ``node`` comes from (the vLLM-Ascend PD defaults take the mode and the PD
        peers' sizes from it, :func:`~motor.node_manager.engines.plan_node`).

    Raises
    ------
    ConfigError
        a bad engine_config, a controller URL whose scheme does not fit ``tls``, a TLS file
        that is missing or does not load.
    """

    def __init__(self, node: NodeConfig, controller_url: str, heartbeat_interval_s: float = 1.0,
                 log_dir: str | None = None, mgmt_host: str | None = None,
                 mgmt_port: int | None = None, tls: ControlPlaneTlsConfig | None = None,
                 cluster: ClusterConfig | None = None) -> None:
        self.node = node
        self.controller_url = controller_url
        urls = [u if "//" in u else "http://" + u for u in controller_urls(controller_url)]
        for u in urls:
            parse_url(u)
        #: the management API's server context (mTLS) with ``controller.tls``
        #: ``controller.tls``'s contexts, re-read when the files change (:meth:`reload_tls`)
        self.tls_files = ControlPlaneTls(tls) if tls is not None else None
        self._server_tls = self.tls_files.server if self.tls_files is not None else None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.log_dir = log_dir or node.log_dir or os.environ.get(ENGINE_LOG_DIR_ENV) or None
        self._temp_log_dir = False  #: log_dir is a temp dir this agent made (removed on stop)
        self.mgmt_host = mgmt_host or node.host
        self.mgmt_port_wanted = mgmt_port if mgmt_port is not None else node.mgmt_port
        self.mgmt_port: int | None = None
        self.plans = plan_node(node, cluster)  # raises ConfigError on a bad engine_config
        # one client: plain HTTP to the engines, mTLS to the controller with controller.tls
        self.client = Client(connect_timeout_s=2.0,
                             tls=self.tls_files.client if self.tls_files is not None else None)
        #: the leading controller among ``controller_url``'s (a follower's 307 is followed)
        self.link = ControllerLink(urls, self.client, tls)
        self.instances: list[EngineInstance] = []
        #: this node's parts of instances spanning nodes
        self.parts: list[EnginePart] = []
        self._start_attempts: int | None = None
        self.registered = False
        self._ever_registered = False
        self.controller_reachable = False
        self._dirty = asyncio.Event()
        #: heartbeats built (``_sent``) and the last one the controller accepted (``_acked``,
        #: same numbering); ``_beat`` is set, and replaced, at each accepted one
        self._sent = 0
        self._acked = 0
        self._beat = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._http: HttpServer | None = None
        self._metrics = CollectorRegistry(auto_describe=True)
        self._g_healthy = Gauge("motor_node_engine_healthy", "1 when the engine process is healthy",
                                ["instance", "process"], registry=self._metrics)
        self._g_restarts = Gauge("motor_node_engine_restarts", "restarts of the engine process",
                                 ["instance", "process"], registry=self._metrics)
        self._g_failed = Gauge("motor_node_engine_failed", "1 when the node manager gave up",
                               ["instance", "process"], registry=self._metrics)
        self._g_ctrl = Gauge("motor_node_controller_reachable", "1 when the controller answers",
                             registry=self._metrics)
        self.npu = NpuMonitor(node.npu)
        ip = ["instance", "process"]
        self._g_vi_failures = Gauge("motor_node_virtual_inference_failures",
                                    "failed virtual-inference rounds in a row", ip,
                                    registry=self._metrics)
        self._g_vi_unhealthy = Gauge("motor_node_virtual_inference_unhealthy",
                                     "1 when virtual inference reports the engine unhealthy", ip,
                                     registry=self._metrics)
        self._g_vi_rounds = Gauge("motor_node_virtual_inference_rounds",
                                  "virtual-inference rounds since the engine (re)started, by "
                                  "result (ok, failed, busy = failed request on a busy NPU)",
                                  ip + ["result"], registry=self._metrics)
        self._g_npu_up = Gauge("motor_npu_up", "1 when the last npu-smi sample succeeded "
                               "(absent without npu-smi)", registry=self._metrics)
        chip = ["npu", "chip", "device", "name"]
        self._g_npu: dict[str, Gauge] = {
            key: Gauge(f"motor_npu_{metric}", help_, chip, registry=self._metrics)
            for key, metric, help_ in [
                ("healthy", "healthy", "1 when npu-smi says Health OK"),
                ("temp_c", "temperature_celsius", "chip temperature"),
                ("power_w", "power_watts", "card power (first chip of a card)"),
                ("aicore_pct", "aicore_usage_percent", "AI-core use (npu-smi info)"),
                ("hbm_used", "hbm_used_bytes", "HBM in use"),
                ("hbm_total", "hbm_total_bytes", "HBM size"),
                ("memory_used", "memory_used_bytes", "DDR / device memory in use"),
                ("memory_total", "memory_total_bytes", "DDR / device memory size")]}

    # --------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        if self.mgmt_port_wanted is not None:  # first: a busy port fails before engines start
            self._http = HttpServer(self._route())
            try:
                self.mgmt_port = await self._http.listen(self.mgmt_host, self.mgmt_port_wanted,
                                                         tls=self._server_tls)
            except OSError as e:
                self._http = None
                raise ListenError(self.mgmt_host, self.mgmt_port_wanted, e) from e
            logger.info("node manager %s: management API on %s://%s:%d%s", self.node.name,
                        "https" if self._server_tls else "http", self.mgmt_host, self.mgmt_port,
                        " (mTLS)" if self._server_tls else "")
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix=f"motor-{self.node.name}-logs-")
            self._temp_log_dir = True
        os.makedirs(self.log_dir, exist_ok=True)
        logger.info("node manager %s: %d instance(s), engine logs in %s, controller %s",
                    self.node.name, len(self.plans), self.log_dir, self.controller_url)
        self.npu.start()  # says once whether npu-smi is there
        attempts = self._start_attempts = start_attempts_from_env()
        for plan in self.plans:
            if plan.part is not None:
                self.parts.append(EnginePart(plan))   # started on the controller's order
                continue
            j = next(k for k, e in enumerate(self.node.engines) if e is plan.engine)
            field = (f"engines[{j}].launcher of node {self.node.name}" if plan.engine.launcher
                     else f"the default launcher of kind {plan.engine.kind.value}; set "
                          f"engines[{j}].launcher of node {self.node.name}")
            procs = [EngineProcess(spec, plan.engine, self.log_dir, self.client,
                                   on_change=self._dirty.set, npu=self.npu, instance=plan.id,
                                   start_attempts=attempts, launcher_field=field)
                     for spec in plan.processes]
            self.instances.append(EngineInstance(plan, procs))
        for inst in self.instances:
            for p in inst.processes:
                p.start()
        self._task = asyncio.create_task(self._control_loop(), name="controller loop")

    async def stop(self, deregister_timeout_s: float = 2.0) -> None:
        """Stop every engine (SIGTERM -> timeout -> SIGKILL of each group), deregister."""
        logger.info("node manager %s: stopping %d engine process(es)", self.node.name,
                    sum(len(i.processes) for i in self.instances))
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await cancel_and_wait(*(i.task for i in self.instances), *(p.task for p in self.parts))
        await asyncio.gather(*(p.stop() for i in self.instances for p in i.processes),
                             *(p.stop() for part in self.parts for p in part.processes))
        await self.npu.stop()
        self._clean_log_dir()
        if self.registered:
            try:
                await self._post("/v1/nodes/deregister", {"node": self.node.name},
                                 deregister_timeout_s)
                logger.info("node manager %s: deregistered", self.node.name)
            except ConnectionError as e:  # refused / reset: the controller stopped first
                logger.info("node manager %s: controller %s already gone, not deregistered (%s)",
                            self.node.name, self.controller_url, _err(e))
            except Exception as e:
                logger.warning("node manager %s: could not deregister (%s)", self.node.name,
                               _err(e))
        if self._http is not None:
            await self._http.shutdown(drain_timeout_s=0.5)
        self.client.close()
        logger.info("node manager %s: stopped", self.node.name)

    def _clean_log_dir(self) -> None:
        """Remove the temp log dir this agent made, unless an engine failed (then keep it)."""
        if not self._temp_log_dir or self.log_dir is None:
            return
        self._temp_log_dir = False
        failed = [p.name for i in self.instances for p in i.processes if p.had_failure]
        failed += [p.name for part in self.parts for p in part.processes if p.had_failure]
        if failed:
            logger.warning("node manager %s: engine logs kept in %s (engine(s) that failed: %s)",
                           self.node.name, self.log_dir, ", ".join(failed))
            return
        shutil.rmtree(self.log_dir, ignore_errors=True)

    # ------------------------------------------------------------ controller
    def registration(self) -> NodeRegistration:
        return NodeRegistration(node=self.node.name, host=self.node.host,
                                instances=[i.plan.spec(healthy=i.healthy) for i in self.instances],
                                mgmt_port=self.mgmt_port,
                                parts=[p.plan.part_info(p.epoch) for p in self.parts])

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(node=self.node.name,
                         health={i.id: i.healthy for i in self.instances},
                         failed=[i.id for i in self.instances if i.failed],
                         reasons={i.id: r for i in self.instances if (r := i.reason)},
                         engines={i.id: i.engine_health() for i in self.instances},
                         npu=[NpuChip(**c) for c in self.npu.snapshot()],
                         draining=[i.id for i in self.instances
                                   if i.admin is AdminState.DRAINING],
                         stopped=[i.id for i in self.instances if i.admin is AdminState.STOPPED],
                         parts={p.id: p.report() for p in self.parts})

    async def _post(self, path: str, body: object, timeout_s: float) -> dict[str, object]:
        data = body.model_dump_json().encode() if hasattr(body, "model_dump_json") \
            else orjson.dumps(body)
        status, raw = await self.link.request("POST", path, data, timeout_s)
        if status != 200:
            raise _ControllerRefused(status, raw[:300].decode("utf-8", "replace"))
        out = orjson.loads(raw)
        return out if isinstance(out, dict) else {}

    def reload_tls(self, force: bool = False) -> bool:
        """Re-read ``controller.tls``'s files if they changed (``force``: whatever; SIGHUP);
        True when new material is in use (management API and controller connections)."""
        return self.tls_files.check(force) if self.tls_files is not None else False

    async def _control_loop(self) -> None:
        timeout = max(1.0, min(5.0, 2 * self.heartbeat_interval_s))
        backoff_min = min(0.2, self.heartbeat_interval_s)
        backoff_max = max(backoff_min, self.heartbeat_interval_s)
        backoff = backoff_min
        outage_since: float | None = None
        started = time.monotonic()
        warned = False   # the outage of this try was logged at WARNING
        while True:
            if self.tls_files is not None:
                self.tls_files.check_every(time.monotonic())
            try:
                if not self.registered:
                    r = await self._post("/v1/nodes/register", self.registration(), timeout)
                    self.registered = True
                    self._ever_registered = True
                    logger.info("node manager %s: registered %d instance(s) with %s (version %s)",
                                self.node.name, len(self.instances), self.link.url,
                                r.get("version"))
                    self._on_orders(r.get("parts"))
                else:
                    self._dirty.clear()
                    self._sent += 1
                    seq = self._sent
                    r = await self._post("/v1/nodes/heartbeat", self.heartbeat(), timeout)
                    if r.get("known") is False:
                        logger.info("node manager %s: controller does not know this node "
                                    "(restarted?): registering again", self.node.name)
                        self.registered = False
                        continue
                    self._on_orders(r.get("parts"))
                    self._acked = seq
                    self._beat.set()
                    self._beat = asyncio.Event()
                if outage_since is not None:
                    logger.info("node manager %s: controller %s reachable again after %.1f s",
                                self.node.name, self.link.url, time.monotonic() - outage_since)
                    outage_since = None
                    warned = False
                self.controller_reachable = True
                backoff = backoff_min
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.controller_reachable = False
                now = time.monotonic()
                first = outage_since is None
                if outage_since is None:
                    outage_since = now
                starting = not self._ever_registered
                if starting and now - started < STARTUP_GRACE_S:
                    if first:  # the controller may be starting too
                        logger.info("node manager %s: controller %s not reachable yet (%s); "
                                    "retrying", self.node.name, self.controller_url, _err(e))
                elif not warned:
                    warned = True
                    logger.warning("node manager %s: controller %s: %s; retrying with backoff "
                                   "(logged once per outage)%s", self.node.name,
                                   self.controller_url, _err(e),
                                   f" ({now - started:.0f} s since start)" if starting else "")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, backoff_max)
                continue
            try:
                await asyncio.wait_for(self._dirty.wait(), self.heartbeat_interval_s)
                await asyncio.sleep(0.01)  # coalesce a burst of changes
            except TimeoutError:
                pass

    # ------------------------------------------------- parts of instances spanning nodes
    def _on_orders(self, raw: object) -> None:
        """Apply the controller's orders for this node's parts (``parts`` of its answer)."""
        if not isinstance(raw, list) or not self.parts:
            return
        for item in raw:
            try:
                order = PartOrder.model_validate(item)
            except ValidationError as e:
                logger.warning("node manager %s: ignoring a part order the controller sent: "
                               "%s", self.node.name, _first_error(e))
                continue
            part = next((p for p in self.parts if p.id == order.instance), None)
            if part is None:
                continue
            part.order = order
            if part.task is None and self._order_differs(part, order):
                part.task = asyncio.create_task(self._follow_orders(part),
                                                name=f"part {part.id}")

    @staticmethod
    def _order_differs(part: EnginePart, order: PartOrder) -> bool:
        if order.run:
            return part.epoch != order.epoch
        return part.epoch != 0 or any(p.supervised for p in part.processes)

    async def _follow_orders(self, part: EnginePart) -> None:
        """Stop the part's processes / start them at the ordered epoch until the part matches
        the controller's latest order."""
        try:
            while part.order is not None and self._order_differs(part, part.order):
                order = part.order
                if part.processes:
                    why = (f"the instance restarts as a whole (epoch {order.epoch})"
                           if order.run else "the controller stopped the instance's parts")
                    await asyncio.shield(asyncio.gather(*(p.stop(why) for p in part.processes)))
                    logger.info("instance %s: this node's part stopped: %s", part.id, why)
                part.epoch = 0
                self._dirty.set()
                if not order.run:
                    continue
                pp = part.plan.part
                assert pp is not None
                host = order.master_host or pp.master_host
                port = order.master_port or pp.master_port
                part.processes = [
                    EngineProcess(spec, part.plan.engine, self.log_dir or ".", self.client,
                                  on_change=self._dirty.set, npu=self.npu, instance=part.id,
                                  start_attempts=self._start_attempts,
                                  launcher_field=f"the launcher of engine {part.plan.engine.name}",
                                  restart_on_exit=False)
                    for spec in pp.build(host, port)]
                for p in part.processes:
                    p.start(fresh=True)
                part.epoch = order.epoch
                part.starts += 1
                self._dirty.set()
                logger.info("instance %s: node rank %d of %d (DP ranks %d-%d) started at epoch "
                            "%d, DP master %s:%d", part.id, pp.node_rank, len(pp.nodes),
                            pp.dp_start_rank, pp.dp_start_rank + pp.dp_size_local - 1,
                            order.epoch, host, port)
        except asyncio.CancelledError:
            raise
        except Exception:   # pragma: no cover - a bug; the node manager goes on
            logger.exception("instance %s: following the controller's order failed", part.id)
        finally:
            part.task = None

    # ------------------------------------------------------------ lifecycle
    def instance(self, instance_id: str) -> EngineInstance | None:
        """The instance ``instance_id`` (``<node>/<engine>/<i>``) of this node, else None."""
        return next((i for i in self.instances if i.id == instance_id), None)

    async def heartbeat_now(self, wait_s: float) -> bool:
        """Send a heartbeat now and wait until the controller accepted one built after this
        call: True, or False after ``wait_s`` seconds (controller unreachable; the heartbeat
        loop goes on trying)."""
        want = self._sent + 1
        self._dirty.set()
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        while self._acked < want:
            left = end - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._beat.wait(), left)
            except TimeoutError:
                return False
        return True

    @property
    def _ack_wait_s(self) -> float:
        """How long a lifecycle step waits for the controller to hear of a state change."""
        return max(1.0, 2 * self.heartbeat_interval_s)

    async def act(self, instance_id: str, action: Action,
                  body: DrainRequest | None = None) -> tuple[int, ActionAnswer]:
        """Apply an operator's ``action`` to instance ``instance_id``; what
        ``POST /v1/instances/{id}/{action}`` does.

        * ``drain`` (``body``: :class:`DrainRequest`): 202, state ``draining`` at once (a
          heartbeat is sent now); in the background: ``grace_s``, then the engines' ``/metrics``
          (``vllm:num_requests_running + vllm:num_requests_waiting``, or SGLang's
          ``sglang:num_running_reqs + sglang:num_queue_reqs``, summed over the instance's
          processes) polled every :data:`DRAIN_POLL_S` until 0 or ``timeout_s``, then the
          processes are stopped: state ``stopped``. A stopped instance: 200, no-op; a drain
          under way: 202, it goes on (this body is not applied).
        * ``stop``: the processes are stopped at once (SIGTERM -> ``stop_timeout_s`` ->
          SIGKILL), 200 ``stopped`` when done; it cancels a drain or restart under way.
        * ``start``: the processes of a stopped instance (or those the supervisor gave up on)
          start again with a fresh restart history, 202 ``starting``; 200 when all run.
        * ``restart`` (``body``: :class:`RestartRequest`): 202; drain (``drain: true``) or stop
          at once, then start (a stopped instance just starts).

        Stopped instances are sent in heartbeats' ``stopped`` (never restarted by the restart
        policy, not ``failed``), draining ones in ``draining``.

        Returns
        -------
        (status, answer) : (int, ActionAnswer)
            200 (done, or nothing to do) or 202 (under way).

        Raises
        ------
        LookupError
            no instance ``instance_id`` on this node (404).
        LifecycleConflict
            another action is under way that this one cannot override (409): only ``stop``
            overrides, and ``drain`` joins a drain.
        """
        inst = self.instance(instance_id)
        if inst is None:
            raise LookupError(f"instance: expected one of node {self.node.name}'s instances "
                              f"({', '.join(i.id for i in self.instances) or 'none'}), got "
                              f"{instance_id!r}")
        busy = inst.action
        if action is Action.STOP:
            if inst.task is not None:
                logger.info("instance %s: stop requested: the %s under way is cancelled",
                            inst.id, busy.value if busy else "action")
                await cancel_and_wait(inst.task)
            if inst.admin is not AdminState.STOPPED or busy is not None:
                inst.action, inst.action_step = Action.STOP, "stopping its processes"
                try:
                    await self._stop_processes(inst, "stopped on an operator's stop")
                finally:
                    inst.action = inst.action_step = None
                inst.admin = AdminState.STOPPED
                self._dirty.set()
                logger.info("instance %s: stopped on an operator's request", inst.id)
            return 200, self._answer(inst, action)
        if busy is not None and not (action is Action.DRAIN and busy is Action.DRAIN):
            raise LifecycleConflict(
                f"instance {inst.id}: expected no action under way for a {action.value}, got a "
                f"{busy.value} under way ({inst.action_step or 'in progress'}); wait until it "
                f"ends, or POST /v1/instances/{inst.id}/stop to stop the instance now")
        if action is Action.DRAIN:
            if busy is Action.DRAIN:
                return 202, self._answer(inst, action)
            if inst.admin is AdminState.STOPPED:
                return 200, self._answer(inst, action)
            self._begin(inst, action, AdminState.DRAINING, body or DrainRequest())
            return 202, self._answer(inst, action)
        if action is Action.START or inst.admin is AdminState.STOPPED:
            if inst.admin is AdminState.RUNNING and all(p.supervised for p in inst.processes):
                return 200, self._answer(inst, action)
            self._start_processes(inst, action)
            return 202, self._answer(inst, action, "starting")
        req = body if isinstance(body, RestartRequest) else RestartRequest()
        self._begin(inst, action, AdminState.DRAINING if req.drain else AdminState.STOPPED,
                    req if req.drain else None)
        return 202, self._answer(inst, action)

    @staticmethod
    def _answer(inst: EngineInstance, action: Action, state: str | None = None) -> ActionAnswer:
        return ActionAnswer(instance=inst.id, action=action, state=state or inst.state)

    def _begin(self, inst: EngineInstance, action: Action, admin: AdminState,
               drain: DrainRequest | None) -> None:
        """State ``admin`` now (heartbeat at once), the rest of ``action`` in a task."""
        inst.admin, inst.action = admin, action
        inst.action_step = "reporting it to the controller"
        self._dirty.set()
        inst.task = asyncio.create_task(self._lifecycle(inst, action, drain),
                                        name=f"{action.value} {inst.id}")

    async def _lifecycle(self, inst: EngineInstance, action: Action,
                         drain: DrainRequest | None) -> None:
        """The background part of a drain (drain -> stop) or a restart ([drain] -> stop ->
        start)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            await self.heartbeat_now(self._ack_wait_s)
            if drain is not None:
                await self._drain_phase(inst, drain)
            inst.action_step = "stopping its processes"
            await self._stop_processes(inst, f"stopped on an operator's {action.value}")
            inst.admin = AdminState.STOPPED
            self._dirty.set()
            if action is Action.RESTART:
                inst.action_step = "reporting the stop to the controller"
                await self.heartbeat_now(self._ack_wait_s)   # it sees the instance stopped
                self._start_processes(inst, action)
            logger.info("instance %s: %s done in %.1f s%s", inst.id, action.value,
                        loop.time() - t0, "; starting again" if action is Action.RESTART else
                        "; stopped")
        except asyncio.CancelledError:
            raise
        except Exception:   # pragma: no cover - a bug; the node manager goes on
            logger.exception("instance %s: %s failed", inst.id, action.value)
        finally:
            inst.action = inst.action_step = None
            inst.task = None

    async def _drain_phase(self, inst: EngineInstance, req: DrainRequest) -> None:
        """``grace_s``, then wait until the instance's engines are idle or ``timeout_s``."""
        loop = asyncio.get_running_loop()
        grace = req.grace_s if req.grace_s is not None else 2 * self.heartbeat_interval_s
        logger.info("instance %s: draining on an operator's request (grace %.1f s, then up to "
                    "%g s for its requests to finish)", inst.id, grace, req.timeout_s)
        inst.action_step = f"grace period of {grace:g} s"
        await asyncio.sleep(grace)
        deadline = loop.time() + req.timeout_s
        warned: set[str] = set()
        while True:
            n, unread = await self.engine_requests(inst)
            for name in unread - warned:
                logger.warning("instance %s: drain: cannot read the request gauges of engine %s "
                               "(GET /metrics); waiting for them until the drain timeout",
                               inst.id, name)
            warned |= unread
            if n == 0 and not unread:
                return
            if loop.time() >= deadline:
                logger.warning("instance %s: drain timed out after %g s with %d request(s) "
                               "still running or waiting%s: stopping it", inst.id, req.timeout_s,
                               n, f" (unread: {', '.join(sorted(unread))})" if unread else "")
                return
            inst.action_step = (f"waiting for {n} request(s) to finish"
                                + (f", {len(unread)} engine(s) not answering /metrics"
                                   if unread else ""))
            await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - loop.time())))

    async def engine_requests(self, inst: EngineInstance) -> tuple[int, set[str]]:
        """(requests running + waiting summed over the instance's live engine processes, names
        of the live processes whose ``GET /metrics`` could not be read). A process that does
        not run counts 0."""
        total = 0.0
        unread: set[str] = set()
        for p in inst.processes:
            ep = p.spec.endpoint
            if p.pid is None or ep is None:
                continue
            try:
                # the process's own client: HTTPS to an engine with tls
                status, raw = await p.client.get_json_bytes(ep.host, ep.port, "/metrics",
                                                            METRICS_TIMEOUT_S)
            except Exception:
                unread.add(p.name)
                continue
            if status != 200:
                unread.add(p.name)
                continue
            waiting, running, _ = parse_engine_metrics(raw.decode("utf-8", "replace"))
            total += waiting + running
        return int(round(total)), unread

    @staticmethod
    async def _stop_processes(inst: EngineInstance, reason: str) -> None:
        # shielded: a stop that overrides a drain cancels the drain's task, never a process
        # stop halfway (its SIGKILL step must run)
        await asyncio.shield(asyncio.gather(*(p.stop(reason) for p in inst.processes)))

    def _start_processes(self, inst: EngineInstance, action: Action) -> None:
        inst.admin = AdminState.RUNNING
        for p in inst.processes:
            p.start(fresh=True)
        self._dirty.set()
        logger.info("instance %s: starting on an operator's %s", inst.id, action.value)

    # ------------------------------------------------------------ management
    def status(self) -> dict[str, object]:
        return {"node": self.node.name, "controller": self.controller_url,
                "registered": self.registered, "controller_reachable": self.controller_reachable,
                "log_dir": self.log_dir, "instances": [i.status() for i in self.instances],
                "parts": [p.status() for p in self.parts],
                "npu": {"enabled": self.npu.enabled, "last_error": self.npu.last_error,
                        "chips": self.npu.snapshot()}}

    def _update_metrics(self) -> None:
        groups: list[tuple[str, list[EngineProcess]]] = [(i.id, i.processes)
                                                         for i in self.instances]
        groups += [(part.id, part.processes) for part in self.parts]
        for iid, procs in groups:
            for p in procs:
                self._g_healthy.labels(iid, p.name).set(1 if p.healthy else 0)
                self._g_restarts.labels(iid, p.name).set(p.restarts)
                self._g_failed.labels(iid, p.name).set(1 if p.failed else 0)
                vi = p.vi
                if vi is not None:
                    self._g_vi_failures.labels(iid, p.name).set(vi.failures)
                    self._g_vi_unhealthy.labels(iid, p.name).set(1 if vi.unhealthy else 0)
                    for result, n in (("ok", vi.ok_rounds), ("failed", vi.failed_rounds),
                                      ("busy", vi.busy_rounds)):
                        self._g_vi_rounds.labels(iid, p.name, result).set(n)
        self._g_ctrl.set(1 if self.controller_reachable else 0)
        if not self.npu.enabled:
            return
        self._g_npu_up.set(1 if self.npu.chips and self.npu.last_error is None else 0)
        for g in self._g_npu.values():
            g.clear()
        mb = 1024 * 1024
        for c in self.npu.chips:
            lab = (str(c.npu), str(c.chip), str(c.device), c.name)
            vals = {"healthy": 1.0 if c.healthy else 0.0, "temp_c": c.temp_c,
                    "power_w": c.power_w, "aicore_pct": c.aicore_pct,
                    "hbm_used": c.hbm_used_mb, "hbm_total": c.hbm_total_mb,
                    "memory_used": c.memory_used_mb, "memory_total": c.memory_total_mb}
            for key, v in vals.items():
                if v is None:
                    continue
                if key.startswith(("hbm", "memory")):
                    v = v * mb
                self._g_npu[key].labels(*lab).set(v)

    def _route(self) -> Router:
        r = Router()

        async def health(req: Request, resp: Response) -> None:
            resp.send(200, b'{"status":"ok"}')

        async def instances(req: Request, resp: Response) -> None:
            resp.send(200, orjson.dumps(self.status()))

        async def metrics(req: Request, resp: Response) -> None:
            self._update_metrics()
            resp.send(200, generate_latest(self._metrics), content_type=CONTENT_TYPE_LATEST.encode())

        async def openapi(req: Request, resp: Response) -> None:
            resp.send(200, orjson.dumps(openapi_document()))

        r.add("GET", "/health", health)
        r.add("GET", "/v1/instances", instances)
        r.add("GET", "/metrics", metrics)
        r.add("GET", "/openapi.json", openapi)
        r.add_prefix("POST", INSTANCES_PREFIX, self._on_action)
        return r

    async def _on_action(self, req: Request, resp: Response) -> None:
        """``POST /v1/instances/{id}/{action}``: the id's ``/`` raw or percent-encoded."""
        raw_id, _, name = req.path[len(INSTANCES_PREFIX):].rpartition("/")
        try:
            action = Action(name)
        except ValueError:
            resp.send(404, error_body(404, f"no route for POST {req.path} (expected "
                                           f"{INSTANCES_PREFIX}{{id}}/ and one of "
                                           f"{', '.join(a.value for a in Action)})"))
            return
        body: DrainRequest | None = None
        try:
            data = orjson.loads(req.body) if req.body.strip() else {}
        except orjson.JSONDecodeError as e:
            resp.send(400, error_body(400, f"body: expected a JSON object, got invalid JSON "
                                           f"({e})"))
            return
        if not isinstance(data, dict):
            resp.send(400, error_body(400, f"body: expected a JSON object, got "
                                           f"{type(data).__name__}"))
            return
        model = {Action.DRAIN: DrainRequest, Action.RESTART: RestartRequest}.get(action)
        if model is not None:
            try:
                body = model.model_validate(data)
            except ValidationError as e:
                resp.send(400, error_body(400, _first_error(e), _first_field(e)))
                return
        try:
            status, answer = await self.act(unquote(raw_id), action, body)
        except LookupError as e:
            resp.send(404, error_body(404, str(e.args[0]) if e.args else str(e), "id"))
            return
        except LifecycleConflict as e:
            resp.send(409, error_body(409, str(e)))
            return
        resp.send(status, answer.model_dump_json().encode())


#: the path prefix of the lifecycle routes, ``POST /v1/instances/{id}/{action}``
INSTANCES_PREFIX = "/v1/instances/"


def _first_error(e: ValidationError) -> str:
    """``body.<field>: <what pydantic expected> (got <value>)`` of the first error."""
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    return f"body.{loc}: {err['msg']} (got {err.get('input')!r})"


def _first_field(e: ValidationError) -> str | None:
    loc = e.errors()[0]["loc"]
    return str(loc[0]) if loc else None


def _error_schema() -> dict[str, Any]:
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the management API (served at ``GET /openapi.json``, kept
    in ``docs/openapi/node-manager.json``)."""
    ref = "#/components/schemas/{model}"
    schemas: dict[str, Any] = {"Error": _error_schema()}
    for m in (DrainRequest, RestartRequest, ActionAnswer):
        js = m.model_json_schema(ref_template=ref)
        schemas.update(js.pop("$defs", {}))
        schemas[m.__name__] = js

    def content(name: str) -> dict[str, Any]:
        return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}

    def err(what: str) -> dict[str, Any]:
        return {"description": what, "content": content("Error")}

    id_param = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"},
                "description": "instance id <node>/<engine>/<i>; its '/' raw or "
                               "percent-encoded (%2F)"}
    paths: dict[str, Any] = {
        "/health": {"get": {"summary": "liveness", "responses": {"200": {
            "description": "the node manager runs", "content": {"application/json": {
                "schema": {"type": "object", "properties": {"status": {"const": "ok"}}}}}}}}},
        "/v1/instances": {"get": {
            "summary": "the node's instances: per process state, pid, port, restarts, last "
                       "exit, reason, log, virtual inference; per instance admin_state "
                       "(running, draining, stopped) and the action under way; the last NPU "
                       "sample",
            "responses": {"200": {"description": "node status", "content": {
                "application/json": {"schema": {"type": "object"}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus text (motor_node_*, motor_npu_*)",
                             "responses": {"200": {"description": "metrics", "content": {
                                 "text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "this document", "responses": {"200": {
            "description": "OpenAPI 3.1", "content": {"application/json": {
                "schema": {"type": "object"}}}}}}},
    }
    bodies = {Action.DRAIN: "DrainRequest", Action.RESTART: "RestartRequest"}
    summaries = {
        Action.DRAIN: "report the instance draining (coordinators stop routing to it), wait "
                      "grace_s, wait until its engines have no request running or waiting "
                      "(or timeout_s), then stop it",
        Action.STOP: "stop the instance's processes now (SIGTERM, then SIGKILL after "
                     "stop_timeout_s); cancels a drain or restart under way",
        Action.START: "start a stopped instance (or processes the supervisor gave up on) "
                      "with a fresh restart history",
        Action.RESTART: "drain (drain: true, the default) or stop, then start again",
    }
    accepted = {Action.DRAIN: {"202": "draining", "200": "already stopped: nothing to do"},
                Action.STOP: {"200": "stopped"},
                Action.START: {"202": "starting", "200": "already running: nothing to do"},
                Action.RESTART: {"202": "under way: draining (or stopped), then starting"}}
    for a in Action:
        responses: dict[str, Any] = {code: {"description": what,
                                            "content": content("ActionAnswer")}
                                     for code, what in accepted[a].items()}
        responses["404"] = err("no such instance on this node")
        responses["409"] = err("another action is under way (only stop overrides one)")
        op: dict[str, Any] = {"summary": summaries[a], "parameters": [id_param],
                              "responses": responses}
        responses["400"] = err("the body is not a JSON object (none or {} is fine)"
                               + (", or a field is out of range" if a in bodies else ""))
        if a in bodies:
            op["requestBody"] = {"required": False, "content": content(bodies[a])}
        paths[f"{INSTANCES_PREFIX}{{id}}/{a.value}"] = {"post": op}
    return {"openapi": "3.1.0",
            "info": {"title": "motor node manager management API", "version": "1",
                     "description": "Served by `motor node-manager` on --port / "
                                    "nodes[].mgmt_port (mTLS with controller.tls); the "
                                    "controller forwards the lifecycle calls of its "
                                    "POST /v1/instances/{id}/{action} here."},
            "paths": paths, "components": {"schemas": schemas}}


class LifecycleConflict(Exception):
    """An operator's action refused because another one is under way (HTTP 409)."""


class _ControllerRefused(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"controller answered {status}: {body}")


def _err(e: BaseException) -> str:
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
        return "no answer in time"
    s = str(e)
    return f"{type(e).__name__}: {s}" if s else type(e).__name__


async def serve_node_manager(agent: NodeAgent, stop: asyncio.Event | None = None) -> None:
    """Run ``agent`` until ``stop`` is set (or forever), then stop it."""
    await agent.start()
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await agent.stop()


def run_node_manager(node: NodeConfig, controller_url: str, heartbeat_interval_s: float = 1.0,
                     log_dir: str | None = None, mgmt_host: str | None = None,
                     mgmt_port: int | None = None, tls: ControlPlaneTlsConfig | None = None,
                     cluster: ClusterConfig | None = None) -> int:
    """Blocking entry point: uvloop, SIGTERM/SIGINT -> stop engines, deregister, return 0."""
    install_uvloop()

    async def main() -> None:
        agent = NodeAgent(node, controller_url, heartbeat_interval_s, log_dir, mgmt_host,
                          mgmt_port, tls, cluster)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if agent.tls_files is not None:   # SIGHUP: re-read the certificate files now
            loop.add_signal_handler(signal.SIGHUP, lambda: agent.reload_tls(force=True))
        await serve_node_manager(agent, stop)

    asyncio.run(main())
    return 0
