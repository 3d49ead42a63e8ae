"""The task that answers a connection's requests (both servers, real TCP on 127.0.0.1).

The compiled protocol (motor._fast.http1) answers a keep-alive connection's requests in one
task, parked between requests; the reference starts a task per request. Either way: a
handler that outlives its answer never holds the next request back, a cancellation a handler
left on its task does not reach the next request, and no task outlives its
connection."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from motor._fast import http1
from motor.http import server
from motor.http.server import HttpServer, Router

IMPLS = {"python": server.HttpProtocol, "compiled": http1.HttpProtocol}


def router(state: dict[str, Any]) -> Router:
    r = Router()
    release = asyncio.Event()
    state["tasks"] = []
    state["tail_done"] = False

    @r.get("/task")
    async def task(req, resp):
        state["tasks"].append(asyncio.current_task())
        resp.send(200, b"t")

    @r.get("/tail")
    async def tail(req, resp):
        resp.send(200, b"answered")          # the answer is out; the handler goes on
        await asyncio.wait_for(release.wait(), 5)
        state["tail_done"] = True

    @r.get("/release")
    async def rel(req, resp):
        release.set()
        resp.send(200, b"released")

    @r.get("/leave-cancel")
    async def leave_cancel(req, resp):
        t = asyncio.current_task()
        assert t is not None
        t.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            pass                              # swallowed without uncancel()
        resp.send(200, b"left")

    @r.get("/evicted")
    async def evicted(req, resp):
        # as the union path when an endpoint leaves: someone else cancels the task, the
        # handler tells that cancellation from its own client leaving by Task.uncancel() == 0
        t = asyncio.current_task()
        assert t is not None
        asyncio.get_running_loop().call_later(0.01, t.cancel)
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            if t.uncancel() == 0:
                resp.send(200, b"evicted")
                return
            raise
        resp.send(200, b"slept")

    return r


async def start(impl: str, state: dict[str, Any]) -> tuple[HttpServer, int]:
    srv = HttpServer(router(state), keepalive_timeout_s=30)
    srv.protocol = IMPLS[impl]
    port = await srv.listen("127.0.0.1", 0)
    return srv, port


@contextlib.asynccontextmanager
async def serving(impl: str) -> AsyncIterator[tuple[dict[str, Any], int]]:
    """A server of ``impl`` on 127.0.0.1: (the handlers' state, its port); shut down after."""
    state: dict[str, Any] = {}
    srv, port = await start(impl, state)
    try:
        yield state, port
    finally:
        await srv.shutdown(0.5)


async def get(rd: asyncio.StreamReader, wr: asyncio.StreamWriter, path: str) -> bytes:
    """One keep-alive GET on an open connection: the body of its answer."""
    wr.write(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
    await wr.drain()
    head = await asyncio.wait_for(rd.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 "), head
    n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await asyncio.wait_for(rd.readexactly(n), 5)


def test_keep_alive_requests_share_one_task_in_the_compiled_server() -> None:
    async def go() -> None:
        async with serving("compiled") as (state, port):
            a = await asyncio.open_connection("127.0.0.1", port)
            b = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(4):
                assert await get(*a, "/task") == b"t"
            assert await get(*b, "/task") == b"t"
            assert await get(*a, "/task") == b"t"
            tasks = state["tasks"]
            assert len(tasks) == 6
            assert len({id(t) for t in tasks[:4] + tasks[5:]}) == 1   # connection a: one task
            assert tasks[4] is not tasks[0]                            # b has its own
            for _, wr in (a, b):
                wr.close()
    asyncio.run(go())


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_a_handler_that_outlives_its_answer_does_not_hold_the_next_request(impl: str) -> None:
    async def go() -> None:
        async with serving(impl) as (state, port):
            conn = await asyncio.open_connection("127.0.0.1", port)
            assert await get(*conn, "/tail") == b"answered"
            # the tail waits for this request: queued behind it, neither would ever end
            assert await get(*conn, "/release") == b"released"
            for _ in range(50):
                if state["tail_done"]:
                    break
                await asyncio.sleep(0.01)
            assert state["tail_done"]
            assert await get(*conn, "/task") == b"t"
            conn[1].close()
    asyncio.run(go())


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_a_cancellation_left_on_the_task_does_not_reach_the_next_request(impl: str) -> None:
    async def go() -> None:
        async with serving(impl) as (_, port):
            conn = await asyncio.open_connection("127.0.0.1", port)
            assert await get(*conn, "/leave-cancel") == b"left"
            # a handler tells an eviction from a real cancellation by the task's count of
            # cancellation requests: one left over would turn the eviction into a cancel
            assert await get(*conn, "/evicted") == b"evicted"
            assert await get(*conn, "/evicted") == b"evicted"
            conn[1].close()
    asyncio.run(go())


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_no_task_outlives_its_connection(impl: str) -> None:
    async def go() -> None:
        state: dict[str, Any] = {}
        srv, port = await start(impl, state)
        before = len(asyncio.all_tasks())
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for c in conns:
            assert await get(*c, "/task") == b"t"
        # closed by the clients: each connection's task ends
        for _, wr in conns[:2]:
            wr.close()
        for _ in range(100):
            if len(asyncio.all_tasks()) <= before + 1:
                break
            await asyncio.sleep(0.01)
        assert len(asyncio.all_tasks()) <= before + 1     # the third one's, at most
        # closed by the server's shutdown while idle (keep-alive): no task left pending
        await srv.shutdown(0.5)
        for _ in range(100):
            if len(asyncio.all_tasks()) <= before - 1:
                break
            await asyncio.sleep(0.01)
        assert all(t.done() for t in state["tasks"])
        assert len(asyncio.all_tasks()) <= before - 1     # the sweeper went with the server
        conns[2][1].close()
    asyncio.run(go())
