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

Environment: ``MOTOR_ENGINE_LOG_DIR`` (engine logs, see ``log_dir``),
``MOTOR_ENGINE_START_ATTEMPTS`` (an integer >= 1: failed starts in a row of an engine that was
never healthy after which the node manager gives up on it; ``motor up`` sets it so a bad
engine flag fails the start-up at once instead of restarting for minutes).
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
import time
from urllib.parse import urlsplit

import orjson
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from motor.aio import cancel_and_wait
from motor.http.server import ListenError, bind_error_reason  # noqa: F401
from motor.config.schema import ClusterConfig, ControlPlaneTlsConfig, NodeConfig
from motor.control_tls import client_context, controller_endpoint, server_context
from motor.errors import ConfigError
from motor.http import Client, HttpServer, Request, Response, Router, install_uvloop
from motor.node_manager.engines import InstancePlan, plan_node
from motor.node_manager.npu import NpuMonitor
from motor.node_manager.supervisor import EngineProcess, ProcState
from motor.protocol.instances import (EngineHealth, Heartbeat, NodeRegistration, NpuChip,
                                      VirtualInferenceStatus)

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


def start_attempts_from_env() -> int | None:
    """``$MOTOR_ENGINE_START_ATTEMPTS`` as an integer >= 1, else None (unset or not valid)."""
    raw = os.environ.get(ENGINE_START_ATTEMPTS_ENV, "").strip()
    try:
        n = int(raw)
    except ValueError:
        return None
    return n if n >= 1 else None


class EngineInstance:
    """One registered instance = one or more engine processes (one per DP rank for sim)."""

    def __init__(self, plan: InstancePlan, processes: list[EngineProcess]) -> None:
        self.plan = plan
        self.processes = processes

    @property
    def id(self) -> str:
        return self.plan.id

    @property
    def healthy(self) -> bool:
        return all(p.healthy for p in self.processes)

    @property
    def failed(self) -> bool:
        """Sent in heartbeats' ``failed``: gave up, or not launched because its port is busy."""
        return any(p.failed or p.port_busy for p in self.processes)

    @property
    def reason(self) -> str | None:
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
        ``http://host:port`` of the controller.
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
        self.controller = parse_url(controller_url)
        host, port, https = controller_endpoint(
            controller_url if "//" in controller_url else "http://" + controller_url, tls)
        #: the management API's server context (mTLS) with ``controller.tls``
        self._server_tls = server_context(tls) if tls is not None else None
        self.heartbeat_interval_s = heartbeat_interval_s
        self.log_dir = log_dir or node.log_dir or os.environ.get(ENGINE_LOG_DIR_ENV) or None
        self._temp_log_dir = False  #: log_dir is a temp dir this agent made (removed on stop)
        self.mgmt_host = mgmt_host or node.host
        self.mgmt_port_wanted = mgmt_port if mgmt_port is not None else node.mgmt_port
        self.mgmt_port: int | None = None
        self.plans = plan_node(node, cluster)  # raises ConfigError on a bad engine_config
        # one client: plain HTTP to the engines, mTLS to the controller with controller.tls
        self.client = Client(connect_timeout_s=2.0,
                             tls=client_context(tls) if tls is not None else None)
        if https:
            self.client.use_tls(host, port)
        self.instances: list[EngineInstance] = []
        self.registered = False
        self._ever_registered = False
        self.controller_reachable = False
        self._dirty = asyncio.Event()
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
        attempts = start_attempts_from_env()
        for plan in self.plans:
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
        await asyncio.gather(*(p.stop() for i in self.instances for p in i.processes))
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
        if failed:
            logger.warning("node manager %s: engine logs kept in %s (engine(s) that failed: %s)",
                           self.node.name, self.log_dir, ", ".join(failed))
            return
        shutil.rmtree(self.log_dir, ignore_errors=True)

    # ------------------------------------------------------------ controller
    def registration(self) -> NodeRegistration:
        return NodeRegistration(node=self.node.name, host=self.node.host,
                                instances=[i.plan.spec(healthy=i.healthy) for i in self.instances],
                                mgmt_port=self.mgmt_port)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(node=self.node.name,
                         health={i.id: i.healthy for i in self.instances},
                         failed=[i.id for i in self.instances if i.failed],
                         reasons={i.id: r for i in self.instances if (r := i.reason)},
                         engines={i.id: i.engine_health() for i in self.instances},
                         npu=[NpuChip(**c) for c in self.npu.snapshot()])

    async def _post(self, path: str, body: object, timeout_s: float) -> dict[str, object]:
        data = body.model_dump_json().encode() if hasattr(body, "model_dump_json") \
            else orjson.dumps(body)
        host, port = self.controller
        status, raw = await self.client.post_json_bytes(host, port, path, data, timeout_s)
        if status != 200:
            raise _ControllerRefused(status, raw[:300].decode("utf-8", "replace"))
        out = orjson.loads(raw)
        return out if isinstance(out, dict) else {}

    async def _control_loop(self) -> None:
        timeout = max(1.0, min(5.0, 2 * self.heartbeat_interval_s))
        backoff_min = min(0.2, self.heartbeat_interval_s)
        backoff_max = max(backoff_min, self.heartbeat_interval_s)
        backoff = backoff_min
        outage_since: float | None = None
        started = time.monotonic()
        warned = False   # the outage of this try was logged at WARNING
        while True:
            try:
                if not self.registered:
                    r = await self._post("/v1/nodes/register", self.registration(), timeout)
                    self.registered = True
                    self._ever_registered = True
                    logger.info("node manager %s: registered %d instance(s) with %s (version %s)",
                                self.node.name, len(self.instances), self.controller_url,
                                r.get("version"))
                else:
                    self._dirty.clear()
                    r = await self._post("/v1/nodes/heartbeat", self.heartbeat(), timeout)
                    if r.get("known") is False:
                        logger.info("node manager %s: controller does not know this node "
                                    "(restarted?): registering again", self.node.name)
                        self.registered = False
                        continue
                if outage_since is not None:
                    logger.info("node manager %s: controller %s reachable again after %.1f s",
                                self.node.name, self.controller_url, time.monotonic() - outage_since)
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

    # ------------------------------------------------------------ management
    def status(self) -> dict[str, object]:
        return {"node": self.node.name, "controller": self.controller_url,
                "registered": self.registered, "controller_reachable": self.controller_reachable,
                "log_dir": self.log_dir, "instances": [i.status() for i in self.instances],
                "npu": {"enabled": self.npu.enabled, "last_error": self.npu.last_error,
                        "chips": self.npu.snapshot()}}

    def _update_metrics(self) -> None:
        for i in self.instances:
            for p in i.processes:
                self._g_healthy.labels(i.id, p.name).set(1 if p.healthy else 0)
                self._g_restarts.labels(i.id, p.name).set(p.restarts)
                self._g_failed.labels(i.id, p.name).set(1 if p.failed else 0)
                vi = p.vi
                if vi is not None:
                    self._g_vi_failures.labels(i.id, p.name).set(vi.failures)
                    self._g_vi_unhealthy.labels(i.id, p.name).set(1 if vi.unhealthy else 0)
                    for result, n in (("ok", vi.ok_rounds), ("failed", vi.failed_rounds),
                                      ("busy", vi.busy_rounds)):
                        self._g_vi_rounds.labels(i.id, p.name, result).set(n)
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

        r.add("GET", "/health", health)
        r.add("GET", "/v1/instances", instances)
        r.add("GET", "/metrics", metrics)
        return r


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
        await serve_node_manager(agent, stop)

    asyncio.run(main())
    return 0
