"""Several ingress workers on one port (``coordinator.workers > 1``).

The supervisor process binds nothing itself: each worker process listens on the
API port with ``SO_REUSEPORT`` and the kernel spreads connections over them. The
supervisor restarts a worker that died (at most ``MAX_RESTARTS`` in
``RESTART_WINDOW_S``, with a doubling delay), and on SIGTERM / SIGINT tells every
worker to drain (stop accepting, finish in-flight requests) and waits for them.

Metrics: workers write their samples through prometheus-client's multiprocess
mode into ``PROMETHEUS_MULTIPROC_DIR`` (a temporary directory the supervisor
creates), and ``/metrics`` on any worker answers the sum over all workers, dead
ones included (their counters are kept, their live gauges dropped).

This is the first step of the design's data plane: each worker still follows the
controller and keeps its own instance table and in-flight counters; the feed
process with shared-memory rings and the shared load table come with the
multi-process coordinator issue.
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


def _worker_main(cfg_json: str, backends: list[str] | None, controller_url: str | None,
                 index: int, log_level: str) -> None:  # pragma: no cover - runs in a child
    import asyncio

    from motor.coordinator.app import serve
    from motor.http.server import install_uvloop
    from motor.logs import setup_logging
    setup_logging(log_level)
    cfg = ClusterConfig.model_validate_json(cfg_json)
    install_uvloop()
    asyncio.run(serve(cfg, backends, controller_url, reuse_port=True, worker_index=index))


def run_workers(cfg: ClusterConfig, backends: list[str] | None, controller_url: str | None,
                n: int) -> int:
    """Run ``n`` workers until SIGTERM / SIGINT; returns the exit status."""
    metrics_dir = tempfile.mkdtemp(prefix="motor-coordinator-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = mp.get_context("spawn")
    cfg_json = cfg.model_dump_json()
    level = logging.getLevelName(logging.getLogger().level).lower()
    procs: dict[int, mp.process.BaseProcess] = {}
    restarts: deque[float] = deque()
    stopping = False

    def start(i: int) -> None:
        p = ctx.Process(target=_worker_main, name=f"motor-worker-{i}",
                        args=(cfg_json, backends, controller_url, i, level), daemon=False)
        p.start()
        procs[i] = p
        logger.info("coordinator worker %d started (pid %d)", i, p.pid)

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        for i in range(n):
            start(i)
        delay = 0.1
        while not stopping:
            time.sleep(0.1)
            for i, p in list(procs.items()):
                if p.is_alive() or stopping:
                    continue
                from prometheus_client import multiprocess
                multiprocess.mark_process_dead(p.pid)
                now = time.monotonic()
                while restarts and now - restarts[0] > RESTART_WINDOW_S:
                    restarts.popleft()
                if len(restarts) >= MAX_RESTARTS:
                    logger.error("coordinator worker %d died (exit %s); %d restarts in %.0f s: "
                                 "giving up", i, p.exitcode, len(restarts), RESTART_WINDOW_S)
                    return 1
                logger.warning("coordinator worker %d (pid %d) died with exit %s; restarting",
                               i, p.pid, p.exitcode)
                time.sleep(delay)
                delay = min(delay * 2, 5.0) if restarts else 0.1
                restarts.append(now)
                start(i)
        return 0
    finally:
        for p in procs.values():
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in procs.values():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(metrics_dir, ignore_errors=True)


def render_metrics() -> bytes:
    """Prometheus text of this process, or of all workers in multiprocess mode."""
    from prometheus_client import CollectorRegistry, generate_latest

    from motor.coordinator import metrics
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        return generate_latest(reg)
    return generate_latest(metrics.REGISTRY)
