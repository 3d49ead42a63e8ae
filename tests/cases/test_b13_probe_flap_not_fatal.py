"""B13: one slow or failed health probe does not take workers out; a real outage moves
traffic away, and the worker gets traffic again once it recovers."""
from __future__ import annotations

import asyncio

from tests.cases.harness import cluster, http, run_async, wait_for

REQ = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
CFG = dict(probe=True, health_check_interval_s=0.05, health_check_timeout_s=0.1, health_failures=3)


@run_async
async def test_probe_flap_then_outage_then_recovery():
    async with cluster(2, **CFG) as (fbs, gw):
        a, b = fbs
        assert await wait_for(lambda: gw.probe.synced.is_set())
        # one probe cycle: both /health answer 503 -> no client failure
        a.health_status = b.health_status = 503
        await asyncio.sleep(0.06)
        a.health_status = b.health_status = 200
        for _ in range(10):
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ)
            assert st == 200
        st, _, _ = await http(gw.port, "GET", "/readiness")
        assert st == 200
        # real outage of A: /health fails and inference is refused
        port_a = a.port
        await a.stop()
        fails = 0
        for _ in range(40):
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ)
            fails += st != 200
            st, _, _ = await http(gw.port, "GET", "/health")
            assert st == 200                   # the gateway's own health answers throughout
        assert fails == 0                      # retried on B
        ep_a = next(e for e in gw.table.endpoints.values() if e.port == port_a)
        assert await wait_for(lambda: not ep_a.ready)
        # A recovers on the same port: back in rotation
        await a.start(port_a)
        assert await wait_for(lambda: ep_a.routable(__import__("time").monotonic()), 3.0)
        n = len(a.log)
        for _ in range(6):
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ)
            assert st == 200
        assert len(a.log) > n
