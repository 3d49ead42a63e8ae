"""B09: an endpoint that leaves and rejoins with requests in flight: no negative counter, no
500 after the engine finished, and a request waiting for a frozen endpoint's first byte is
re-dispatched when the endpoint leaves (not left hanging until a transport timeout), a PD
leg too."""
from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from motor.config.schema import EngineKind, Role
from motor.protocol.instances import Endpoint, Instance, InstanceState, InstanceTable
from motor.sim.engine import EngineConfig
from motor.sim.server import SimServer
from tests.cases.harness import FB, content, default_behave, http, run_async, stream, wait_for
from tests.support.gateway import Gateway
from tests.support.pd_sims import pd_cluster, stop_pd


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


@run_async
async def test_c_a_leaving_rank_evicts_only_its_own_requests():
    """Two DP ranks of one instance share the engine's port, so one connection pool: the
    rank that leaves has its waiting request re-dispatched; the other rank's request, waiting
    on a connection of the same pool, is left alone and gets its engine's answer."""
    release = asyncio.Event()

    async def first_two_wait(fb, req, resp, e):
        if len(fb.log) <= 2:
            await release.wait()         # holds its headers until the test lets it go
        await default_behave(fb, req, resp, e)

    w, x = await FB(behave=first_two_wait).start(), await FB().start()
    gw = await Gateway([]).start()
    try:
        gw.table.apply(InstanceTable(version=1, instances=[
            Instance(id="W", model="m", role=Role.UNION, engine=EngineKind.VLLM, node="n",
                     endpoints=[Endpoint(host="127.0.0.1", port=w.port, dp_rank=r)
                                for r in (0, 1)], state=InstanceState.READY)]))
        eps = sorted(gw.table.endpoints.values(), key=lambda e: e.dp_rank)
        assert len(eps) == 2 and eps[0].pool is eps[1].pool        # one pool for the port
        body = b'{"model":"m","messages":[{"role":"user","content":"r%d"}],"max_tokens":2}'
        reqs = [asyncio.ensure_future(http(gw.port, "POST", "/v1/chat/completions", body % i))
                for i in range(2)]
        assert await wait_for(lambda: len(w.log) == 2)              # one on each rank
        assert all(e.inflight == 1 for e in eps)
        gw.table.apply(InstanceTable(version=2, instances=[
            Instance(id="W", model="m", role=Role.UNION, engine=EngineKind.VLLM, node="n",
                     endpoints=[Endpoint(host="127.0.0.1", port=w.port, dp_rank=r)
                                for r in (0, 1)], state=InstanceState.READY),
            Instance(id="X", model="m", role=Role.UNION, engine=EngineKind.VLLM, node="n",
                     endpoints=[Endpoint(host="127.0.0.1", port=x.port)],
                     state=InstanceState.READY)]))
        gw.table.set_ready(eps[0], False, "test: rank 0 out of rotation")
        # rank 0's request goes elsewhere and is answered; rank 1's still waits on W
        done, pending = await asyncio.wait(reqs, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1 and len(pending) == 1
        st, _, _ = done.pop().result()
        assert st == 200 and len(x.log) + len(w.log) == 3
        assert await wait_for(lambda: sum(e.closed_at is not None for e in w.log[:2]) == 1)
        assert eps[1].inflight == 1 and eps[0].inflight == 0
        release.set()
        st, _, body1 = await asyncio.wait_for(pending.pop(), 5)
        assert st == 200 and b"tok0" in body1                       # W's answer, not an error
        assert sum(e.complete for e in w.log[:2]) == 1
        assert all(e.inflight == 0 for e in gw.table.endpoints.values())
    finally:
        release.set()
        await gw.stop()
        await w.stop()
        await x.stop()


# (mode, frozen role, client stream, retries.max_attempts): the sims send a stream's head at
# once, so a streamed leg is past its head and not evicted (it goes on); the P legs of
# prefill-first and decode-first are never streamed, whatever the client asked
PD_LEGS = [(m, r, False, 3) for m in ("pd_prefill_first", "pd_decode_first", "pd_bootstrap")
           for r in ("prefill", "decode")] + [
    ("pd_prefill_first", "prefill", True, 3), ("pd_decode_first", "prefill", True, 3),
    ("pd_bootstrap", "prefill", False, 1), ("pd_bootstrap", "decode", False, 1)]


@pytest.mark.parametrize(("mode", "role", "stream", "attempts"), PD_LEGS)
@run_async
async def test_d_a_pd_leg_waiting_on_a_leaving_instance_moves(mode: str, role: str,
                                                              stream: bool,
                                                              attempts: int) -> None:
    """A PD leg waiting for the answer head of an instance that leaves the routable set is
    taken off it at once (not after its 30 s first-byte timeout) and sent to the other
    instance of its role. In decode-first the frozen D has already called the metaserver, so
    the prefill it asked for is dropped and the new D's call runs a new one. In bootstrap
    the pair shares P's bootstrap room, so the whole pair is chosen again (a new room), or,
    with no attempt left, the client gets a 502 at once."""
    hits: list[SimServer] = []
    gw, sims, _ = await pd_cluster(mode, EngineConfig(time_scale=0.05), hook=hits.append,
                                   timeouts={"first_token_s": 30.0},
                                   retries={"max_attempts": attempts, "backoff_s": 0.0})
    try:
        frozen, other = [s for s in sims if s.opts.role == role]
        ep_of = {e.port: e for e in gw.table.endpoints.values()}
        frozen.faults.set({"mode": "hang"})
        frozen._apply_global_fault()
        gw.table.set_ready(ep_of[other.port], False, "test: only the frozen one routable")
        body = orjson.dumps({"model": "m", "prompt": "hi " * 10, "max_tokens": 8,
                             "ignore_eos": True, "stream": stream})
        req = asyncio.ensure_future(http(gw.port, "POST", "/v1/completions", body, timeout=20))
        assert await wait_for(lambda: frozen in hits)
        await asyncio.sleep(0.2)            # the leg waits for the frozen instance's head
        assert not req.done()
        gw.table.set_ready(ep_of[other.port], True, "test: back")
        gw.table.set_ready(ep_of[frozen.port], False, "test: the frozen one leaves")
        st, _, got = await asyncio.wait_for(req, 8)
        if attempts == 1:
            assert st == 502 and b"left" in got, got
        else:
            assert st == 200, got
            if stream:
                evs = [ln[6:] for ln in got.split(b"\n") if ln.startswith(b"data: ")]
                assert evs[-1] == b"[DONE]" and not any(b'"error"' in e for e in evs), got
                chunks = [orjson.loads(e)["choices"][0] for e in evs[:-1]]
                assert sum(1 for c in chunks if c["text"]) == 8, got       # a token an event
                assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]
            else:
                assert orjson.loads(got)["usage"]["completion_tokens"] == 8, got
            assert other in hits
        assert await wait_for(lambda: all(e.inflight == 0 for e in gw.table.endpoints.values()))
    finally:
        for s in sims:
            s.faults.set({"mode": "none"})
            s._apply_global_fault()
        await stop_pd(gw, sims)


@run_async
async def test_e_a_late_metaserver_call_of_the_decode_that_left_is_not_taken_for_the_new_ones():
    """decode-first: D1 leaves the routable set before its answer's head and the decode leg
    moves to D2; D1's metaserver call then arrives late, before D2's. The late call names
    D1's request id and is answered 404; D2's call runs the prefill with D2's coordinates,
    and the client gets D2's answer. (Before, both were sent the client's X-Request-Id: the
    late call was taken for D2's, the prefill pushed the KV to D1, and D2's own call got a
    404.)"""
    d1_asked = asyncio.Event()
    d1_may_call = asyncio.Event()
    d1_answered = asyncio.Event()
    d2_got, d2_go = asyncio.Event(), asyncio.Event()
    calls: list[tuple[str, str, int]] = []          # (who, request_id, status)
    late: list[asyncio.Future[None]] = []

    async def call_back(who: str, e: Any, port: int) -> int:
        ktp = e.json["kv_transfer_params"]
        rid = "chatcmpl-" + e.headers["x-request-id"]
        url = ktp["metaserver"].split("/", 3)
        host, mport = url[2].split(":")
        st, _, _ = await http(int(mport), "POST", "/" + url[3], orjson.dumps(
            {"request_id": rid, "do_remote_prefill": False, "do_remote_decode": True,
             "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": port,
             "remote_engine_id": who}), timeout=10)
        calls.append((who, rid, st))
        return st

    async def d1_late_call(fb: FB, e: Any) -> None:
        await d1_may_call.wait()                    # the leg has moved to D2 by now
        await call_back("D1", e, fb.port)
        d1_answered.set()

    async def d1_behave(fb: FB, req: Any, resp: Any, e: Any) -> None:
        # the connector's call is its own task: it outlives the decode request, which the
        # coordinator closes when D1 leaves
        late.append(asyncio.ensure_future(d1_late_call(fb, e)))
        d1_asked.set()
        await asyncio.sleep(30)                     # never answers

    async def d2_behave(fb: FB, req: Any, resp: Any, e: Any) -> None:
        d2_got.set()
        await d2_go.wait()
        d1_may_call.set()
        await d1_answered.wait()                    # D1's late call first
        if await call_back("D2", e, fb.port) != 200:
            resp.send(500, b'{"error":{"message":"no KV came","type":"x","code":500}}')
            return
        await default_behave(fb, req, resp, e)

    p = await FB().start()
    d1, d2 = await FB(behave=d1_behave).start(), await FB(behave=d2_behave).start()
    gw = await Gateway([(Role.PREFILL, "127.0.0.1", p.port), (Role.DECODE, "127.0.0.1", d1.port),
                        (Role.DECODE, "127.0.0.1", d2.port)], mode="pd_decode_first",
                       timeouts={"first_token_s": 30.0},
                       retries={"max_attempts": 3, "backoff_s": 0.0}).start()
    gw.coord.path.metaserver_url = f"http://127.0.0.1:{gw.port}/v1/metaserver"
    try:
        ep_of = {e.port: e for e in gw.table.endpoints.values()}
        gw.table.set_ready(ep_of[d2.port], False, "test: only D1 routable")
        req = asyncio.ensure_future(http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
            headers={"x-request-id": "b09e"}, timeout=20))
        await asyncio.wait_for(d1_asked.wait(), 5)
        gw.table.set_ready(ep_of[d2.port], True, "test: back")
        gw.table.set_ready(ep_of[d1.port], False, "test: D1 leaves")
        await asyncio.wait_for(d2_got.wait(), 5)
        # the moved request still holds its first id: a request that reuses it is refused,
        # and so is one whose own id is the one motor gave the moved leg
        for rid, note in (("b09e", b"must be unique"), ("b09e.d1", b"motor's id for")):
            st, _, got = await http(gw.port, "POST", "/v1/chat/completions", orjson.dumps(
                {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 4}), headers={"x-request-id": rid}, timeout=5)
            assert st == 409 and note in got, (rid, st, got)
        d2_go.set()
        st, hdrs, got = await asyncio.wait_for(req, 8)
        assert st == 200, got
        assert orjson.loads(got)["usage"]["completion_tokens"] == 4
        assert hdrs["x-request-id"] == "b09e"            # the client's id, whatever D2 was sent
        assert calls == [("D1", "chatcmpl-b09e", 404), ("D2", "chatcmpl-b09e.d1", 200)], calls
        prefills = p.gen("/v1/chat/completions")
        assert len(prefills) == 1
        assert prefills[0].json["kv_transfer_params"]["remote_port"] == d2.port
        assert await wait_for(lambda: all(e.inflight == 0 for e in gw.table.endpoints.values()))
        assert gw.coord.path.pending == {}
    finally:
        for t in late:
            t.cancel()
        await gw.stop()
        for fb in (p, d1, d2):
            await fb.stop()
