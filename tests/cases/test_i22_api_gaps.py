"""Issue 22 item 7: small API gaps, black box.

* ``GET /v1/models/{model}`` (the SDK's ``models.retrieve``) answers the entry ``/v1/models``
  lists for that id, model ids with ``/`` included, 404 worded as vLLM words it otherwise,
  behind the same API key check as ``/v1/models``;
* an absolute-form request target (``GET http://host/v1/models HTTP/1.1``, RFC 9112 section
  3.2.2, what a proxy sends) is served as its path; a malformed target is a 400;
* a chat with empty (or no, or non-array) ``messages`` is a 400 naming ``messages`` in every
  mode, and no engine sees it;
* a controller 409 (an instance id registered by two nodes) is typed ``ConflictError``, and
  every status motor answers is typed as the OpenAI SDK names its exception.
"""
from __future__ import annotations

import asyncio

import openai
import orjson
import pytest

from motor.config.schema import ControllerConfig, Role
from motor.controller.server import ControllerServer
from motor.protocol.openai import error_body, error_type
from tests.cases.harness import FB, cluster, http, run_async, wait_for
from tests.support.gateway import Gateway

QWEN = "Qwen/Qwen2.5-0.5B"


def _learned(gw) -> bool:
    return all(e.models for e in gw.table.endpoints.values())


def _without_created(m: dict) -> dict:
    return {k: v for k, v in m.items() if k != "created"}


# -- 1. GET /v1/models/{model} ---------------------------------------------------------------
@run_async
async def test_models_retrieve_with_the_sdk_and_raw_http():
    fbs = [FB(models=("motor-sim", QWEN)), FB(models=("other",))]
    async with cluster(fbs=fbs, probe=True, health_check_interval_s=0.05) as (_, gw):
        assert await wait_for(lambda: _learned(gw))
        _, _, out = await http(gw.port, "GET", "/v1/models")
        listed = {m["id"]: m for m in orjson.loads(out)["data"]}
        assert set(listed) == {"motor-sim", QWEN, "other"}

        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="none",
                                    max_retries=0)
        try:
            for mid in ("motor-sim", QWEN, "other"):
                m = await client.models.retrieve(mid)     # QWEN goes as Qwen%2FQwen2.5-0.5B
                assert m.id == mid and m.object == "model"
                assert _without_created(m.model_dump(exclude_unset=True)) == \
                    _without_created(listed[mid])
            with pytest.raises(openai.NotFoundError) as ei:
                await client.models.retrieve("nope")
            assert ei.value.status_code == 404
        finally:
            await client.close()

        # raw HTTP: a model id with '/' as it is, and percent-encoded
        for path in (f"/v1/models/{QWEN}", "/v1/models/Qwen%2FQwen2.5-0.5B"):
            st, h, out = await http(gw.port, "GET", path)
            assert st == 200 and h["content-type"] == "application/json", path
            assert _without_created(orjson.loads(out)) == _without_created(listed[QWEN])
        st, _, out = await http(gw.port, "GET", "/v1/models/x")
        assert st == 404
        assert orjson.loads(out) == {"error": {"message": "The model `x` does not exist.",
                                               "type": "NotFoundError", "param": "model",
                                               "code": 404}}
        st, _, out = await http(gw.port, "GET", "/v1/models/Qwen")     # a prefix of an id
        assert st == 404


@run_async
async def test_models_retrieve_checks_the_api_key():
    async with cluster(fbs=[FB(models=("motor-sim",))], probe=True,
                       health_check_interval_s=0.05, api_keys=["sk-gw"]) as (_, gw):
        assert await wait_for(lambda: _learned(gw))
        for path in ("/v1/models", "/v1/models/motor-sim", "/v1/models/nope"):
            st, h, _ = await http(gw.port, "GET", path)
            assert st == 401 and "www-authenticate" in h, path
        st, _, out = await http(gw.port, "GET", "/v1/models/motor-sim",
                                headers={"authorization": "Bearer sk-gw"})
        assert st == 200 and orjson.loads(out)["id"] == "motor-sim"
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1",
                                    api_key="sk-gw", max_retries=0)
        try:
            assert (await client.models.retrieve("motor-sim")).id == "motor-sim"
        finally:
            await client.close()


# -- 2. absolute-form request targets --------------------------------------------------------
async def raw(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    """One request written byte for byte on a socket (``head``: the request line and
    headers, without the blank line); the connection closes after the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + b"\r\ncontent-length: " + str(len(body)).encode()
                 + b"\r\nconnection: close\r\n\r\n" + body)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    head_b, _, rest = data.partition(b"\r\n\r\n")
    lines = head_b.decode("latin-1").split("\r\n")
    hdrs = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return int(lines[0].split()[1]), hdrs, rest


@run_async
async def test_absolute_form_request_target():
    async with cluster(fbs=[FB(models=("m",))], probe=True,
                       health_check_interval_s=0.05) as ([fb], gw):
        assert await wait_for(lambda: _learned(gw))
        host = f"127.0.0.1:{gw.port}".encode()
        for target in (b"http://" + host + b"/v1/models",
                       b"HTTP://" + host + b"/v1/models?x=1",
                       b"https://proxy.example:8443/v1/models",     # any authority
                       b"http://" + host + b"/v1/models/m"):
            st, _, out = await raw(gw.port, b"GET " + target + b" HTTP/1.1\r\nhost: " + host)
            assert st == 200, target
            o = orjson.loads(out)
            assert o.get("object") == "list" or o.get("id") == "m", target
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2})
        st, _, out = await raw(gw.port, b"POST http://" + host + b"/v1/chat/completions HTTP/1.1"
                               b"\r\nhost: elsewhere\r\ncontent-type: application/json", body)
        assert st == 200 and orjson.loads(out)["object"] == "chat.completion"
        assert [e.path for e in fb.log] == ["/v1/chat/completions"]
        # an empty path is "/"
        st, _, _ = await raw(gw.port, b"GET http://" + host + b" HTTP/1.1\r\nhost: " + host)
        assert st == 404
        # OPTIONS *: the methods served
        st, h, _ = await raw(gw.port, b"OPTIONS * HTTP/1.1\r\nhost: " + host)
        assert st == 200 and "GET" in h["allow"] and "POST" in h["allow"]
        # malformed targets: 400 with an OpenAI error body, never a 404 or a handler
        for target in (b"*", b"ftp://h/v1/models", b"http://user@h/v1/models",
                       b"http:///v1/models", b"v1/models"):
            st, _, out = await raw(gw.port, b"GET " + target + b" HTTP/1.1\r\nhost: " + host)
            assert st == 400, target
            err = orjson.loads(out)["error"]
            assert err["code"] == 400 and err["type"] == "BadRequestError", target
        assert len(fb.log) == 1


# -- 3. empty messages -----------------------------------------------------------------------
BAD_MESSAGES = [
    b'{"model":"m","messages":[]}',
    b'{"model":"m","messages":[],"stream":true}',
    b'{"model":"m"}',
    b'{"model":"m","messages":null}',
    b'{"model":"m","messages":"hi"}',
    b'{"model":"m","messages":{"role":"user","content":"hi"}}',
]


@pytest.mark.parametrize("mode", ["union", "pd_prefill_first", "pd_decode_first",
                                  "pd_bootstrap"])
@run_async
async def test_chat_without_messages_is_400_in_every_mode(mode):
    fbs = [FB(), FB()]
    for fb in fbs:
        await fb.start()
    roles = [Role.UNION, Role.UNION] if mode == "union" else [Role.PREFILL, Role.DECODE]
    gw = await Gateway([(r, "127.0.0.1", fb.port) for r, fb in zip(roles, fbs)],
                       mode=mode).start()
    try:
        for body in BAD_MESSAGES:
            st, _, out = await http(gw.port, "POST", "/v1/chat/completions", body,
                                    {"content-type": "application/json"})
            assert st == 400, body
            err = orjson.loads(out)["error"]
            assert err["type"] == "BadRequestError" and err["code"] == 400, body
            assert err["param"] == "messages" and "messages" in err["message"], body
        assert [len(fb.log) for fb in fbs] == [0, 0]      # no engine saw any of them
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions",
                                b'{"model":"m","messages":[]}')
        assert "an empty array" in orjson.loads(out)["error"]["message"]
        if mode == "union":     # a chat with messages is served as before
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions",
                                  b'{"model":"m","messages":[{"role":"user","content":"x"}]}')
            assert st == 200 and sum(len(fb.log) for fb in fbs) == 1
    finally:
        await gw.stop()
        for fb in fbs:
            await fb.stop()


# -- 4. error types --------------------------------------------------------------------------
@run_async
async def test_controller_conflict_is_typed_conflict_error():
    server = ControllerServer(ControllerConfig(host="127.0.0.1"))
    port = await server.start(port=0)
    try:
        def reg(node: str) -> bytes:
            return orjson.dumps({"node": node, "host": "127.0.0.1", "instances": [
                {"id": "shared/0", "model": "m", "role": "union", "engine": "sim",
                 "endpoints": [{"host": "127.0.0.1", "port": 1}]}]})
        st, _, _ = await http(port, "POST", "/v1/nodes/register", reg("a"))
        assert st == 200
        st, _, out = await http(port, "POST", "/v1/nodes/register", reg("b"))
        assert st == 409
        err = orjson.loads(out)["error"]
        assert err["type"] == "ConflictError" and err["code"] == 409
        assert "shared/0" in err["message"]
    finally:
        await server.stop()


def test_every_status_is_typed_as_the_openai_sdk_names_it():
    # the SDK's exception class per status (openai._client.OpenAI._make_status_error)
    sdk = {400: openai.BadRequestError, 401: openai.AuthenticationError,
           403: openai.PermissionDeniedError, 404: openai.NotFoundError,
           409: openai.ConflictError, 422: openai.UnprocessableEntityError,
           429: openai.RateLimitError, 500: openai.InternalServerError}
    for status, cls in sdk.items():
        assert error_type(status) == cls.__name__, status
        assert orjson.loads(error_body(status, "x"))["error"]["type"] == cls.__name__
    # the statuses the SDK has no class of: the status's name + Error
    assert [error_type(s) for s in (405, 408, 413, 502, 503, 504)] == [
        "MethodNotAllowedError", "RequestTimeoutError", "RequestEntityTooLargeError",
        "BadGatewayError", "ServiceUnavailableError", "GatewayTimeoutError"]
    assert error_type(599) == "InternalServerError" and error_type(418) == "BadRequestError"
