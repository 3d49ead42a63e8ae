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


@pytest.fixture(params=["python", "compiled"])
def upstream_impl(request: pytest.FixtureRequest,
                  monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """``name``, ``Pool``, ``UpstreamResponse``, ``Conn`` of one implementation of
    motor.http.client's pooled client; every ``Client`` made during the test uses it
    (``client.POOL``)."""
    from motor.http import client
    if request.param == "python":
        impl = SimpleNamespace(name="python", Pool=client.Pool,
                               UpstreamResponse=client.UpstreamResponse, Conn=client._Conn)
    else:
        if client.COMPILED_POOL is None:
            pytest.fail("motor._fast.upstream is not built (pip install -e .)")
        from motor._fast import upstream
        impl = SimpleNamespace(name="compiled", Pool=upstream.Pool,
                               UpstreamResponse=upstream.UpstreamResponse, Conn=upstream.Conn)
    monkeypatch.setattr(client, "POOL", impl.Pool)
    return impl
