"""The pieces every request path shares (``motor.coordinator.routing.base``), the endpoint
load lease and the one failover decision (``recovery.after_leg``).

The whole-body read is pinned against a real HTTP server and motor's pooled client: the
idle timeout counts silence across keep-alive steps, each chunk resets it, and a step as
long as the idle timeout raises as it is.
"""
from __future__ import annotations

import asyncio

import orjson
import pytest

from motor.config.schema import CoordinatorConfig, EngineKind, Role
from motor.coordinator.endpoints import EndpointState
from motor.coordinator.recovery import CONTINUE, END, REFUSE, StreamRecovery, after_leg
from motor.coordinator.routing.base import (Settings, engine_error_body, estimate_prompt_tokens,
                                            is_openai_error, read_whole)
from motor.http.client import Pool, UpstreamTimeout
from motor.http.server import HttpServer, Request, Response
from motor.protocol.openai import max_tokens_field, max_tokens_of
from tests.support.gateway import run_async


# -- read_whole against a real server ----------------------------------------------------
async def _paced(req: Request, resp: Response) -> None:
    """Writes ``parts`` with ``pauses[i]`` seconds of silence before part i."""
    spec = orjson.loads(req.body)
    resp.start(200, content_type=b"application/json")
    for pause, part in zip(spec["pauses"], spec["parts"]):
        await asyncio.sleep(pause)
        resp.write(part.encode())
        await resp.drain()
    resp.end()


async def _read(pauses: list[float], parts: list[str], step_s: float, idle_s: float) -> bytes:
    srv = HttpServer(_paced)
    port = await srv.listen("127.0.0.1", 0)
    pool = Pool("127.0.0.1", port)
    try:
        up = await pool.request(b"POST", b"/", orjson.dumps({"pauses": pauses, "parts": parts}),
                                first_byte_timeout_s=5.0, idle_timeout_s=step_s)
        async with up:
            return await read_whole(up, idle_s)
    finally:
        pool.close()
        await srv.shutdown(1)


@run_async
async def test_read_whole_silence_is_reset_by_each_chunk() -> None:
    # three silences of 3 steps each: 0.45 s of silence in all, but never 0.4 s at once
    body = await _read([0.0, 0.15, 0.15, 0.15], ["a", "b", "c", "d"], step_s=0.05, idle_s=0.4)
    assert body == b"abcd"


@run_async
async def test_read_whole_silence_across_steps_reaches_the_idle_timeout() -> None:
    with pytest.raises(UpstreamTimeout) as ei:
        await _read([0.0, 2.0], ["a", "b"], step_s=0.05, idle_s=0.3)
    assert ei.value.phase == "idle" and ei.value.timeout_s == 0.3


@run_async
async def test_read_whole_step_as_long_as_idle_raises_as_is() -> None:
    with pytest.raises(UpstreamTimeout) as ei:
        await _read([0.0, 2.0], ["a", "b"], step_s=0.2, idle_s=0.2)
    assert ei.value.phase == "idle" and ei.value.timeout_s == 0.2


# -- settings, sizes, error bodies ---------------------------------------------------------
def test_settings_backoff_and_keepalive_step() -> None:
    s = Settings(CoordinatorConfig(retries={"max_attempts": 5, "backoff_s": 0.1,
                                            "backoff_max_s": 0.3},
                                   timeouts={"idle_s": 10.0, "keepalive_s": 2.0}), env={})
    assert [s.backoff_delay_s(a) for a in range(5)] == [0.0, 0.1, 0.2, 0.3, 0.3]
    assert s.stream_idle_step_s == 2.0 and s.keepalive_s == 2.0
    s = Settings(CoordinatorConfig(timeouts={"idle_s": 1.0, "keepalive_s": 2.0}), env={})
    assert s.keepalive_s == 0.0 and s.stream_idle_step_s == 1.0   # keep-alive >= idle: off


def test_settings_keys_from_config_and_env() -> None:
    s = Settings(CoordinatorConfig(api_keys=["k1"]), env={"MOTOR_API_KEYS": " k2 , ,k3"})
    assert s.checks_keys and s.env_keys == " k2 , ,k3" and not s.forward_client_auth
    assert Settings(CoordinatorConfig(api_keys_file="/keys"), env={}).checks_keys
    assert not Settings(CoordinatorConfig(), env={"MOTOR_API_KEYS": " , "}).checks_keys
    s = Settings(CoordinatorConfig(), env={"MOTOR_WORKER_API_KEY": "w"})
    assert s.worker_auth == b"Bearer w" and not s.forward_client_auth
    assert Settings(CoordinatorConfig(), env={}).forward_client_auth


def test_token_ids_only_for_engines_that_return_them() -> None:
    pool = Pool("127.0.0.1", 9)
    try:
        sg = EndpointState("s", "m", Role.UNION, "127.0.0.1", 9, 0, pool, EngineKind.SGLANG)
        vl = EndpointState("v", "m", Role.UNION, "127.0.0.1", 9, 0, pool, EngineKind.VLLM)
        auto = Settings(CoordinatorConfig(), env={})
        assert auto.ids_for(vl) and not auto.ids_for(sg)
        always = Settings(CoordinatorConfig(failover={"request_token_ids": "always"}), env={})
        assert always.ids_for(sg)
    finally:
        pool.close()


def test_max_tokens_read_as_vllm_does() -> None:
    both = {"max_completion_tokens": 3, "max_tokens": 50}
    assert max_tokens_field(both, chat=True) == 3 and max_tokens_field(both, chat=False) == 50
    assert max_tokens_field({"max_tokens": 7}, chat=True) == 7
    assert max_tokens_of({"max_tokens": True}, chat=False) == 0
    assert max_tokens_of({"max_tokens": "9"}, chat=False) == 0
    assert max_tokens_of({}, chat=True) == 0


def test_prompt_size_estimate() -> None:
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}, 1000) == 3
    assert estimate_prompt_tokens({"prompt": "x" * 400}, 410) == 102
    assert estimate_prompt_tokens({}, 2) == 1


def test_engine_error_body_kept_or_wrapped() -> None:
    own = b'{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}'
    assert engine_error_body(400, own) is own
    wrapped = orjson.loads(engine_error_body(500, b"Internal Server Error"))
    assert wrapped["error"]["code"] == 500
    assert wrapped["error"]["message"] == "engine answered 500: Internal Server Error"
    assert not is_openai_error(b"[1]") and not is_openai_error(b'{"error":"x"}')


# -- the load lease --------------------------------------------------------------------------
def test_lease_releases_exactly_once() -> None:
    pool = Pool("127.0.0.1", 9)
    try:
        ep = EndpointState("i", "m", Role.UNION, "127.0.0.1", 9, 0, pool)
        with ep.lease(100, 30, 70) as lease:
            assert (ep.inflight, ep.inflight_tokens, ep.inflight_prefill_tokens,
                    ep.inflight_decode_tokens) == (1, 100, 30, 70)
            lease.prefill_done()
            lease.prefill_done()          # once only
            assert ep.inflight_prefill_tokens == 0 and ep.inflight_tokens == 100
            lease.release()
            assert not lease.held
        lease.release()                   # the with block and a second call: no effect
        lease.prefill_done()
        assert (ep.inflight, ep.inflight_tokens, ep.inflight_prefill_tokens,
                ep.inflight_decode_tokens) == (0, 0, 0, 0)
        with pytest.raises(RuntimeError):
            with ep.lease(5, 5, 0):
                raise RuntimeError("leg failed")
        assert (ep.inflight, ep.inflight_tokens, ep.inflight_prefill_tokens) == (0, 0, 0)
    finally:
        pool.close()


# -- the failover decision -------------------------------------------------------------------
def _cmpl_event(text: str, ids: list[int], prompt_ids: list[int] | None = None,
                finish: str | None = None) -> bytes:
    c: dict[str, object] = {"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}
    if prompt_ids is not None:
        c["prompt_token_ids"] = prompt_ids
    obj = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
           "choices": [c]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _rec(max_tokens: int = 4) -> StreamRecovery:
    return StreamRecovery(False, {"model": "m", "prompt": "hi", "max_tokens": max_tokens,
                                  "stream": True})


def test_broken_recoverable_stream_continues_with_its_token_ids() -> None:
    rec = _rec()
    out = rec.feed(_cmpl_event("a", [7], prompt_ids=[1, 2]) + _cmpl_event("b", [8]))
    assert b"token_ids" not in out          # stripped: the client did not ask for them
    v = after_leg(rec, ConnectionResetError(), legs=0, max_continuations=2, wrote_any=True,
                  path=b"/v1/completions")
    assert v.action == CONTINUE and v.reason == "broken" and not v.engine_ok
    body = orjson.loads(v.body)
    assert v.path == b"/v1/completions" and body["prompt"] == [1, 2, 7, 8]
    assert body["max_tokens"] == 2 and body["return_token_ids"] is True


def test_no_continuation_past_the_limit_or_without_ids() -> None:
    rec = _rec()
    rec.feed(_cmpl_event("a", [7], prompt_ids=[1, 2]))
    v = after_leg(rec, ConnectionResetError(), legs=2, max_continuations=2, wrote_any=True,
                  path=b"/v1/completions")
    assert v.action == REFUSE and v.why == "2 continuation(s) already" and v.tail is None
    v = after_leg(None, ConnectionResetError(), legs=0, max_continuations=2, wrote_any=True,
                  path=b"/v1/completions", raw=b"{}", why_not="logprobs")
    assert v.action == REFUSE and v.why == "the request cannot be continued exactly (logprobs)"


def test_stream_without_recovery_restarts_before_its_first_event() -> None:
    v = after_leg(None, ConnectionResetError(), legs=0, max_continuations=2, wrote_any=False,
                  path=b"/v1/chat/completions", raw=b'{"x":1}')
    assert (v.action, v.reason, v.path, v.body) == (CONTINUE, "restart",
                                                    b"/v1/chat/completions", b'{"x":1}')
    v = after_leg(None, None, legs=0, max_continuations=2, wrote_any=True, path=b"/")
    assert v.action == END and v.engine_ok and v.tail == b""


def test_finished_or_exhausted_stream_is_ended_by_motor() -> None:
    rec = _rec()
    rec.feed(_cmpl_event("a", [7], prompt_ids=[1, 2], finish="stop"))
    v = after_leg(rec, ConnectionResetError(), legs=0, max_continuations=2, wrote_any=True,
                  path=b"/v1/completions")
    assert v.action == END and not v.engine_ok and v.tail == b"data: [DONE]\n\n"
    rec = _rec(max_tokens=2)
    rec.feed(_cmpl_event("a", [7], prompt_ids=[1, 2]) + _cmpl_event("b", [8]))
    v = after_leg(rec, None, legs=0, max_continuations=2, wrote_any=True,
                  path=b"/v1/completions")
    assert v.action == END and v.tail is not None
    assert b'"finish_reason":"length"' in v.tail and v.tail.endswith(b"data: [DONE]\n\n")


def test_engine_error_event_passed_on_when_refused() -> None:
    rec = _rec()
    err = b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}'
    rec.feed(err + b"\n\n")
    rec.blocked = "tools"                   # refused: the engine's own event goes out
    v = after_leg(rec, None, legs=0, max_continuations=2, wrote_any=True,
                  path=b"/v1/completions")
    assert v.action == REFUSE and v.reason == "engine_error"
    assert v.tail == err + b"\n\ndata: [DONE]\n\n"


def test_transport_error_after_done_ends_without_a_second_done() -> None:
    rec = _rec()
    out = rec.feed(_cmpl_event("a", [7], prompt_ids=[1, 2], finish="stop")
                   + b"data: [DONE]\n\n")
    assert out.endswith(b"data: [DONE]\n\n")
    v = after_leg(rec, ConnectionResetError(), legs=0, max_continuations=2, wrote_any=True,
                  path=b"/v1/completions")
    assert v.action == END and v.reason == "done" and v.tail == b"" and not v.engine_ok


def test_completion_max_tokens_absent_or_null_is_16() -> None:
    # as vLLM 0.32 reads them (measured on the CPU build): the continuation keeps that budget
    assert _rec().remaining() == 4
    absent = StreamRecovery(False, {"prompt": "hi", "stream": True})
    assert absent.remaining() == 16
    null = StreamRecovery(False, {"prompt": "hi", "stream": True, "max_tokens": None})
    assert null.remaining() == 16
    chat = StreamRecovery(True, {"messages": [], "stream": True, "max_tokens": 50,
                                 "max_completion_tokens": 10})
    assert chat.remaining() == 10


def test_inflight_gauge_reads_the_live_count() -> None:
    from motor.coordinator import metrics
    pool = Pool("127.0.0.1", 9)
    try:
        ep = EndpointState("gauge-i", "m", Role.UNION, "127.0.0.1", 9, 0, pool)
        labels = {"instance": "gauge-i", "endpoint": ep.url}

        def sample() -> float | None:
            return metrics.REGISTRY.get_sample_value("motor_coordinator_inflight_requests",
                                                     labels)
        assert sample() == 0.0
        a, b = ep.lease(1, 0, 0), ep.lease(1, 0, 0)
        assert sample() == 2.0
        a.release()
        b.release()
        assert sample() == 0.0
    finally:
        metrics.INFLIGHT.remove("gauge-i", ep.url)
        pool.close()


# -- relay_sse: the first token goes out before the prefill-done work ---------------------
class _Up:
    """An engine stream handing out ``chunks`` one by one, then its end."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)

    async def next_chunk(self) -> bytes | None:
        return self.chunks.pop(0) if self.chunks else None

    def close(self) -> None:
        pass


class _Resp:
    def __init__(self) -> None:
        self.out = b""

    def write(self, b: bytes) -> None:
        self.out += b

    async def drain(self) -> None:
        pass


class _Route:
    class ttft:  # noqa: N801 - the metric child's one method
        @staticmethod
        def observe(v: float) -> None:
            pass


@run_async
async def test_relay_sse_prefill_done_after_the_first_token_is_written() -> None:
    from motor.coordinator.routing.base import relay_sse
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    tok = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
    resp = _Resp()
    seen: list[bytes] = []
    err, wrote = await relay_sse(_Up([role, tok, tok, b"data: [DONE]\n\n"]), resp, None,
                                 _Route(), 0.0, True, 5.0,
                                 on_prefill_done=lambda: seen.append(resp.out))
    assert err is None and wrote
    # called once, when the client already had the role preamble and the first token
    assert seen == [role + tok]
    assert resp.out == role + tok + tok + b"data: [DONE]\n\n"

