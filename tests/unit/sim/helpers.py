"""Shared helpers of the simulator tests: an in-process sim on its own thread, HTTP calls."""
from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import uvloop

from motor.sim.engine import EngineConfig
from motor.sim.options import SimOptions
from motor.sim.server import SimServer


class SimThread:
    """A :class:`SimServer` on 127.0.0.1, any free port, in a thread with its own uvloop."""

    def __init__(self, model_dir: str, **kw: Any) -> None:
        eng = EngineConfig(**kw.pop("engine", {}))
        self.opts = SimOptions(host="127.0.0.1", port=0, model_dir=model_dir, engine=eng, **kw)
        self.server: SimServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.port = 0
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sim", daemon=True)

    def _run(self) -> None:
        loop = uvloop.new_event_loop()
        self.loop = loop
        asyncio.set_event_loop(loop)
        try:
            self.server = SimServer(self.opts)
            self.port = loop.run_until_complete(self.server.start())
        except BaseException as e:  # pragma: no cover - start-up failure
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self.server.stop(drain_timeout_s=0.2))
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def __enter__(self) -> SimThread:
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError("sim did not start")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(20)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the sim's loop thread and return its result."""
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(_call(fn), self.loop)
        return fut.result(10)


async def _call(fn: Callable[[], Any]) -> Any:
    return fn()


def request(port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
            timeout: float = 20.0, raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request; returns (status, lower-cased headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        h = {"content-type": "application/json"}
        h.update(headers or {})
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def post_json(port: int, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
    status, _, data = request(port, "POST", path, body, **kw)
    return status, json.loads(data) if data else None


def get_json(port: int, path: str) -> Any:
    status, _, data = request(port, "GET", path)
    assert status == 200, (status, data)
    return json.loads(data)


def stream_events(port: int, path: str, body: Any, headers: dict[str, str] | None = None,
                  timeout: float = 20.0) -> tuple[int, list[Any], bool]:
    """POST a streaming request; returns (status, parsed JSON events, saw [DONE])."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    events: list[Any] = []
    done = False
    try:
        h = {"content-type": "application/json"}
        h.update(headers or {})
        conn.request("POST", path, body=json.dumps(body).encode(), headers=h)
        r = conn.getresponse()
        if r.status != 200:
            return r.status, [json.loads(r.read())], False
        assert r.getheader("content-type", "").startswith("text/event-stream")
        try:
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.rstrip(b"\r\n")
                if not line:
                    continue
                assert line.startswith(b"data: "), line
                payload = line[6:]
                if payload == b"[DONE]":
                    done = True
                    continue
                events.append(json.loads(payload))
        except (http.client.IncompleteRead, ConnectionError):
            pass
        return r.status, events, done
    finally:
        conn.close()


def wait_until(pred: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what or pred}")
