"""B09: an endpoint that leaves and rejoins with requests in flight: no negative counter, no
500 after the engine finished, and a request waiting for a frozen endpoint's first byte is
re-dispatched when the endpoint leaves (not left hanging until a transport timeout)."""
from __future__ import annotations

import asyncio

from motor.config.schema import EngineKind, Role
from motor.protocol.instances import Endpoint, Instance, InstanceState, InstanceTable
from tests.cases.harness import FB, content, http, run_async, stream, wait_for
from tests.support.gateway import Gateway


def table(version: int, fbs: dict[str, FB]) -> InstanceTable:
    return InstanceTable(version=version, instances=[
        Instance(id=name, model="m", role=Role.UNION, engine=EngineKind.VLLM, node="n",
                 endpoints=[Endpoint(host="127.0.0.1", port=fb.port)], state=InstanceState.READY)
        for name, fb in fbs.items()])


SLOW = b'{"model":"m","messages":[{"role":"user","content":"x"}],"stream":true,"max_tokens":%d}'


@run_async
async def test_a_leave_and_rejoin_keeps_counters_exact():
    w, x = await FB(token_delay_s=0.05).start(), await FB(token_delay_s=0.05).start()
    gw = await Gateway([]).start()
    try:
        gw.table.apply(table(1, {"W": w, "X": x}))
        # R1 lands on W (round robin starts there)
        r1 = asyncio.ensure_future(stream(gw.port, "/v1/chat/completions", SLOW % 30))
        assert await wait_for(lambda: len(w.log) == 1)
        gw.table.apply(table(2, {"X": x}))                 # W leaves
        await asyncio.sleep(0.1)
        gw.table.apply(table(3, {"W": w, "X": x}))         # W rejoins, same URL
        st, _, evs, _ = await r1
        assert st == 200 and evs[-1] == b"[DONE]" and len(content(evs)) == 30  # drained normally
        eps = gw.table.endpoints
        assert all(e.inflight == 0 and e.inflight_tokens == 0 for e in eps.values())
        # R2 on W after the rejoin completes; counters never negative
        w.token_delay_s = x.token_delay_s = 0.0
        for _ in range(20):
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions",
                                  b'{"model":"m","messages":[{"role":"user","content":"y"}],"max_tokens":2}')
            assert st == 200
            assert all(e.inflight >= 0 for e in eps.values())
        n_w = len(w.log) - 1
        assert 6 <= n_w <= 14
        assert all(e.inflight == 0 for e in eps.values())
    finally:
        await gw.stop()
        await w.stop()
        await x.stop()


@run_async
async def test_b_request_waiting_on_a_removed_endpoint_is_redispatched():
    async def frozen(fb, req, resp, e):
        await asyncio.sleep(60)          # delays its headers; keeps the TCP connection open

    w, x = await FB(behave=frozen).start(), await FB().start()
    gw = await Gateway([]).start()
    try:
        gw.table.apply(table(1, {"W": w, "X": x}))
        r3 = asyncio.ensure_future(http(gw.port, "POST", "/v1/chat/completions",
                                        b'{"model":"m","messages":[{"role":"user","content":"x"}]}'))
        assert await wait_for(lambda: len(w.log) == 1)
        gw.table.apply(table(2, {"X": x}))                 # W removed (controller / probes)
        st, _, body = await asyncio.wait_for(r3, 5)         # re-dispatched, not left waiting
        assert st == 200 and len(x.log) == 1
        assert await wait_for(lambda: w.log[0].closed_at is not None)
        assert all(e.inflight == 0 for e in gw.table.endpoints.values())
    finally:
        await gw.stop()
        await w.stop()
        await x.stop()
