"""B14: Authorization is forwarded as sent; 401s never take a worker out; probes need no
credentials; with gateway keys (`coordinator.api_keys`) and a worker key
(`coordinator.worker_api_key`) the client's credential never reaches an engine."""
from __future__ import annotations

import orjson

from tests.cases.harness import FB, cluster, default_behave, http, run_async

REQ = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'
E401 = b'{"error":{"message":"invalid api key","type":"AuthenticationError","param":null,"code":401}}'


async def needs_key(fb, req, resp, e):
    if req.header(b"authorization") != b"Bearer sk-good":
        resp.send(401, E401)
        return
    await default_behave(fb, req, resp, e)


@run_async
async def test_a_passthrough_and_401_keeps_worker():
    async with cluster(fbs=[FB(behave=needs_key)], probe=True, health_check_interval_s=0.05) as (fbs, gw):
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, {"authorization": "Bearer sk-good"})
        assert st == 200
        assert fbs[0].log[0].headers["authorization"] == "Bearer sk-good"
        for _ in range(10):
            st, _, out = await http(gw.port, "POST", "/v1/chat/completions", REQ,
                                    {"authorization": "Bearer sk-bad"})
            assert st == 401 and out == E401
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, {"authorization": "Bearer sk-good"})
        assert st == 200
        assert len(fbs[0].log) == 12          # no retries
        ep = next(iter(gw.table.endpoints.values()))
        assert ep.ready and ep.breaker.state == 0


async def needs_worker_key(fb, req, resp, e):
    if req.header(b"authorization") != b"Bearer sk-worker":
        resp.send(401, E401)
        return
    await default_behave(fb, req, resp, e)


def _no_gateway_key(fb):
    for entry in fb.log:
        assert all("sk-gw" not in k and "sk-gw" not in v for k, v in entry.headers.items())


STREAM = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}'


@run_async
async def test_b_worker_key_replaces_gateway_key():
    """B14 (b): client sk-gw -> FB sees sk-worker, never sk-gw; no or a wrong key -> 401
    from motor with an OpenAI error body, nothing reaches the engine; probes need no key."""
    async with cluster(fbs=[FB(behave=needs_worker_key)], probe=True, health_check_interval_s=0.05,
                       api_keys=["sk-gw", "sk-other"], worker_api_key="sk-worker") as (fbs, gw):
        fb = fbs[0]
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", REQ,
                                {"authorization": "Bearer sk-gw"})
        assert st == 200, out
        assert fb.log[0].headers["authorization"] == "Bearer sk-worker"
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", STREAM,
                                {"authorization": "Bearer sk-gw"})
        assert st == 200 and out.rstrip().endswith(b"data: [DONE]")
        st, _, _ = await http(gw.port, "POST", "/v1/completions",
                              b'{"model":"m","prompt":"hi","max_tokens":2}',
                              {"authorization": "Bearer sk-other"})
        assert st == 200
        n = len(fb.log)
        for hdrs in ({}, {"authorization": "Bearer sk-bad"}, {"authorization": "sk-gw"},
                     {"authorization": "Basic sk-gw"}, {"authorization": "Bearer sk-worker"}):
            for path, body in (("/v1/chat/completions", REQ), ("/v1/completions", REQ),
                               ("/v1/embeddings", b'{"model":"m","input":"x"}'),
                               ("/generate", b'{"text":"x"}'), ("/v1/models", b"")):
                st, h, out = await http(gw.port, "POST" if body else "GET", path, body, hdrs)
                assert st == 401, (path, hdrs, out)
                err = orjson.loads(out)["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert err["message"] and "sk-" not in err["message"]
                assert h["www-authenticate"].startswith("Bearer")
        assert len(fb.log) == n                 # none of them reached the engine
        _no_gateway_key(fb)
        st, _, out = await http(gw.port, "GET", "/v1/models", b"", {"authorization": "Bearer sk-gw"})
        assert st == 200 and orjson.loads(out)["data"]
        # health endpoints of motor and the engine probes need no client credential
        st, _, _ = await http(gw.port, "GET", "/health")
        assert st == 200
        ep = next(iter(gw.table.endpoints.values()))
        assert ep.ready and ep.breaker.state == 0


@run_async
async def test_b_gateway_keys_without_worker_key_never_forward_the_client_key():
    async with cluster(fbs=[FB()], api_keys=["sk-gw"]) as (fbs, gw):
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ,
                              {"authorization": "Bearer sk-gw"})
        assert st == 200
        assert "authorization" not in fbs[0].log[0].headers
        _no_gateway_key(fbs[0])


@run_async
async def test_b_worker_key_alone_replaces_the_client_header(monkeypatch):
    monkeypatch.setenv("MOTOR_WORKER_API_KEY", "sk-worker")
    monkeypatch.setenv("MOTOR_API_KEYS", "sk-env1, sk-env2")
    async with cluster(fbs=[FB(behave=needs_worker_key)]) as (fbs, gw):
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ,
                              {"authorization": "Bearer sk-env2"})
        assert st == 200
        assert fbs[0].log[0].headers["authorization"] == "Bearer sk-worker"
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ,
                              {"authorization": "Bearer sk-gw"})
        assert st == 401 and len(fbs[0].log) == 1
