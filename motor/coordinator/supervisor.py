"""Several ingress workers on one port (``coordinator.workers > 1``), and the feed.

The supervisor binds nothing itself: each worker process listens on the API port with
``SO_REUSEPORT`` and the kernel spreads connections over them. Before starting them it
creates the shared memory of the data plane (docs/coordinator.md): the load table
(:mod:`motor.coordinator.loadtable`), the rate-limit table when some rate limit is
configured (:mod:`motor.coordinator.ratetable`) and two SPSC rings per worker, then starts the feed
process (:mod:`motor.coordinator.feed`: the only follower of the controller, of the
engines' KV events and ``/metrics``) and the workers.

A dead child is restarted (at most ``MAX_RESTARTS`` in ``RESTART_WINDOW_S``, with a
doubling delay); a dead worker's rows of the load and rate tables are reset before its successor
starts, and the successor asks the feed for a snapshot and listens only once it is
applied. On SIGTERM / SIGINT every worker drains (stops accepting, finishes in-flight
requests within ``coordinator.drain_timeout_s``), then the feed stops.

Metrics: every child writes its samples through prometheus-client's multiprocess mode
into ``PROMETHEUS_MULTIPROC_DIR`` (a temporary directory the supervisor creates), and
``/metrics`` on any worker (or on the management port) answers the sum over all of them,
dead ones included (their counters are kept, their live gauges dropped). The children
write those files with :mod:`motor.coordinator.mpvalues` (the library's format, without
its per-update lock).
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from collections import deque

from motor.config.schema import ClusterConfig

logger = logging.getLogger(__name__)

MAX_RESTARTS = 10
RESTART_WINDOW_S = 60.0
STOP_TIMEOUT_S = 15.0
HINT_RING_BYTES = 1024 * 1024


def _worker_main(cfg_json: str, backends: list[str] | None, controller_url: str | None,
                 index: int, log_level: str, shm: tuple[str, str, str | None] | None = None
                 ) -> None:  # pragma: no cover - runs in a child
    import asyncio

    # a SIGHUP the supervisor forwards before the worker's loop handles it does not end it
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from motor.coordinator import mpvalues
    mpvalues.install()   # before the first metric is made (motor.coordinator.metrics)
    from motor.coordinator.app import serve
    from motor.http.server import install_uvloop
    from motor.logs import setup_logging
    setup_logging(log_level)
    cfg = ClusterConfig.model_validate_json(cfg_json)
    install_uvloop()
    asyncio.run(serve(cfg, backends, controller_url, reuse_port=True, worker_index=index,
                      shm=shm, own_process=True))


def static_keys(cfg: ClusterConfig, backends: list[str]) -> list[tuple[str, str | None, str]]:
    """Standalone mode: (endpoint key, KV-event address, URL) of each ``--backend``, as the
    workers name them (:meth:`motor.coordinator.endpoints.EndpointTable.set_static`)."""
    from motor.coordinator.backends import parse_backend
    out = []
    for i, b in enumerate(backends):
        _, host, port = parse_backend(b)
        url = f"http://{host}:{port}"
        out.append((f"backend-{i}#0", cfg.coordinator.kv.events.backends.get(url), url))
    return out


def run_workers(cfg: ClusterConfig, backends: list[str] | None, controller_url: str | None,
                n: int) -> int:
    """Run the feed and ``n`` workers until SIGTERM / SIGINT; returns the exit status."""
    from motor._fast.ring import Ring
    from motor.coordinator.feed import feed_main
    from motor.coordinator.loadtable import LoadTable
    from motor.coordinator.ratelimit import Limit
    from motor.coordinator.ratetable import RateTable, reserved_names
    from motor.coordinator.rings import ring_names

    metrics_dir = tempfile.mkdtemp(prefix="motor-coordinator-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = mp.get_context("spawn")
    cfg_json = cfg.model_dump_json()
    level = logging.getLevelName(logging.getLogger().level).lower()
    prefix = f"motor-coord-{os.getpid()}-{os.urandom(3).hex()}"
    load = LoadTable.create(f"{prefix}-load", n)
    lim = cfg.coordinator.limits
    limited = reserved_names({k: Limit(v.rpm, v.tpm) for k, v in lim.keys.items()})
    rate = RateTable.create(f"{prefix}-rate", n, len(limited)) \
        if limited or lim.default.rpm or lim.default.tpm else None
    rings: list[Ring] = []
    for i in range(n):
        w, h = ring_names(prefix, i)
        rings.append(Ring.create(w, cfg.coordinator.feed.ring_bytes))
        rings.append(Ring.create(h, HINT_RING_BYTES))
    keys = static_keys(cfg, backends) if backends else None
    procs: dict[int, mp.process.BaseProcess] = {}   # worker index -> process; -1: the feed
    restarts: deque[float] = deque()
    stopping = False

    def start(i: int) -> None:
        if i < 0:
            p = ctx.Process(target=feed_main, name="motor-feed",
                            args=(cfg_json, prefix, n, load.name, keys, controller_url, level),
                            daemon=False)
        else:
            # the predecessor's in-flight load died with it; a successor's readiness row
            # counts once it listens (gone until then), a first worker's at once (starting)
            load.reset_row(i, gone=i in procs)
            if rate is not None:
                rate.reset_row(i)   # a single writer of the row again
            p = ctx.Process(target=_worker_main, name=f"motor-worker-{i}",
                            args=(cfg_json, backends, controller_url, i, level,
                                  (prefix, load.name, rate.name if rate else None)),
                            daemon=False)
        p.start()
        procs[i] = p
        logger.info("coordinator %s started (pid %d)", "feed" if i < 0 else f"worker {i}", p.pid)

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    def on_hup(signum: int, frame: object) -> None:
        # re-read the TLS certificate and the key source now: the workers do it
        for i, p in list(procs.items()):
            if i >= 0 and p.pid is not None and p.is_alive():   # the feed serves no TLS
                try:
                    os.kill(p.pid, signal.SIGHUP)
                except ProcessLookupError:
                    pass

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hup)
    try:
        start(-1)
        for i in range(n):
            start(i)
        delay = 0.1
        while not stopping:
            time.sleep(0.05)
            for i, p in list(procs.items()):
                if p.is_alive() or stopping:
                    continue
                from prometheus_client import multiprocess
                multiprocess.mark_process_dead(p.pid)
                if i >= 0:
                    load.worker_gone(i)     # no connection lands on it: not waited for
                what = "feed" if i < 0 else f"worker {i}"
                now = time.monotonic()
                while restarts and now - restarts[0] > RESTART_WINDOW_S:
                    restarts.popleft()
                if len(restarts) >= MAX_RESTARTS:
                    logger.error("coordinator %s died (exit %s); %d restarts in %.0f s: "
                                 "giving up", what, p.exitcode, len(restarts), RESTART_WINDOW_S)
                    return 1
                logger.warning("coordinator %s (pid %d) died with exit %s; restarting",
                               what, p.pid, p.exitcode)
                time.sleep(delay)
                delay = min(delay * 2, 5.0) if restarts else 0.1
                restarts.append(now)
                start(i)
        return 0
    finally:
        # drain: workers first (they stop accepting and finish in-flight requests), then
        # the feed
        feed = [p for i, p in procs.items() if i < 0]
        for group in ([p for i, p in procs.items() if i >= 0], feed):
            for p in group:
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + max(STOP_TIMEOUT_S, cfg.coordinator.drain_timeout_s + 5)
            for p in group:
                p.join(max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join()
        for r in rings:
            r.close()
            r.unlink()
        load.close()
        load.unlink()
        if rate is not None:
            rate.close()
            rate.unlink()
        shutil.rmtree(metrics_dir, ignore_errors=True)

