"""Ingress worker: request -> route -> proxy -> stream back.

The request path in ``union`` mode:

1. parse the JSON body once (orjson) for ``model``, ``stream``, ``max_tokens`` and a
   prompt-size estimate; a body that is not a JSON object gets 400;
2. candidates = routable endpoints of role ``union`` serving the model (404 if no
   endpoint serves it, 503 if none is routable); the policy picks one;
3. the client's body bytes go upstream unchanged (extension fields, ``stream_options``,
   token-id prompts all pass as sent) with ``authorization``, ``x-request-id`` (made up
   when absent) and ``content-type``;
4. a connection refused / reset before any answer byte, or a connect timeout, is retried
   on another endpoint (``retries.max_attempts``, doubling backoff); the endpoint is ejected
   for a short cool-down;
5. the answer goes back with the engine's status: SSE streams chunk by chunk as they
   arrive, cut only at event boundaries so that a stream broken mid-way ends with one
   well-formed SSE error event and ``data: [DONE]``; other bodies whole. An engine error
   that is not an OpenAI error body is wrapped into one, status kept.

Every accepted request ends with exactly one terminal answer, and the endpoint's
in-flight counters are released in a ``finally``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Any

import orjson

from motor.config.schema import CoordinatorConfig, Role
from motor.coordinator import metrics
from motor.coordinator.endpoints import EndpointState, EndpointTable
from motor.coordinator.policy import Policy, RequestInfo
from motor.http.client import UpstreamClosed, UpstreamResponse, UpstreamTimeout
from motor.http.server import Request, Response, Router
from motor.protocol.openai import SSE_DONE, error_body

logger = logging.getLogger(__name__)

_JSON = b"application/json"
_FORWARD_HEADERS = frozenset((b"authorization", b"content-type", b"accept", b"openai-organization",
                              b"openai-project", b"traceparent", b"tracestate"))
_COOLDOWN_S = 1.0


class _Route:
    """Per-route metric children, resolved once."""

    __slots__ = ("name", "path", "ttft", "e2e", "_status")

    def __init__(self, name: str, path: bytes) -> None:
        self.name = name
        self.path = path
        self.ttft = metrics.TTFT.labels(name)
        self.e2e = metrics.E2E.labels(name)
        self._status: dict[int, Any] = {}

    def count(self, status: int) -> None:
        c = self._status.get(status)
        if c is None:
            c = self._status[status] = metrics.REQUESTS.labels(self.name, str(status))
        c.inc()


def _estimate_prompt_tokens(body: dict[str, Any], raw_len: int) -> int:
    """A cheap prompt-size estimate for load accounting (about 4 bytes a token for text)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], int):
        return len(p)
    return max(1, raw_len // 4)


def _is_openai_error(body: bytes) -> bool:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict)


class Coordinator:
    """One ingress worker's request handling (routes, proxy, management endpoints)."""

    def __init__(self, cfg: CoordinatorConfig, table: EndpointTable, policy: Policy) -> None:
        self.cfg = cfg
        self.table = table
        self.policy = policy
        self.first_byte_timeout_s = cfg.timeouts.first_token_s
        self.idle_timeout_s = cfg.timeouts.idle_s
        self.max_attempts = cfg.retries.max_attempts
        self.backoff_s = cfg.retries.backoff_s
        self.ready_source: asyncio.Event | None = None
        self.router = Router()
        # PD modes: the request path of motor.coordinator.routing (None in union mode)
        from motor.coordinator.routing import make_pd_mode
        self.pd = make_pd_mode(self)
        self._chat = _Route("chat", b"/v1/chat/completions")
        self._cmpl = _Route("completions", b"/v1/completions")
        r = self.router
        r.post("/v1/chat/completions")(self._on_chat)
        r.post("/v1/completions")(self._on_completions)
        r.get("/v1/models")(self._on_models)
        r.get("/health")(self._on_health)
        r.get("/liveness")(self._on_health)
        r.get("/readiness")(self._on_readiness)
        r.get("/metrics")(self._on_metrics)
        r.get("/instances")(self._on_instances)
        if self.pd is not None and hasattr(self.pd, "on_metaserver"):
            r.post("/v1/metaserver")(self.pd.on_metaserver)

    # -- management -----------------------------------------------------------
    async def _on_health(self, req: Request, resp: Response) -> None:
        resp.send(200, b'{"status":"ok"}')

    def routable_count(self) -> int:
        now = time.monotonic()
        return sum(1 for e in self.table.endpoints.values() if e.routable(now))

    async def _on_readiness(self, req: Request, resp: Response) -> None:
        n = self.routable_count()
        synced = self.ready_source is None or self.ready_source.is_set()
        if n > 0 and synced:
            resp.send(200, orjson.dumps({"status": "ready", "routable_endpoints": n}))
        else:
            resp.send(503, orjson.dumps({"status": "not ready", "routable_endpoints": n,
                                         "instance_table_synced": synced}))

    async def _on_metrics(self, req: Request, resp: Response) -> None:
        from motor.coordinator.supervisor import render_metrics
        resp.send(200, render_metrics(),
                  content_type=b"text/plain; version=0.0.4; charset=utf-8")

    async def _on_instances(self, req: Request, resp: Response) -> None:
        now = time.monotonic()
        out = [{"key": e.key, "instance": e.instance_id, "role": e.role.value, "url": e.url,
                "models": sorted(e.models), "ready": e.ready, "routable": e.routable(now),
                "inflight": e.inflight, "inflight_tokens": e.inflight_tokens}
               for e in self.table.endpoints.values()]
        resp.send(200, orjson.dumps({"version": self.table.version, "worker_pid": os.getpid(),
                                     "endpoints": out}))

    async def _on_models(self, req: Request, resp: Response) -> None:
        """Models of every routable endpoint, aggregated (not one worker's answer)."""
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "motor",
                 "root": m, "parent": None} for m in self.table.models()]
        resp.send(200, orjson.dumps({"object": "list", "data": data}))

    # -- inference ------------------------------------------------------------
    async def _on_chat(self, req: Request, resp: Response) -> None:
        if self.pd is not None:
            await self.pd.handle(self._chat, req, resp)
            return
        await self._proxy(self._chat, req, resp)

    async def _on_completions(self, req: Request, resp: Response) -> None:
        if self.pd is not None:
            await self.pd.handle(self._cmpl, req, resp)
            return
        await self._proxy(self._cmpl, req, resp)

    def _fail(self, route: _Route, resp: Response, status: int, message: str,
              headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        route.count(status)
        resp.send(status, error_body(status, message), headers=headers)

    async def _proxy(self, route: _Route, req: Request, resp: Response) -> None:
        t0 = time.perf_counter()
        raw = req.body
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            self._fail(route, resp, 400, f"request body is not valid JSON: {e}")
            return
        if not isinstance(body, dict):
            self._fail(route, resp, 400, f"request body is expected to be a JSON object, "
                                         f"got {type(body).__name__}")
            return
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            self._fail(route, resp, 400, f"model is expected to be a string, got {type(model).__name__}")
            return

        # headers to forward; X-Request-Id honoured or made up (case B15)
        fwd: list[tuple[bytes, bytes]] = []
        rid = None
        for k, v in req.headers:
            if k in _FORWARD_HEADERS:
                fwd.append((k, v))
            elif k == b"x-request-id":
                rid = v
        if rid is None:
            rid = uuid.uuid4().hex.encode()
        fwd.append((b"x-request-id", rid))
        rid_header = ((b"x-request-id", rid),)

        candidates = self.table.candidates(Role.UNION, model)
        if not candidates:
            if model is not None and not self.table.has_model(model):
                self._fail(route, resp, 404, f"The model `{model}` does not exist.", rid_header)
            else:
                self._fail(route, resp, 503, "no ready instance can serve this request"
                           + (f" (model {model})" if model else ""), rid_header)
            return
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 0
        if not isinstance(max_tokens, int):
            max_tokens = 0
        info = RequestInfo(model, _estimate_prompt_tokens(body, len(raw)), max_tokens)
        if self.policy.uses_prefix:  # kv_affinity: routing key = the tokenized request
            self.policy.prepare(info, route.name, body)
        tokens = info.prompt_tokens + max_tokens

        tried: set[EndpointState] = set()
        last_error = "no attempt made"
        for attempt in range(self.max_attempts):
            if attempt:
                candidates = self.table.candidates(Role.UNION, model)
                if not candidates:
                    break
                await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)))
            ep = self.policy.pick(candidates, info, tried)
            if ep is None:
                break
            tried.add(ep)
            prefill_tokens = info.prefill_tokens
            ep.acquire(tokens, prefill_tokens, max_tokens)
            self.policy.routed(ep, info)
            try:
                try:
                    up = await ep.pool.request(b"POST", route.path, raw, fwd,
                                               first_byte_timeout_s=self.first_byte_timeout_s,
                                               idle_timeout_s=self.idle_timeout_s)
                except UpstreamTimeout as e:
                    metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout").inc()
                    if e.phase == "connect":
                        ep.transport_failed(_COOLDOWN_S)
                        last_error = f"{ep.url}: {e}"
                        metrics.RETRIES.labels("connect_timeout").inc()
                        continue
                    self._fail(route, resp, 504, f"engine {ep.instance_id} did not answer within "
                                                 f"{e.timeout_s:g} s", rid_header)
                    return
                except (UpstreamClosed, OSError) as e:
                    kind = "closed" if isinstance(e, UpstreamClosed) else "connect"
                    metrics.UPSTREAM_ERRORS.labels(ep.url, kind).inc()
                    ep.transport_failed(_COOLDOWN_S)
                    last_error = f"{ep.url}: {type(e).__name__}: {e}"
                    if isinstance(e, UpstreamClosed) and not e.before_response:
                        # the engine may have started on it: do not run it twice
                        self._fail(route, resp, 502, f"engine {ep.instance_id} closed the "
                                                     f"connection: {e}", rid_header)
                        return
                    metrics.RETRIES.labels(kind).inc()
                    logger.debug("attempt %d on %s failed: %s", attempt + 1, ep.url, e)
                    continue
                ep.succeeded()
                await self._relay(route, up, resp, rid_header, ep, t0)
                return
            finally:
                ep.release(tokens, prefill_tokens, max_tokens)
        self._fail(route, resp, 502 if tried else 503,
                   f"no engine could take the request after {len(tried)} attempt(s): {last_error}",
                   rid_header)

    async def _relay(self, route: _Route, up: UpstreamResponse, resp: Response,
                     rid_header: tuple[tuple[bytes, bytes], ...], ep: EndpointState,
                     t0: float) -> None:
        """Send the engine's answer to the client (stream or whole), ending it exactly once."""
        async with up:
            ctype = up.header(b"content-type", _JSON) or _JSON
            is_sse = ctype.startswith(b"text/event-stream")
            if not is_sse:
                try:
                    data = await up.read()
                except (UpstreamTimeout, UpstreamClosed, OSError) as e:
                    status = 504 if isinstance(e, UpstreamTimeout) else 502
                    metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout" if status == 504 else "closed").inc()
                    self._fail(route, resp, status, f"engine {ep.instance_id} failed while "
                                                    f"answering: {e}", rid_header)
                    return
                if up.status >= 400 and not _is_openai_error(data):
                    text = data[:512].decode("utf-8", "replace")
                    data = error_body(up.status, f"engine {ep.instance_id} answered "
                                                 f"{up.status}: {text}")
                    ctype = _JSON
                route.count(up.status)
                resp.send(up.status, data, content_type=ctype, headers=rid_header)
                elapsed = time.perf_counter() - t0
                route.ttft.observe(elapsed)
                route.e2e.observe(elapsed)
                return

            resp.start(up.status, content_type=ctype, headers=rid_header)
            tail = b""          # bytes of an SSE event not yet complete
            first = True
            status = up.status
            try:
                while True:
                    chunk = await up.next_chunk()
                    if chunk is None:
                        break
                    if tail:
                        chunk = tail + chunk
                        tail = b""
                    cut = chunk.rfind(b"\n\n")
                    if cut < 0:
                        tail = chunk
                        continue
                    if cut + 2 < len(chunk):
                        tail = chunk[cut + 2:]
                        chunk = chunk[:cut + 2]
                    resp.write(chunk)
                    if first:
                        first = False
                        route.ttft.observe(time.perf_counter() - t0)
                    await resp.drain()
                if tail:
                    resp.write(tail)  # the engine ended without a blank line: pass it on as sent
                resp.end()
            except (UpstreamTimeout, UpstreamClosed, OSError) as e:
                is_timeout = isinstance(e, UpstreamTimeout)
                status = 504 if is_timeout else 502
                metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout" if is_timeout else "closed").inc()
                if resp.client_gone:
                    raise asyncio.CancelledError() from e
                msg = (f"engine {ep.instance_id} " +
                       ("stopped sending for longer than the idle timeout" if is_timeout
                        else f"broke the stream: {e}"))
                logger.warning("stream from %s ended early: %s", ep.url, e)
                resp.end(b"data: " + error_body(status, msg) + b"\n\n" + SSE_DONE)
            route.count(status)
            route.e2e.observe(time.perf_counter() - t0)
