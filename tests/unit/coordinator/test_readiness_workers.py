"""`/readiness` with several workers on one port: a connection lands on any worker that
listens, so the coordinator is ready only when every such worker is (each publishes its
row of the shared load table; any worker answers from all the rows). A worker that died,
is being replaced or drains takes no connection: its row is left out."""
from __future__ import annotations

import os

import orjson

from motor.config.schema import Role
from motor.coordinator.loadtable import GONE, LISTENING, STARTING, LoadTable
from tests.support.fake_backend import FakeBackend
from tests.support.gateway import Gateway, http, run_async


async def readiness(port: int) -> tuple[int, dict]:
    st, _, body = await http(port, "GET", "/readiness")
    return st, orjson.loads(body)


@run_async
async def test_ready_only_when_every_listening_worker_is():
    fb = await FakeBackend().start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port)]).start()
    shared = LoadTable.create(f"motor-test-ready-{os.getpid()}-{os.urandom(3).hex()}", 2)
    try:
        st, body = await readiness(gw.port)
        assert st == 200 and "workers_synced" not in body   # one worker: its own table
        gw.coord.workers = shared        # worker 0 of 2; worker 1 has not started yet
        gw.coord.listening = True
        st, body = await readiness(gw.port)
        assert st == 503                 # a first start's worker counts before it listens
        assert body["workers_synced"] == [True, False]
        assert body["workers_routable"] == [1, 0] and body["routable_endpoints"] == 0
        shared.publish_ready(1, LISTENING, True, 0)   # listens, synced, routes nowhere yet
        st, body = await readiness(gw.port)
        assert st == 503 and body["instance_table_synced"] is True
        shared.publish_ready(1, LISTENING, True, 1)
        st, body = await readiness(gw.port)
        assert st == 200 and body["routable_endpoints"] == 1
        assert body["workers_synced"] == [True, True]
        shared.worker_gone(1)            # it died: no connection lands on it
        st, body = await readiness(gw.port)
        assert st == 200 and body["workers_synced"] == [True, None]
        shared.reset_row(1, gone=True)   # its successor starts: left out until it listens
        st, body = await readiness(gw.port)
        assert st == 200 and body["workers_routable"] == [1, None]
        # the successor's own publishing before it listens leaves the row as it is
        from motor.coordinator.server import Coordinator
        successor = Coordinator(gw.cfg, gw.table, gw.coord.policy, worker_index=1)
        successor.workers = shared
        assert successor.publish_ready() == (True, 1)
        st, body = await readiness(gw.port)
        assert st == 200 and body["workers_routable"] == [1, None]
        successor.listening = True
        successor.publish_ready()
        assert shared.readiness()[1] == (LISTENING, True, 1)
        shared.publish_ready(1, LISTENING, False, 0)   # listening, its table not synced yet
        st, body = await readiness(gw.port)
        assert st == 503 and body["workers_synced"] == [True, False]
        shared.publish_ready(1, LISTENING, True, 1)
        shared.publish_ready(1, GONE, False, 1)       # it drains
        st, body = await readiness(gw.port)
        assert st == 200
        gw.coord.draining = True         # this one drains too: it answers 503
        st, body = await readiness(gw.port)
        assert st == 503 and body["workers_synced"] == [None, None]
        assert [r[0] for r in shared.readiness()] == [GONE, GONE]
        shared.reset_row(0)
        assert shared.readiness()[0] == (STARTING, False, 0)
    finally:
        gw.coord.workers = None
        shared.close()
        shared.unlink()
        await gw.stop()
        await fb.stop()
