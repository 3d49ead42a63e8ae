"""The production edge (issue 17) as clients meet it: hashed API keys with names, a key file
reloaded on change, per-key rate limits (429 with Retry-After and OpenAI's x-ratelimit-*
headers, tokens corrected by the answer's usage), admission control (cap, queue, classes,
503 with Retry-After), TLS / mTLS on the API port with the official openai client and curl,
a rotated certificate, and an HTTPS engine. Test certificates come from a trustme CA."""
from __future__ import annotations

import asyncio
import os
import ssl

import openai
import orjson
import pytest
import trustme

from motor.coordinator import metrics
from motor.coordinator.keys import hash_key
from motor.http.tls import CertReloader, client_context, server_context
from tests.cases.harness import FB, cluster, http, run_async, stream, wait_for

REQ = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- API keys
@run_async
async def test_hashed_and_named_keys_and_the_name_in_metrics():
    entry = hash_key("sk-svc", iterations=1000)
    async with cluster(api_keys=[{"name": "svc", "key": entry}, "sk-plain"]) as (fbs, gw):
        before = sample("motor_coordinator_key_requests_total", key="svc", outcome="admitted")
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer("sk-svc"))
        assert st == 200
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer("sk-plain"))
        assert st == 200
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer(entry))
        assert st == 401 and orjson.loads(body)["error"]["code"] == "invalid_api_key"
        st, _, _ = await http(gw.port, "GET", "/v1/models", b"", bearer("sk-svc"))
        assert st == 200
        assert len(fbs[0].log) == 2                  # the 401 reached no engine
        assert sample("motor_coordinator_key_requests_total", key="svc",
                      outcome="admitted") == before + 1
        text = metrics.render_metrics()
        assert b"sk-svc" not in text and b"sk-plain" not in text  # names only, never keys


@run_async
async def test_key_file_is_reloaded_when_it_changes(tmp_path):
    f = tmp_path / "keys"
    f.write_text("alice sk-a\n")
    async with cluster(api_keys_file=str(f)) as (_fbs, gw):
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer("sk-a"))
        assert st == 200
        f.write_text("bob sk-b\n")
        os.utime(f, (1, 1))
        gw.coord.edge.housekeeping()                  # what the coordinator runs every 2 s
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer("sk-a"))
        assert st == 401
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer("sk-b"))
        assert st == 200


# ---------------------------------------------------------------- rate limits
@run_async
async def test_requests_per_minute_429_with_retry_after_and_openai_headers():
    async with cluster(api_keys=[{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}],
                       limits={"keys": {"a": {"rpm": 60}}}) as (fbs, gw):
        st, hdrs, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer("sk-a"))
        assert st == 200            # the headers on every answer of a limited key, as OpenAI
        assert hdrs["x-ratelimit-limit-requests"] == "60"
        assert hdrs["x-ratelimit-remaining-requests"] == "0"
        st, hdrs, body = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer("sk-a"))
        assert st == 429
        err = orjson.loads(body)["error"]
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
        assert int(hdrs["retry-after"]) >= 1
        assert hdrs["x-ratelimit-limit-requests"] == "60"
        assert hdrs["x-ratelimit-remaining-requests"] == "0"
        assert hdrs["x-ratelimit-reset-requests"].endswith(("ms", "s"))
        for _ in range(5):                            # key b has no limit
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ, bearer("sk-b"))
            assert st == 200
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key="sk-a",
                                    max_retries=0)
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        await client.close()
        assert len(fbs[0].log) == 6                   # refused requests reached no engine


@run_async
async def test_token_limit_is_corrected_by_the_answers_usage():
    # 600 tokens per minute: 10 / s, a burst of 10. The estimate of REQ is 74 bytes / 4 + 2 =
    # 20 tokens (level -10 after it); the answer's usage says 7 (5 prompt + 2), so the level
    # is back to +3 and the next request is admitted at once; with the estimate kept it
    # would wait a second.
    async with cluster(limits={"default": {"tpm": 600}}) as (_fbs, gw):
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 200
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 200, body
        assert sample("motor_coordinator_key_tokens_total", key="anonymous") >= 14
        # now about -4 (3 - 20 + 13): refused until it refills
        st, hdrs, body = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 429 and orjson.loads(body)["error"]["type"] == "tokens"
        assert "x-ratelimit-remaining-tokens" in hdrs


# ---------------------------------------------------------------- admission
STREAM = b'{"model":"m","prompt":"x","max_tokens":%d,"stream":true}'


@run_async
async def test_admission_caps_engines_queues_by_class_and_sheds_with_retry_after():
    fb = FB(tokens=5, token_delay_s=0.02)
    async with cluster(fbs=[fb], admission={"max_in_flight": 1, "max_queue": 2,
                                            "queue_timeout_s": 30}) as (_fbs, gw):
        adm = gw.coord.edge.admission
        first = asyncio.create_task(stream(gw.port, "/v1/completions", STREAM % 20))
        assert await wait_for(lambda: adm.in_flight == 1)
        batch = asyncio.create_task(stream(gw.port, "/v1/completions", STREAM % 3,
                                           headers={"x-motor-priority": "batch"}))
        assert await wait_for(lambda: adm.queued == 1)
        urgent = asyncio.create_task(stream(gw.port, "/v1/completions", STREAM % 4,
                                            headers={"x-motor-priority": "interactive"}))
        assert await wait_for(lambda: adm.queued == 2)
        _, _, text = await http(gw.port, "GET", "/metrics")
        assert b"\nmotor_coordinator_admission_queue_requests 2.0" in text
        st, hdrs, body = await http(gw.port, "POST", "/v1/completions", STREAM % 1)
        assert st == 503 and int(hdrs["retry-after"]) >= 1     # queue full: at once
        assert "queue full" in orjson.loads(body)["error"]["message"]
        results = await asyncio.gather(first, batch, urgent)
        assert [r[0] for r in results] == [200, 200, 200]
        _, _, text = await http(gw.port, "GET", "/metrics")
        for c in ("interactive", "batch"):            # each waited, once
            assert f'motor_coordinator_admission_wait_seconds_count{{class="{c}"}} 1.0'.encode() \
                in text, c
        assert b"\nmotor_coordinator_admission_queue_requests 0.0" in text
        assert fb.max_open == 1                                 # the cap held at the engine
        order = [orjson.loads(e.body)["max_tokens"] for e in fb.log]
        assert order == [20, 4, 3]                              # interactive before batch
        assert adm.in_flight == 0 and adm.queued == 0


@run_async
async def test_the_priority_header_cannot_raise_a_key_above_its_class():
    fb = FB(tokens=5, token_delay_s=0.02)
    async with cluster(fbs=[fb],
                       api_keys=[{"name": "bulk", "key": "sk-bulk"}, {"name": "ui", "key": "sk-ui"}],
                       limits={"keys": {"bulk": {"priority": "batch"},
                                        "ui": {"priority": "interactive"}}},
                       admission={"max_in_flight": 1, "max_queue": 4, "queue_timeout_s": 30,
                                  "predict": False}) as (_fbs, gw):
        adm = gw.coord.edge.admission
        first = asyncio.create_task(stream(gw.port, "/v1/completions", STREAM % 20,
                                           headers={"authorization": "Bearer sk-ui"}))
        assert await wait_for(lambda: adm.in_flight == 1)
        # a batch key asking for interactive stays batch; an interactive key naming no
        # known class stays interactive; one asking for batch is lowered
        tasks = []
        for n, key, prio in ((3, "sk-bulk", "interactive"), (4, "sk-ui", "bogus"),
                             (5, "sk-ui", "batch"), (6, "sk-ui", "interactive")):
            tasks.append(asyncio.create_task(stream(
                gw.port, "/v1/completions", STREAM % n,
                headers={"authorization": f"Bearer {key}", "x-motor-priority": prio})))
            want = len(tasks)
            assert await wait_for(lambda want=want: adm.queued == want)
        results = await asyncio.gather(first, *tasks)
        assert [r[0] for r in results] == [200] * 5
        order = [orjson.loads(e.body)["max_tokens"] for e in fb.log]
        assert order == [20, 4, 6, 3, 5]      # interactive 4, 6 first; then batch 3, 5


@run_async
async def test_queue_timeout_is_a_503_and_the_engine_never_sees_it():
    fb = FB(tokens=5, token_delay_s=0.05)
    async with cluster(fbs=[fb], admission={"max_in_flight": 1, "max_queue": 4,
                                            "queue_timeout_s": 0.05}) as (_fbs, gw):
        first = asyncio.create_task(stream(gw.port, "/v1/completions", STREAM % 10))
        assert await wait_for(lambda: gw.coord.edge.admission.in_flight == 1)
        st, hdrs, body = await http(gw.port, "POST", "/v1/completions", STREAM % 1)
        assert st == 503 and "queue timeout" in orjson.loads(body)["error"]["message"]
        assert "retry-after" in hdrs
        assert (await first)[0] == 200
        assert len(fb.log) == 1


# ---------------------------------------------------------------- TLS
def _pair(ca: trustme.CA, d, name: str) -> tuple[str, str]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    c, k = str(d / f"{name}.pem"), str(d / f"{name}.key")
    cert.cert_chain_pems[0].write_to_path(c)
    cert.private_key_pem.write_to_path(k)
    return c, k


async def _curl(*args: str) -> tuple[int, bytes]:
    p = await asyncio.create_subprocess_exec("curl", "-sS", "--max-time", "10", *args,
                                             stdout=asyncio.subprocess.PIPE,
                                             stderr=asyncio.subprocess.STDOUT)
    out, _ = await p.communicate()
    return p.returncode or 0, out


@run_async
async def test_https_api_with_the_openai_client_and_curl_and_a_rotated_certificate(tmp_path):
    ca = trustme.CA()
    ca_file = str(tmp_path / "ca.pem")
    ca.cert_pem.write_to_path(ca_file)
    cert, key = _pair(ca, tmp_path, "server")
    ctx = server_context(cert, key)
    reloader = CertReloader(ctx, cert, key)
    async with cluster(server_tls=ctx) as (_fbs, gw):
        url = f"https://127.0.0.1:{gw.port}/v1"
        client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0,
                                    http_client=openai.DefaultAsyncHttpx2Client(
                                        verify=ssl.create_default_context(cafile=ca_file)))
        got = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert got.choices[0].message.content == "tok0 tok1 "
        post = ("-H", "content-type: application/json", "-d", REQ.decode(),
                f"{url}/chat/completions")
        rc, out = await _curl("--cacert", ca_file, *post)
        assert rc == 0 and orjson.loads(out)["choices"][0]["message"]["content"] == "tok0 tok1 "
        rc, out = await _curl(*post)                               # not trusted without the CA
        assert rc != 0
        # rotation: a new certificate (the same CA) in place; new connections get it
        rc, before = await _curl("--cacert", ca_file, "-w", "%{certs}", "-o", "/dev/null",
                                 *post)
        _pair(ca, tmp_path, "server")
        os.utime(cert, (1, 1))
        assert reloader.check()
        rc, after = await _curl("--cacert", ca_file, "-w", "%{certs}", "-o", "/dev/null",
                                *post)
        assert rc == 0 and before and after and before != after
        got = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert got.choices[0].message.content == "tok0 "
        await client.close()


@run_async
async def test_mtls_refuses_a_client_without_a_certificate_at_the_handshake(tmp_path):
    ca = trustme.CA()
    ca_file = str(tmp_path / "ca.pem")
    ca.cert_pem.write_to_path(ca_file)
    cert, key = _pair(ca, tmp_path, "server")
    ccert, ckey = _pair(ca, tmp_path, "client")
    async with cluster(server_tls=server_context(cert, key, client_ca_file=ca_file)) as (fbs, gw):
        post = ("-H", "content-type: application/json", "-d", REQ.decode(),
                f"https://127.0.0.1:{gw.port}/v1/chat/completions")
        rc, out = await _curl("--cacert", ca_file, "--cert", ccert, "--key", ckey, *post)
        assert rc == 0 and b'"choices"' in out
        rc, out = await _curl("--cacert", ca_file, *post)
        assert rc != 0 and b'"choices"' not in out
        assert len(fbs[0].log) == 1                   # only the client with a certificate


@run_async
async def test_an_https_engine_is_verified_against_the_configured_ca(tmp_path):
    ca = trustme.CA()
    ca_file = str(tmp_path / "ca.pem")
    ca.cert_pem.write_to_path(ca_file)
    cert, key = _pair(ca, tmp_path, "engine")
    fb = FB()
    await fb.start(tls=server_context(cert, key))
    async with cluster(fbs=[fb], upstream_tls=client_context(ca_file), https=True) as (_, gw):
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 200, body
        assert len(fb.log) == 1
    other = trustme.CA()
    other_file = str(tmp_path / "other.pem")
    other.cert_pem.write_to_path(other_file)
    fb2 = FB()
    await fb2.start(tls=server_context(cert, key))
    async with cluster(fbs=[fb2], upstream_tls=client_context(other_file), https=True,
                       retries={"max_attempts": 1}) as (_, gw):
        st, _, body = await http(gw.port, "POST", "/v1/chat/completions", REQ)
        assert st == 502 and fb2.log == []            # an untrusted engine gets nothing
