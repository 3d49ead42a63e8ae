"""Fuzz lane: malformed HTTP and JSON thrown at the coordinator's ingress (hypothesis).

The coordinator (and one fake engine) run on a background event loop; each example is one
raw TCP exchange. Properties: the coordinator never crashes or answers 5xx on its own
account; a request it refuses gets a 4xx with an OpenAI error body; memory stays bounded.
Bounded: a few hundred examples, no shrinking deadline, ~10 s on 2 cores.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading

import orjson
from hypothesis import HealthCheck, given, settings, strategies as st

from motor.config.schema import Role
from tests.cases.harness import FB
from tests.support.gateway import Gateway

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


async def small_answer(fb, req, resp, e) -> None:
    """Whatever the body: a small chat answer (streamed when ``stream`` is true)."""
    try:
        stream = orjson.loads(req.body).get("stream") is True
    except (orjson.JSONDecodeError, AttributeError):
        stream = False
    if stream:
        resp.start(200)
        resp.end(b'data: {"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":"stop"}]}\n\n'
                 b'data: [DONE]\n\n')
    else:
        resp.send(200, b'{"choices":[{"index":0,"message":{"role":"assistant","content":"a"}}]}')


class Background:
    """Gateway + FB on their own event loop thread (module-wide)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.fb = await FB(behave=small_answer).start()
            self.gw = await Gateway([(Role.UNION, "127.0.0.1", self.fb.port)],
                                    max_body_bytes=1 << 20, timeouts={"first_token_s": 5.0}).start()
        self.loop.run_until_complete(start())
        self.ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self.gw.stop()
            await self.fb.stop()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


BG: Background | None = None


def bg() -> Background:
    global BG
    if BG is None:
        BG = Background()
    return BG


def teardown_module() -> None:
    global BG
    if BG is not None:
        BG.close()
        BG = None


def exchange(data: bytes, wait_s: float = 0.25) -> bytes:
    """Send ``data``, read until the coordinator closes; an incomplete request (no answer after
    a short wait) is followed by a half-close, which the server treats as a client gone."""
    s = socket.create_connection(("127.0.0.1", bg().gw.port), timeout=10)
    try:
        try:
            s.sendall(data)
        except OSError:
            pass
        out = b""
        s.settimeout(wait_s)
        half_closed = False
        while True:
            try:
                b = s.recv(65536)
            except TimeoutError:
                if half_closed:
                    raise AssertionError(f"no close after a half-close; sent {data[:200]!r}, "
                                         f"got {out[:200]!r}") from None
                half_closed = True
                try:
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    break
                s.settimeout(5)
                continue
            except ConnectionResetError:
                break
            if not b:
                break
            out += b
        return out
    finally:
        s.close()


def responses(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in ``raw`` (content-length or chunked)."""
    out = []
    while raw.startswith(b"HTTP/1.1 "):
        head, _, rest = raw.partition(b"\r\n\r\n")
        status = int(head[9:12])
        hdrs = {k.strip().lower(): v.strip() for k, _, v in
                (ln.partition(b":") for ln in head.split(b"\r\n")[1:])}
        if b"content-length" in hdrs:
            n = int(hdrs[b"content-length"])
            out.append((status, rest[:n]))
            raw = rest[n:]
        else:
            body = b""
            while True:
                size_s, _, rest = rest.partition(b"\r\n")
                size = int(size_s or b"0", 16)
                if size == 0:
                    rest = rest[2:]
                    break
                body += rest[:size]
                rest = rest[size + 2:]
            out.append((status, body))
            raw = rest
    return out


def check(status: int, body: bytes) -> None:
    assert status < 500, (status, body[:200])
    if status >= 400:
        err = orjson.loads(body)["error"]
        assert err["code"] == status and isinstance(err["message"], str)


def _dumps(v: object) -> bytes:
    return json.dumps(v).encode()


def post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + extra + b"content-length: %d\r\n\r\n" % len(body) + body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12), c, max_size=5), max_leaves=20)

# objects with the fields the coordinator reads, given wrong or odd types
KEYS = ["model", "stream", "max_tokens", "max_completion_tokens", "prompt", "messages", "n",
        "stream_options", "return_token_ids", "logprobs", "stop", "best_of", "echo", "min_tokens"]
odd_objects = st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6)


@SETTINGS
@given(st.one_of(st.binary(max_size=300), json_values.map(_dumps), odd_objects.map(_dumps)),
       st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate"]))
def test_malformed_json_bodies(body, path):
    # a whole request: the answer may take longer than the default wait on a loaded machine
    # (asyncio debug mode); the wait only ends the exchange early when no answer comes
    raw = exchange(post(path, body, b"connection: close\r\n"), 2.0)
    rs = responses(raw)
    assert len(rs) == 1, raw[:300]
    check(*rs[0])


@SETTINGS
@given(st.lists(st.sampled_from([
    b"GET / HTTP/1.1\r\n", b"POST /v1/completions HTTP/1.1\r\n", b"PUT /v1/models HTTP/1.0\r\n",
    b"\x00\xff garbage\r\n", b"host: x\r\n", b"content-length: 5\r\n", b"content-length: -1\r\n",
    b"content-length: 99999999999999999999\r\n", b"transfer-encoding: chunked\r\n",
    b"transfer-encoding: gzip, chunked\r\n", b"x-request-id: " + b"r" * 300 + b"\r\n",
    b"bad header line\r\n", b": novalue\r\n", b"\r\n", b"{\"model\":1}", b"5\r\nhello\r\n0\r\n\r\n",
    b"zz\r\n", b"connection: close\r\n", b"expect: 100-continue\r\n", b"upgrade: websocket\r\nconnection: upgrade\r\n",
]), min_size=1, max_size=10), st.binary(max_size=40))
def test_malformed_http(parts, tail):
    raw = exchange(b"".join(parts) + tail, 0.05)
    for status, body in responses(raw):
        if status >= 400:
            check(status, body)
        else:
            assert status < 500


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def test_memory_bounded_and_still_healthy():
    before = rss_kb()
    for i in range(300):
        exchange(post("/v1/completions", b'{"prompt":' + b"[" * (i % 50) + b"1", b"connection: close\r\n"))
        exchange(b"POST /v1/completions HTTP/1.1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
                 % (i % 100) + b"x" * (i % 100))
        exchange(b"\x16\x03\x01" + bytes(range(256)))
    grown_mb = (rss_kb() - before) / 1024
    assert grown_mb < 50, f"RSS grew by {grown_mb:.1f} MB"
    raw = exchange(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert responses(raw)[0][0] == 200
    assert bg().gw.inflight() == 0
    assert len(bg().gw.server.connections) <= 2
