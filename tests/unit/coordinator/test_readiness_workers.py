"""`/readiness` with several workers on one port: a connection lands on any worker, so
the coordinator is ready only when every worker is (each publishes its row of the shared
load table; any worker answers from all the rows)."""
from __future__ import annotations

import os

import orjson

from motor.config.schema import Role
from motor.coordinator.loadtable import LoadTable
from tests.support.fake_backend import FakeBackend
from tests.support.gateway import Gateway, http, run_async


async def readiness(port: int) -> tuple[int, dict]:
    st, _, body = await http(port, "GET", "/readiness")
    return st, orjson.loads(body)


@run_async
async def test_ready_only_when_every_worker_published_ready():
    fb = await FakeBackend().start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port)]).start()
    shared = LoadTable.create(f"motor-test-ready-{os.getpid()}-{os.urandom(3).hex()}", 2)
    try:
        st, body = await readiness(gw.port)
        assert st == 200 and "workers_synced" not in body   # one worker: its own table
        gw.coord.workers = shared        # worker 0 of 2; worker 1 has published nothing
        st, body = await readiness(gw.port)
        assert st == 503
        assert body["workers_synced"] == [True, False]
        assert body["workers_routable"] == [1, 0] and body["routable_endpoints"] == 0
        shared.publish_ready(1, True, 0)     # synced, but it routes nowhere yet
        st, body = await readiness(gw.port)
        assert st == 503 and body["instance_table_synced"] is True
        shared.publish_ready(1, True, 1)
        st, body = await readiness(gw.port)
        assert st == 200 and body["routable_endpoints"] == 1
        assert body["workers_synced"] == [True, True]
        shared.reset_row(1)                  # worker 1 died; its successor not yet synced
        st, body = await readiness(gw.port)
        assert st == 503 and body["workers_synced"] == [True, False]
        shared.publish_ready(1, True, 1)
        gw.coord.draining = True             # this worker stops: not ready, on every port
        st, body = await readiness(gw.port)
        assert st == 503 and body["workers_synced"] == [False, True]
        assert shared.readiness() == [(False, 1), (True, 1)]
    finally:
        gw.coord.workers = None
        shared.close()
        shared.unlink()
        await gw.stop()
        await fb.stop()
