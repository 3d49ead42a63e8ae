"""I20 (items 1 and 7): OpenTelemetry traces of the coordinator's requests, exported over
OTLP/HTTP to a receiver in the test (a threaded HTTP server decoding the protobuf
``ExportTraceServiceRequest``), and the access log / JSON log lines.

* a PD request (``pd_prefill_first``, ``kv_affinity``) is one trace under the client's
  ``traceparent``: ``motor.request`` with ``motor.tokenize``, two ``motor.route`` and the
  ``motor.prefill`` / ``motor.decode`` legs as children, with their attributes; each engine
  got a ``traceparent`` of the client's trace id and of its own leg span's id;
* a retried request (the first engine answers 503) has a ``motor.retry`` event and two
  ``motor.union`` legs; a stream broken mid-way (token ids) has a ``motor.failover`` event
  and a ``motor.continuation`` leg;
* an unsampled request exports nothing and its engine gets the client's headers as sent;
* ``access_log``: one ``motor.access`` line per request with its fields; the JSON log
  format carries the request id on every line logged while the request is served.
"""
from __future__ import annotations

import asyncio
import http.server as httpd
import io
import logging
import os
import threading
from typing import Any

import orjson
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest)

from motor.config.schema import Role  # noqa: E402
from motor.logs import REQUEST_ID, make_handler  # noqa: E402
from tests.cases.harness import (FB, chat_chunk, content, http, run_async, sse,  # noqa: E402
                                 stream, write_events)
from tests.support.gateway import Gateway  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
KEY = "sk-test-secret-0123456789"


class Receiver:
    """An OTLP/HTTP traces receiver: every exported span, decoded."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()
        receiver = self

        class H(httpd.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("content-length", "0"))
                req = ExportTraceServiceRequest()
                req.ParseFromString(self.rfile.read(n))
                with receiver.lock:
                    for rs in req.resource_spans:
                        for ss in rs.scope_spans:
                            receiver.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = httpd.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def by_name(self, name: str) -> list[Any]:
        return [s for s in self.spans if s.name == name]


def attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def ev_attrs(ev: Any) -> dict[str, Any]:
    return attrs(ev)


def tracing(rcv: Receiver, ratio: float = 1.0) -> dict[str, Any]:
    return {"enabled": True, "endpoint": rcv.url, "sample_ratio": ratio,
            "service_name": "motor-test"}


def flush(gw: Gateway) -> None:
    obs = gw.coord.observer
    assert obs is not None and obs.tracing is not None
    obs.tracing.provider.force_flush()


def traceparent_of(e: Any) -> tuple[str, str]:
    """(trace id, parent span id) of the traceparent an engine received."""
    _, tid, sid, _ = e.headers["traceparent"].split("-")
    return tid, sid


async def pd_behaviour() -> tuple[FB, FB]:
    async def p(fb: FB, req: Any, resp: Any, e: Any) -> None:
        resp.send(200, orjson.dumps({"id": "p", "object": "text_completion", "model": "m",
                                     "choices": [{"index": 0, "text": "P",
                                                  "finish_reason": "length"}],
                                     "kv_transfer_params": {"remote_engine_id": "p"}}))

    async def d(fb: FB, req: Any, resp: Any, e: Any) -> None:
        resp.start(200)
        await write_events(resp, e, [sse(chat_chunk(f"t{i} ", "stop" if i == 2 else None,
                                                    role=i == 0)) for i in range(3)])
        resp.end(b"data: [DONE]\n\n")
    fp, fd = FB(behave=p), FB(behave=d)
    await fp.start()
    await fd.start()
    return fp, fd


@run_async
async def test_pd_request_is_one_trace_with_its_spans_and_the_engines_join_it():
    rcv = Receiver()
    fp, fd = await pd_behaviour()
    gw = await Gateway([(Role.PREFILL, "127.0.0.1", fp.port), (Role.DECODE, "127.0.0.1", fd.port)],
                       mode="pd_prefill_first", policy="kv_affinity", tracing=tracing(rcv),
                       api_keys=[{"name": "team-a", "key": KEY}]).start()
    try:
        body = b'{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":true}'
        st, _, evs, _ = await stream(gw.port, "/v1/chat/completions", body, headers={
            "authorization": f"Bearer {KEY}", "traceparent": TRACEPARENT,
            "tracestate": "vendor=1", "x-request-id": "rid-pd-1"})
        assert st == 200 and content(evs) == ["t0 ", "t1 ", "t2 "]
        flush(gw)
    finally:
        await gw.stop()
        await fp.stop()
        await fd.stop()
        rcv.close()
    names = sorted(s.name for s in rcv.spans)
    assert names == ["motor.decode", "motor.prefill", "motor.request", "motor.route",
                     "motor.route", "motor.tokenize"]
    assert {s.trace_id.hex() for s in rcv.spans} == {TRACE_ID}
    (root,) = rcv.by_name("motor.request")
    assert root.parent_span_id.hex() == CLIENT_SPAN
    for s in rcv.spans:
        if s is not root:
            assert s.parent_span_id == root.span_id, s.name
    a = attrs(root)
    assert a["motor.route"] == "chat" and a["motor.model"] == "m"
    assert a["motor.request_id"] == "rid-pd-1" and a["http.response.status_code"] == 200
    assert a["motor.key_name"] == "team-a"
    assert all(KEY not in str(v) for s in rcv.spans for v in attrs(s).values())
    assert "motor.first_token" in [e.name for e in root.events]
    tok = attrs(rcv.by_name("motor.tokenize")[0])
    assert tok["motor.tokenized"] is True and tok["motor.prompt_tokens"] > 0
    routes = {attrs(s)["motor.role"]: attrs(s) for s in rcv.by_name("motor.route")}
    assert set(routes) == {"prefill", "decode"}
    # the prefill by the coordinator's policy, the decode by pd.decode_policy (least_load)
    for role, fb, policy in (("prefill", fp, "kv_affinity"), ("decode", fd, "least_load")):
        r = routes[role]
        assert r["motor.policy"] == policy and r["motor.candidates"] == 1
        assert r["motor.endpoint"] == f"http://127.0.0.1:{fb.port}"
        assert "motor.instance" in r and r["motor.matched_tokens"] == 0
        assert "motor.predicted_cost" in r
    for kind, fb in (("prefill", fp), ("decode", fd)):
        (leg,) = rcv.by_name(f"motor.{kind}")
        la = attrs(leg)
        assert la["motor.leg"] == kind and la["http.response.status_code"] == 200
        assert la["motor.endpoint"] == f"http://127.0.0.1:{fb.port}"
        (e,) = fb.gen("/v1/chat/completions")
        # the engine's spans join the trace under the leg, not under the client's span
        assert traceparent_of(e) == (TRACE_ID, leg.span_id.hex())
        assert e.headers["tracestate"] == "vendor=1"
        assert e.headers["x-request-id"] == "rid-pd-1"


@run_async
async def test_retried_request_shows_the_retry_event_and_both_legs():
    rcv = Receiver()
    answered = []

    async def first_503(fb: FB, req: Any, resp: Any, e: Any) -> None:
        answered.append(fb)
        if len(answered) == 1:
            resp.send(503, b'{"error":{"message":"busy","type":"x","param":null,"code":503}}')
            return
        resp.send(200, orjson.dumps({"id": "c", "object": "chat.completion", "model": "m",
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant",
                                                              "content": "ok"}}],
                                     "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                               "total_tokens": 4}}))
    fbs = [FB(behave=first_503), FB(behave=first_503)]
    for fb in fbs:
        await fb.start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port) for fb in fbs],
                       tracing=tracing(rcv), retries={"backoff_s": 0.001}).start()
    try:
        st, _, data = await http(gw.port, "POST", "/v1/chat/completions",
                                 b'{"model":"m","messages":[{"role":"user","content":"hi"}]}',
                                 {"traceparent": TRACEPARENT})
        assert st == 200, data
        flush(gw)
    finally:
        await gw.stop()
        for fb in fbs:
            await fb.stop()
        rcv.close()
    (root,) = rcv.by_name("motor.request")
    (retry,) = [e for e in root.events if e.name == "motor.retry"]
    bad, good = answered
    ra = ev_attrs(retry)
    assert ra["motor.endpoint"] == f"http://127.0.0.1:{bad.port}" and "503" in ra["motor.reason"]
    legs = sorted(rcv.by_name("motor.union"), key=lambda s: s.start_time_unix_nano)
    assert [attrs(s)["http.response.status_code"] for s in legs] == [503, 200]
    assert [attrs(s)["motor.attempt"] for s in legs] == [0, 1]
    assert legs[0].status.code == 2 and legs[1].status.code != 2     # STATUS_CODE_ERROR
    assert len(rcv.by_name("motor.route")) == 2
    for fb, leg in ((bad, legs[0]), (good, legs[1])):
        (e,) = fb.gen("/v1/chat/completions")
        assert traceparent_of(e) == (TRACE_ID, leg.span_id.hex())


async def breaks_once(fb: FB, req: Any, resp: Any, e: Any) -> None:
    """A vLLM-like stream with token ids; a first leg dies after 2 tokens, a continuation
    (token-id prompt) ends the answer."""
    body = orjson.loads(req.body)
    prompt = body.get("prompt")
    cont = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)
    resp.start(200)
    if not cont:
        c0 = chat_chunk("a ", role=True, token_ids=[2000])
        c0["prompt_token_ids"] = [1, 2, 3]
        await write_events(resp, e, [sse(c0), sse(chat_chunk("b ", token_ids=[2001]))])
        resp.abort()
        return
    await write_events(resp, e, [sse({"id": "cmpl-fb", "object": "text_completion",
                                      "created": 1, "model": "m",
                                      "choices": [{"index": 0, "text": "c ",
                                                   "token_ids": [2002],
                                                   "finish_reason": "stop"}]})])
    resp.end(b"data: [DONE]\n\n")


@run_async
async def test_failed_over_stream_shows_the_failover_event_and_the_continuation_leg():
    rcv = Receiver()
    fbs = [FB(behave=breaks_once), FB(behave=breaks_once)]
    for fb in fbs:
        await fb.start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port) for fb in fbs],
                       tracing=tracing(rcv)).start()
    try:
        body = b'{"model":"m","messages":[{"role":"user","content":"go"}],"stream":true,' \
               b'"max_tokens":10}'
        st, _, evs, _ = await stream(gw.port, "/v1/chat/completions", body,
                                     headers={"traceparent": TRACEPARENT})
        assert st == 200 and content(evs) == ["a ", "b ", "c "]
        flush(gw)
    finally:
        await gw.stop()
        for fb in fbs:
            await fb.stop()
        rcv.close()
    (root,) = rcv.by_name("motor.request")
    (fov,) = [e for e in root.events if e.name == "motor.failover"]
    (first,) = rcv.by_name("motor.union")
    (cont,) = rcv.by_name("motor.continuation")
    first_ep = attrs(first)["motor.endpoint"]
    assert ev_attrs(fov)["motor.endpoint"] == first_ep and ev_attrs(fov)["motor.reason"] == "broken"
    assert first.status.code == 2 and attrs(cont)["http.response.status_code"] == 200
    assert attrs(cont)["motor.endpoint"] != first_ep
    assert cont.parent_span_id == root.span_id and first.parent_span_id == root.span_id
    assert attrs(root)["http.response.status_code"] == 200
    by_port = {f"http://127.0.0.1:{fb.port}": fb for fb in fbs}
    for leg in (first, cont):
        (e,) = by_port[attrs(leg)["motor.endpoint"]].log
        assert traceparent_of(e) == (TRACE_ID, leg.span_id.hex())


@run_async
async def test_unsampled_request_exports_nothing_and_forwards_the_client_headers():
    rcv = Receiver()
    fbs = [FB()]
    await fbs[0].start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fbs[0].port)],
                       tracing=tracing(rcv, ratio=0.0)).start()
    unsampled = f"00-{TRACE_ID}-{CLIENT_SPAN}-00"
    try:
        for tp in (None, unsampled):
            st, _, _ = await http(gw.port, "POST", "/v1/completions",
                                  b'{"model":"m","prompt":"x","max_tokens":2}',
                                  {"traceparent": tp} if tp else {})
            assert st == 200
        flush(gw)
    finally:
        await gw.stop()
        await fbs[0].stop()
        rcv.close()
    assert rcv.spans == []
    first, second = fbs[0].log
    assert "traceparent" not in first.headers and second.headers["traceparent"] == unsampled


# -- item 7: the access log and the JSON log format ---------------------------------------
class Lines:
    """A JSON-format handler on the ``motor`` loggers, its lines decoded."""

    def __init__(self) -> None:
        self.buf = io.StringIO()
        self.handler = make_handler("json", self.buf)
        self.log = logging.getLogger("motor")
        self.old_level = self.log.level

    def __enter__(self) -> Lines:
        self.log.addHandler(self.handler)
        self.log.setLevel(logging.INFO)
        return self

    def __exit__(self, *a: Any) -> None:
        self.log.removeHandler(self.handler)
        self.log.setLevel(self.old_level)

    def records(self) -> list[dict[str, Any]]:
        return [orjson.loads(x) for x in self.buf.getvalue().splitlines() if x]


@run_async
async def test_access_log_one_line_per_request_and_request_id_on_every_line():
    fbs = [FB(behave=breaks_once), FB(behave=breaks_once)]
    for fb in fbs:
        await fb.start()
    gw = await Gateway([(Role.UNION, "127.0.0.1", fb.port) for fb in fbs], access_log=True,
                       api_keys=[{"name": "team-a", "key": KEY}]).start()
    try:
        with Lines() as lines:
            body = b'{"model":"m","messages":[{"role":"user","content":"go"}],"stream":true,' \
                   b'"max_tokens":10,"stream_options":{"include_usage":true}}'
            st, _, evs, _ = await stream(gw.port, "/v1/chat/completions", body, headers={
                "authorization": f"Bearer {KEY}", "x-request-id": "rid-log-1"})
            assert st == 200 and content(evs) == ["a ", "b ", "c "]
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions",
                                  b'{"model":"m","messages":[]}',
                                  {"authorization": f"Bearer {KEY}", "x-request-id": "rid-log-2"})
            assert st == 400
            st, _, _ = await http(gw.port, "POST", "/v1/completions", b'{"model":"m"}',
                                  {"authorization": "Bearer wrong"})
            assert st == 401
            await asyncio.sleep(0)
        recs = lines.records()
    finally:
        await gw.stop()
        for fb in fbs:
            await fb.stop()
    access = [r for r in recs if r["logger"] == "motor.access"]
    assert len(access) == 3
    ok, bad, unauth = access
    assert ok["level"] == "INFO" and ok["request_id"] == "rid-log-1"
    assert ok["key"] == "team-a" and ok["route"] == "chat" and ok["model"] == "m"
    assert ok["status"] == 200 and ok["endpoint"] in {f"http://127.0.0.1:{fb.port}" for fb in fbs}
    assert ok["instance"] and ok["ttft_ms"] > 0 and ok["e2e_ms"] >= ok["ttft_ms"]
    assert ok["prompt_tokens"] == 3 and ok["completion_tokens"] == 3   # motor's usage chunk
    assert KEY not in orjson.dumps(access).decode()
    assert bad["status"] == 400 and bad["request_id"] == "rid-log-2" and bad["key"] == "team-a"
    assert unauth["status"] == 401 and unauth["key"] is None and unauth["route"] == "completions"
    # the failover's own log line carries the request id
    (fov,) = [r for r in recs if "continues elsewhere" in r["msg"]]
    assert fov["request_id"] == "rid-log-1" and fov["logger"] == "motor.coordinator.routing.union"
    assert REQUEST_ID.get() is None


def test_text_format_tags_lines_with_the_request_id():
    buf = io.StringIO()
    h = make_handler("text", buf)
    log = logging.getLogger("motor.test_i20")
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        log.info("outside")
        token = REQUEST_ID.set("abc")
        try:
            log.info("inside %d", 1)
        finally:
            REQUEST_ID.reset(token)
    finally:
        log.removeHandler(h)
        log.propagate = True
    first, second = buf.getvalue().splitlines()
    assert first.endswith(f"motor.test_i20[{os.getpid()}]: outside")
    assert "motor.test_i20[" in second and "] [request abc]: inside 1" in second


def test_log_format_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    from motor.logs import log_format
    monkeypatch.delenv("MOTOR_LOG_FORMAT", raising=False)
    assert log_format() == "text"
    monkeypatch.setenv("MOTOR_LOG_FORMAT", "JSON")
    assert log_format() == "json" and log_format("text") == "text"
    monkeypatch.setenv("MOTOR_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="text, json"):
        log_format()


def test_cli_options():
    import motor.cli as cli
    args = cli.build_parser("coordinator").parse_args(
        ["--log-format", "json", "coordinator", "--access-log"])
    assert args.log_format == "json" and args.access_log is True
    args = cli.build_parser("coordinator").parse_args(["coordinator"])
    assert args.log_format is None and args.access_log is None    # the config decides


def test_tracing_without_the_sdk_is_a_config_error(monkeypatch: pytest.MonkeyPatch):
    import builtins

    from motor.config.schema import TracingConfig
    from motor.coordinator.observe import Tracing
    from motor.errors import ConfigError
    real = builtins.__import__

    def no_otel(name: str, *a: Any, **k: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_otel)
    with pytest.raises(ConfigError, match=r"motor\[tracing\]"):
        Tracing(TracingConfig(enabled=True))
