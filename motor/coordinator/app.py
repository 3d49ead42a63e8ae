"""Assembling and running one coordinator process."""
from __future__ import annotations

import asyncio
import logging
import signal

from motor.aio import cancel_and_wait
from motor.config.schema import ClusterConfig, CoordinatorConfig
from motor.coordinator.backends import is_https, parse_backend
from motor.coordinator.edge import tls_contexts
from motor.coordinator.endpoints import ControllerWatcher, EndpointTable, StaticBackends
from motor.coordinator.gctune import tune
from motor.coordinator.kv.router import KvRouter
from motor.coordinator.kv.subscriber import KvEventFeed
from motor.coordinator.policy import make_policy
from motor.coordinator.server import Coordinator
from motor.http.client import Client
from motor.http.server import HttpServer
from motor.http.tls import CertReloader

logger = logging.getLogger(__name__)


async def _housekeeping(coord: Coordinator, cert_reloader: CertReloader | None,
                        c: CoordinatorConfig) -> None:
    """Every few seconds: a changed key source or TLS certificate is re-read."""
    step = c.tls.reload_interval_s if c.tls is not None else 2.0
    while True:
        await asyncio.sleep(step)
        if cert_reloader is not None:
            cert_reloader.check()
        coord.edge.housekeeping()


async def _publish_ready(coord: Coordinator) -> None:
    """With several workers: this worker's readiness row, every ``READY_PUBLISH_S``
    (:meth:`Coordinator.publish_ready`; any worker's ``/readiness`` reads every row)."""
    from motor.coordinator.loadtable import READY_PUBLISH_S
    while True:
        coord.publish_ready()
        await asyncio.sleep(READY_PUBLISH_S)


async def serve(cfg: ClusterConfig, backends: list[str] | None = None,
                controller_url: str | None = None, stop: asyncio.Event | None = None,
                ready_file: str | None = None, reuse_port: bool = False,
                worker_index: int = 0, shm: tuple[str, str, str | None] | None = None,
                own_process: bool = False) -> None:
    """Run until ``stop`` is set or SIGTERM/SIGINT; then drain in-flight requests.

    ``shm``: (ring prefix, load table name, rate table name or None) of a multi-worker
    coordinator: this worker gets the instance table, slots and KV events from the feed
    process (:class:`motor.coordinator.rings.WorkerLink`), counts load in its row of the
    shared load table and what it admits in its row of the rate table
    (:mod:`motor.coordinator.ratetable`, when some rate limit is configured), and listens
    only once the feed's snapshot is applied.
    """
    c = cfg.coordinator
    https = [b for b in backends or () if is_https(b)]
    # following a controller: any engine may register as https (engines[].tls), so the
    # engines' context (coordinator.upstream_tls; the system's CAs by default) is always made
    server_tls, cert_reloader, upstream_tls = tls_contexts(c, bool(https) or not backends)
    if upstream_tls is not None and not c.upstream_tls.verify:
        logger.warning("coordinator.upstream_tls.verify is false: engines' certificates are "
                       "not checked")
    client = Client(max_connections_per_endpoint=c.max_connections_per_endpoint,
                    connect_timeout_s=c.timeouts.connect_s, tls=upstream_tls,
                    pool_wait_s=c.timeouts.pool_wait_s,
                    max_idle_per_endpoint=c.max_idle_connections_per_endpoint)
    for b in https:
        _, host, port = parse_backend(b)
        client.use_tls(host, port)
    table = EndpointTable(client)
    kv_feed: KvEventFeed | None = None
    kv_router: KvRouter | None = None
    if c.policy.value == "kv_affinity":
        kv_router = KvRouter(c.kv, adapters=table.adapters)   # learned by the model probes
        if shm is None:
            kv_feed = KvEventFeed(kv_router, table)
        policy = make_policy(c.policy.value, router=kv_router)
    else:
        policy = make_policy(c.policy.value)
    rate_table = None
    if shm is not None and shm[2]:
        from motor.coordinator.ratetable import RateTable
        rate_table = RateTable.attach(shm[2])
    coord = Coordinator(c, table, policy, rate_table=rate_table, worker_index=worker_index)
    tasks: list[asyncio.Task[None]] = []
    if kv_feed is not None:
        tasks.append(asyncio.ensure_future(kv_feed.run()))
    source: StaticBackends | ControllerWatcher | None = None
    if backends:
        table.set_static([parse_backend(b) for b in backends], c.kv.events.backends)
        source = StaticBackends(table, c.health_check_interval_s, c.health_check_timeout_s,
                                c.health_failures)
        coord.ready_source = source.synced
    elif shm is None:
        source = ControllerWatcher(table, controller_url or ",".join(cfg.controller.urls),
                                   models_interval_s=c.health_check_interval_s,
                                   models_timeout_s=c.health_check_timeout_s,
                                   tls=cfg.controller.tls)
        coord.ready_source = source.synced
    if source is not None:
        tasks.append(asyncio.ensure_future(source.run()))
    link = None
    publisher: asyncio.Task[None] | None = None
    if shm is not None:
        from motor._fast.ring import Ring
        from motor.coordinator.loadtable import LoadTable
        from motor.coordinator.rings import WorkerLink, ring_names
        prefix, load_name, _ = shm
        load = LoadTable.attach(load_name)
        w_ring, h_ring = ring_names(prefix, worker_index)
        sessions = getattr(policy, "sessions", None)   # kv_affinity's session table
        link = WorkerLink(worker_index, load, Ring.attach(w_ring), Ring.attach(h_ring), table,
                          kv_router, static=bool(backends), sessions=sessions)
        if sessions is not None:
            policy.on_session = link.session_routed  # type: ignore[attr-defined]
        if source is None:
            coord.ready_source = link.synced
        coord.workers = load
        tasks.append(asyncio.ensure_future(link.run()))
        await link.synced.wait()   # the feed's snapshot, before the first request
        logger.info("coordinator worker %d synced with the feed (%d slot(s))", worker_index,
                    len(link.slots))

    server = HttpServer(coord.router, max_body_bytes=c.max_body_bytes,
                        max_header_bytes=c.max_header_bytes,
                        request_read_timeout_s=c.request_read_timeout_s,
                        keepalive_timeout_s=c.keepalive_timeout_s,
                        send_timeout_s=c.send_timeout_s)
    server.expect_check = coord.expect_check
    server.on_handler_error = coord.handler_failed
    if own_process:
        tune(c.gc)      # before it listens: its one full collection delays no request
    port = await server.listen(c.host, c.port, reuse_port=reuse_port, tls=server_tls)
    coord.listening = True
    if coord.workers is not None:
        # its row counts from its first publish, at once (before it listens the row is
        # the supervisor's)
        publisher = asyncio.ensure_future(_publish_ready(coord))
        tasks.append(publisher)
    mode = f"standalone, {len(backends)} backend(s)" if backends else \
        f"following controller {controller_url or ', '.join(cfg.controller.urls)}"
    logger.info("coordinator worker %d listening on %s://%s:%d (%s, mode=%s, policy=%s)",
                worker_index, "https" if server_tls else "http", c.host, port, mode,
                c.mode.value, policy.name)
    if cert_reloader is not None or coord.edge.keys is not None:
        tasks.append(asyncio.ensure_future(_housekeeping(coord, cert_reloader, c)))
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(str(port))

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover
            pass
    # SIGHUP re-reads the TLS certificate and the key source now; with neither it does
    # nothing (its default action would end the worker: a supervisor forwards SIGHUP to
    # every worker, and a reload signal to a gateway must not cut its requests)
    def on_hup() -> None:
        if cert_reloader is not None:
            cert_reloader.check(force=True)
        coord.edge.housekeeping()
    try:
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    except (NotImplementedError, RuntimeError):  # pragma: no cover
        pass
    await stop.wait()
    coord.draining = True    # /readiness answers 503 from now on (on every worker's port)
    if publisher is not None:
        await cancel_and_wait(publisher)
        coord.publish_ready()
    logger.info("coordinator stopping: draining %d in-flight request(s)", server.inflight)
    await server.shutdown(drain_timeout_s=c.drain_timeout_s)
    coord.close()       # after the drain: the last requests' spans are flushed
    await cancel_and_wait(*tasks)
    if source is not None:
        source.close()
    if kv_feed is not None:
        kv_feed.close()
    if link is not None:
        link.close()
        link.load.close()
    if rate_table is not None:
        rate_table.close()
    table.close()
    client.close()
