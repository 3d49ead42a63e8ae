"""The cyclic garbage collector's settings in a coordinator worker process.

A worker's requests make and drop container objects (coroutines, futures, frames' dicts and,
with ``kv_affinity``, the token-id lists its caches keep for a few thousand requests) at tens
of thousands a second. With Python's default thresholds (700, 10, 10) the young generation
is collected every few hundred requests, and every few seconds a full collection walks every
object the process holds: on the peer harness's kv_affinity run (1 worker, wrk -c64) that was
3-4 % of the worker's CPU and single pauses of 30-75 ms (``docs/benchmarks.md``, "Garbage
collection in the worker").

:func:`tune` collects startup's garbage once, freezes what startup made (``gc.freeze()``:
the modules, the config, the tables; frozen objects are still freed by reference counting
when dropped, only a cycle among them is never collected, a loss bounded by what startup
made) and raises the young generation's threshold. Cycles that requests leave are still
collected; a higher threshold only lets more allocations pass between two collections.

Only a worker's own process calls it (``motor coordinator`` and each worker of the
supervisor): a coordinator run inside another program (the tests) leaves that program's
collector as it is.
"""
from __future__ import annotations

import gc
import logging

from motor.config.schema import GcConfig

logger = logging.getLogger(__name__)


def tune(cfg: GcConfig) -> tuple[int, int, int]:
    """Apply ``cfg`` to this process's collector; returns the thresholds now in force
    (``gc.get_threshold()``). ``young_threshold`` 0 keeps the thresholds as they are."""
    if cfg.young_threshold:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(cfg.young_threshold, older, oldest)
    if cfg.freeze:
        gc.collect()    # startup's garbage is freed, not frozen for the process's life
        gc.freeze()
    logger.debug("gc: thresholds %s, %d objects frozen", gc.get_threshold(),
                 gc.get_freeze_count())
    return gc.get_threshold()
