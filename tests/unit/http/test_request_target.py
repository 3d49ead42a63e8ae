"""Request targets that are not origin-form (RFC 9112 section 3.2) and prefix routes."""
from __future__ import annotations

import pytest

from motor.http.server import Request, Router, origin_form
from tests.support.gateway import run_async


@pytest.mark.parametrize("method,target,want", [
    (b"GET", b"http://h/v1/models", b"/v1/models"),
    (b"GET", b"HTTP://h:80/v1/models?a=1&b=2", b"/v1/models?a=1&b=2"),
    (b"POST", b"https://[::1]:8443/v1/chat/completions", b"/v1/chat/completions"),
    (b"GET", b"http://h", b"/"),
    (b"GET", b"http://h?q=1", b"/?q=1"),
    (b"GET", b"http://h:1//x", b"//x"),
    (b"OPTIONS", b"*", b"*"),
    (b"GET", b"*", None),
    (b"GET", b"ftp://h/x", None),
    (b"GET", b"http:///x", None),
    (b"GET", b"http://u:p@h/x", None),
    (b"GET", b"h:80", None),
    (b"GET", b"", None),
])
def test_origin_form(method, target, want):
    assert origin_form(method, target) == want


class _Sent:
    def __init__(self) -> None:
        self.status = 0
        self.headers: tuple = ()
        self.head = False

    def send(self, status, body=b"", content_type=b"", headers=()):
        self.status, self.headers = status, tuple(headers)


def _req(method: bytes, path: str, cls: type = Request) -> Request:
    return cls(method, path, "", [], b"", True, None)  # type: ignore[no-any-return]


def test_prefix_routes_only_after_exact_ones(http_impl):
    run_async(_prefix_routes)(http_impl.Request)


async def _prefix_routes(request_cls: type) -> None:
    r = Router()
    seen: list[str] = []

    async def exact(req, resp):
        seen.append("exact")

    async def one(req, resp):
        seen.append("one:" + req.path[len("/v1/models/"):])

    r.get("/v1/models")(exact)
    r.add_prefix("GET", "/v1/models/", one)
    for path in ("/v1/models", "/v1/models/a/b"):
        await r(_req(b"GET", path, request_cls), _Sent())  # type: ignore[arg-type]
    assert seen == ["exact", "one:a/b"]
    for method, path, status in ((b"GET", "/v1/models/", 404), (b"POST", "/v1/models/a", 405),
                                 (b"GET", "/v1/modelsx", 404)):
        s = _Sent()
        await r(_req(method, path, request_cls), s)  # type: ignore[arg-type]
        assert s.status == status, path
    s = _Sent()
    await r(_req(b"OPTIONS", "*", request_cls), s)  # type: ignore[arg-type]
    assert s.status == 200 and dict(s.headers)[b"allow"] == b"GET, HEAD"
