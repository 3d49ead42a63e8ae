"""A request whose handler raises is answered 500 (or its started stream cut) and counted
in ``motor_coordinator_requests_total`` like every other answer, with the compiled and the
pure-Python server protocol."""
from __future__ import annotations

import orjson
import pytest

from motor.config.schema import Role
from motor.coordinator import metrics
from motor.http import server as http_server
from tests.support.fake_backend import FakeBackend
from tests.support.gateway import Gateway, http, run_async

PROTOCOLS = {"compiled": http_server.PROTOCOL, "python": http_server.HttpProtocol}


def _count(route: str, status: str) -> float:
    v = metrics.REQUESTS.labels(route, status)._value.get()
    return float(v)


class _Boom(RuntimeError):
    pass


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("stream", [False, True])
@run_async
async def test_a_handler_that_raises_is_answered_500_and_counted(protocol: str,
                                                                  stream: bool) -> None:
    fb = await FakeBackend().start()
    gw = Gateway([(Role.UNION, "127.0.0.1", fb.port)])
    gw.server.protocol = PROTOCOLS[protocol]
    await gw.start()

    def pick(*_a: object, **_k: object) -> None:
        raise _Boom("a policy bug")

    gw.coord.union.policy.pick = pick  # type: ignore[method-assign]
    try:
        before = _count("chat", "500")
        ok_before = _count("chat", "200")
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2, "stream": stream})
        status, _, data = await http(gw.port, "POST", "/v1/chat/completions", body,
                                     {"content-type": "application/json"})
        assert status == 500
        assert orjson.loads(data)["error"]["message"] == "internal error in motor"
        assert _count("chat", "500") == before + 1
        assert _count("chat", "200") == ok_before
    finally:
        await gw.stop()
        await fb.stop()
