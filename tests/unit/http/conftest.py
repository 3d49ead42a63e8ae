"""The server tests run against both implementations of motor.http.server's protocol."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from motor.http import server


@pytest.fixture(params=["python", "compiled"])
def http_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """``name``, ``Request``, ``Response``, ``HttpProtocol`` of one implementation; every
    ``HttpServer`` made during the test uses it (``server.PROTOCOL``)."""
    if request.param == "python":
        impl = SimpleNamespace(name="python", Request=server.Request, Response=server.Response,
                               HttpProtocol=server.HttpProtocol)
    else:
        if server.COMPILED_PROTOCOL is None:
            pytest.fail("motor._fast.http1 is not built (pip install -e .)")
        from motor._fast import http1
        impl = SimpleNamespace(name="compiled", Request=http1.Request, Response=http1.Response,
                               HttpProtocol=http1.HttpProtocol)
    monkeypatch.setattr(server, "PROTOCOL", impl.HttpProtocol)
    return impl
