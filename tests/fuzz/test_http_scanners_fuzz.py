"""Fuzz lane: the compiled HTTP/1.1 scanners against the pure-Python reference (hypothesis).

The server's plain-request scanner and the client's plain-response scanner and chunked
decoder (``motor/_fast/http1.pyx``, ``upstream.pyx``; ``docs/fast.md``) accept a strict
subset of HTTP/1.1 and hand everything else to httptools. Here near-valid messages — built
from plain parts, then damaged by a few byte edits and cut into reads anywhere — go to both
implementations over in-memory transports: the same bytes written, the same closing, the
same observations of an answer (status, headers, body pieces, errors with their messages,
transport calls). Bounded: a few hundred examples, ~20 s on 2 cores.
"""
from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings, strategies as st

from tests.unit.http.test_http_impls import _feed
from tests.unit.http.test_upstream_impls import _observe

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

_NAME = st.sampled_from([b"host", b"Content-Type", b"x-request-id", b"Authorization", b"accept",
                         b"connection", b"Connection", b"content-length", b"expect",
                         b"transfer-encoding", b"upgrade", b"proxy-connection", b"x-a!#$%&'*+",
                         b"x b", b"x:", b"", b"\xc3\xa9"])
_VALUE = st.sampled_from([b"x", b"keep-alive", b"Keep-Alive", b"close", b"chunked", b"Chunked",
                          b"100-continue", b"application/json", b"a b\tc", b" v", b"v ", b"",
                          b"\x00", b"\xff", b"12", b"+1", b"01", b"9" * 20])
_EDIT = st.tuples(st.integers(0, 10_000), st.sampled_from(["insert", "delete", "replace"]),
                  st.sampled_from([b"\r", b"\n", b" ", b"\t", b":", b"\x00", b"\x80", b"0",
                                   b"a", b";", b"\r\n", b"HTTP/1.1 "]))


def _damage(data: bytes, edits: list[tuple[int, str, bytes]]) -> bytes:
    for at, how, piece in edits:
        if not data:
            break
        k = at % (len(data) + 1)
        if how == "insert":
            data = data[:k] + piece + data[k:]
        elif how == "delete":
            data = data[:k] + data[k + len(piece):]
        else:
            data = data[:k] + piece + data[k + len(piece):]
    return data


@st.composite
def _request(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"HEAD",
                                   b"OPTIONS", b"BREW", b"post"]))
    path = draw(st.sampled_from([b"/echo", b"/info", b"/info?a=1&b=%20", b"/stream",
                                 b"/nope", b"*", b"http://h/info", b"/a#b", b'/"q"']))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0"]))
    headers = draw(st.lists(st.tuples(_NAME, _VALUE), max_size=5))
    body = draw(st.sampled_from([b"", b"abc", b"a" * 1001]))
    length = draw(st.sampled_from(["match", "match", "none", "short", "long"]))
    out = method + b" " + path + b" " + version + b"\r\n"
    for k, v in headers:
        out += k + b": " + v + b"\r\n"
    if length != "none":
        n = len(body) + {"match": 0, "short": -1, "long": 2}[length]
        out += b"content-length: %d\r\n" % max(n, 0)
    return out + b"\r\n" + body


@st.composite
def _answer(draw: st.DrawFn) -> bytes:
    status = draw(st.sampled_from([b"200 OK", b"200", b"503 Busy", b"204 No Content",
                                   b"100 Continue", b"2x0", b"600 X"]))
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0"]))
    headers = draw(st.lists(st.tuples(_NAME, _VALUE), max_size=4))
    out = version + b" " + status + b"\r\n"
    for k, v in headers:
        out += k + b": " + v + b"\r\n"
    if draw(st.booleans()):
        chunks = draw(st.lists(st.binary(min_size=1, max_size=20), max_size=4))
        out += b"transfer-encoding: chunked\r\n\r\n"
        for c in chunks:
            out += b"%x\r\n" % len(c) + c + b"\r\n"
        return out + b"0\r\n\r\n"
    body = draw(st.binary(max_size=20))
    return out + b"content-length: %d\r\n\r\n" % len(body) + body


@given(messages=st.lists(_request(), min_size=1, max_size=3),
       edits=st.lists(_EDIT, max_size=3), cuts=st.lists(st.integers(0, 3000), max_size=3))
@SETTINGS
def test_requests_same_answers_as_the_reference(messages: list[bytes],
                                                edits: list[tuple[int, str, bytes]],
                                                cuts: list[int]) -> None:
    data = _damage(b"".join(messages), edits)

    async def go() -> None:
        py = await _feed("python", data, cuts)
        c = await _feed("compiled", data, cuts)
        assert c[:3] == py[:3]
    asyncio.run(go())


@given(answer=_answer(), edits=st.lists(_EDIT, max_size=3),
       cuts=st.lists(st.integers(0, 300), max_size=3), lost=st.booleans())
@SETTINGS
def test_answers_same_observations_as_the_reference(answer: bytes,
                                                    edits: list[tuple[int, str, bytes]],
                                                    cuts: list[int], lost: bool) -> None:
    data = _damage(answer, edits)
    py, _ = asyncio.run(_observe("python", data, cuts, lost))
    c, _ = asyncio.run(_observe("compiled", data, cuts, lost))
    assert c == py
