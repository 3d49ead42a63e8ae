"""Ingress worker: request -> route -> proxy -> stream back.

The request path in ``union`` mode:

1. parse the JSON body once (orjson) for ``model``, ``stream``, ``max_tokens`` and a
   prompt-size estimate; a body that is not a JSON object gets 400;
2. candidates = routable endpoints of role ``union`` serving the model (404 if no
   endpoint serves it, 503 if none is routable); the policy picks one;
3. the client's body bytes go upstream unchanged (extension fields, ``stream_options``,
   token-id prompts all pass as sent) with ``authorization``, ``x-request-id`` (made up
   when absent) and ``content-type``; with ``api_keys`` set, a request without one of
   them as ``Authorization: Bearer`` gets 401 before anything else, and the engines get
   ``worker_api_key`` (or no ``authorization``) instead of the client's credential;
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
import hmac
import logging
import os
import time
import uuid
from typing import Any, Callable, Protocol

import orjson

from motor.config.schema import CoordinatorConfig, EngineKind, Role
from motor.coordinator import metrics
from motor.coordinator.endpoints import EndpointState, EndpointTable, Waiting
from motor.coordinator.recovery import (StreamRecovery, continuable, inject_token_ids,
                                        retryable_status)
from motor.coordinator.policy import Policy, RequestInfo
from motor.http.client import UpstreamClosed, UpstreamResponse, UpstreamTimeout
from motor.http.server import Request, Response, Router
from motor.protocol.openai import MAX_REQUEST_ID_BYTES, SSE_DONE, error_body, sse_error_event

logger = logging.getLogger(__name__)

_JSON = b"application/json"
#: client headers passed to engines (hop-by-hop and others dropped; Authorization per
#: :meth:`Coordinator.upstream_auth`)
FORWARD_HEADERS = frozenset((b"authorization", b"content-type", b"accept", b"openai-organization",
                             b"openai-project", b"traceparent", b"tracestate"))


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


class SseFeed(Protocol):
    """Rewrites whole SSE events on their way to the client ("" = drop them)."""

    def feed(self, block: bytes) -> bytes: ...


def _estimate_prompt_tokens(body: dict[str, Any], raw_len: int) -> int:
    """A cheap prompt-size estimate for load accounting (about 4 bytes a token for text)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and isinstance(p[0], int):
        return len(p)
    return max(1, raw_len // 4)


_ROLE_PREAMBLE = b'"role":"assistant","content":""'


def _past_prefill(block: bytes) -> bool:
    """Whether a block of whole SSE events holds one that follows the prefill: anything
    but keep-alive comments and the chat role preamble (``delta`` = role + empty content,
    which vLLM and SGLang send with the first token but ``motor sim`` sends on arrival)."""
    for ev in block.split(b"\n\n"):
        ev = ev.strip()
        if ev and not ev.startswith(b":") and _ROLE_PREAMBLE not in ev:
            return True
    return False


def _json_type(v: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if v is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(v), type(v).__name__)


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
        self.backoff_max_s = cfg.retries.backoff_max_s
        self.retry_statuses = frozenset(cfg.retries.retry_statuses)
        ka = cfg.timeouts.keepalive_s
        # streams wait for upstream chunks in keep-alive steps (an SSE comment each)
        self.stream_idle_step_s = ka if 0 < ka < self.idle_timeout_s else self.idle_timeout_s
        self.token_ids_mode = cfg.failover.request_token_ids
        self.failover_on = cfg.failover.enabled and self.token_ids_mode != "never"
        self.max_continuations = cfg.failover.max_continuations
        # gateway API keys (case B14): what clients must present, what engines get
        keys = list(cfg.api_keys) + [k.strip() for k in
                                     os.environ.get("MOTOR_API_KEYS", "").split(",") if k.strip()]
        self.api_keys: tuple[bytes, ...] = tuple(k.encode() for k in keys)
        wk = cfg.worker_api_key or os.environ.get("MOTOR_WORKER_API_KEY") or None
        self.worker_auth: bytes | None = b"Bearer " + wk.encode() if wk else None
        # the client's Authorization goes upstream only when motor neither checks nor replaces it
        self.forward_client_auth = not self.api_keys and self.worker_auth is None
        table.configure_breakers(cfg.breaker)
        self.ready_source: asyncio.Event | None = None
        self.router = Router()
        # PD modes: the request path of motor.coordinator.routing (None in union mode)
        from motor.coordinator.routing import make_pd_mode
        self.pd = make_pd_mode(self)
        self._chat = _Route("chat", b"/v1/chat/completions")
        self._cmpl = _Route("completions", b"/v1/completions")
        self._embed = _Route("embeddings", b"/v1/embeddings")
        self._generate = _Route("generate", b"/generate")
        r = self.router
        r.post("/v1/chat/completions")(self._on_chat)
        r.post("/v1/completions")(self._on_completions)
        r.post("/v1/embeddings")(self._on_embeddings)
        r.post("/generate")(self._on_generate)   # SGLang's native API, passed through
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

    def authorized(self, req: Request, resp: Response, route: "_Route | None" = None) -> bool:
        """With ``api_keys`` set: whether the request carries one as ``Authorization: Bearer``;
        if not, answers 401 with an OpenAI error body (the request reaches no engine)."""
        if not self.api_keys:
            return True
        h = req.header(b"authorization") or b""
        scheme, _, key = h.strip().partition(b" ")
        ok = False
        if scheme.lower() == b"bearer":
            key = key.strip()
            for k in self.api_keys:          # every key compared, in constant time each
                ok = hmac.compare_digest(key, k) or ok
        if not ok:
            if route is not None:
                route.count(401)
            msg = "Incorrect API key provided." if h else \
                "Missing API key: send it as `Authorization: Bearer <key>`."
            resp.send(401, orjson.dumps({"error": {"message": msg,
                                                   "type": "invalid_request_error",
                                                   "param": None, "code": "invalid_api_key"}}),
                      headers=((b"www-authenticate", b'Bearer realm="motor"'),))
        return ok

    def upstream_auth(self, fwd: list[tuple[bytes, bytes]], k: bytes, v: bytes) -> None:
        """Add a client's header ``k: v`` to the headers sent upstream, Authorization only
        when it is forwarded as sent (no gateway keys, no worker key)."""
        if k != b"authorization" or self.forward_client_auth:
            fwd.append((k, v))

    async def _on_models(self, req: Request, resp: Response) -> None:
        """Models of every routable endpoint, aggregated (not one worker's answer)."""
        if not self.authorized(req, resp):
            return
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "motor",
                 "root": m, "parent": None} for m in self.table.models()]
        resp.send(200, orjson.dumps({"object": "list", "data": data}))

    # -- inference ------------------------------------------------------------
    async def _on_chat(self, req: Request, resp: Response) -> None:
        if not self.authorized(req, resp, self._chat):
            return
        if self.pd is not None:
            await self.pd.handle(self._chat, req, resp)
            return
        await self._proxy(self._chat, req, resp)

    async def _on_completions(self, req: Request, resp: Response) -> None:
        if not self.authorized(req, resp, self._cmpl):
            return
        if self.pd is not None:
            await self.pd.handle(self._cmpl, req, resp)
            return
        await self._proxy(self._cmpl, req, resp)

    async def _on_embeddings(self, req: Request, resp: Response) -> None:
        if self.authorized(req, resp, self._embed):
            await self._proxy(self._embed, req, resp)

    async def _on_generate(self, req: Request, resp: Response) -> None:
        if self.authorized(req, resp, self._generate):
            await self._proxy(self._generate, req, resp)

    def _fail(self, route: _Route, resp: Response, status: int, message: str,
              headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        route.count(status)
        resp.send(status, error_body(status, message), headers=headers)

    def parse_request(self, route: _Route, req: Request, resp: Response
                      ) -> "tuple[dict[str, Any], str | None, list[tuple[bytes, bytes]], bytes] | None":
        """The checks every inference route shares (union and PD paths): the body is a JSON
        object, ``model`` a string, ``X-Request-Id`` honoured (made up when absent or empty,
        400 above :data:`MAX_REQUEST_ID_BYTES`, case B15); headers to forward, with the
        worker key when one is set. Returns (body, model, forwarded headers, request id), or
        ``None`` after answering 400."""
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            self._fail(route, resp, 400, f"request body is not valid JSON: {e}")
            return None
        if not isinstance(body, dict):
            self._fail(route, resp, 400, f"request body is expected to be a JSON object, "
                                         f"got {_json_type(body)}")
            return None
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            self._fail(route, resp, 400, f"model is expected to be a string, got {type(model).__name__}")
            return None
        fwd: list[tuple[bytes, bytes]] = []
        rid = None
        for k, v in req.headers:
            if k in FORWARD_HEADERS:
                self.upstream_auth(fwd, k, v)
            elif k == b"x-request-id" and v:  # an empty id is made up like a missing one
                rid = v
                if len(v) > MAX_REQUEST_ID_BYTES:
                    self._fail(route, resp, 400, f"x-request-id is expected to be at most "
                                                 f"{MAX_REQUEST_ID_BYTES} bytes, got {len(v)}")
                    return None
        if rid is None:
            rid = uuid.uuid4().hex.encode()
        fwd.append((b"x-request-id", rid))
        if self.worker_auth is not None:
            fwd.append((b"authorization", self.worker_auth))
        return body, model, fwd, rid

    async def _proxy(self, route: _Route, req: Request, resp: Response,
                     parsed: "tuple[dict[str, Any], str | None, list[tuple[bytes, bytes]], bytes]"
                     " | None" = None) -> None:
        """Union path. ``parsed``: :meth:`parse_request`'s result when the caller already has
        it (a PD mode falling back to union instances)."""
        t0 = time.perf_counter()
        raw = req.body
        if parsed is None:
            parsed = self.parse_request(route, req, resp)
            if parsed is None:
                return
        body, model, fwd, rid = parsed
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

        stream = body.get("stream") is True
        chat = route is self._chat
        rec: StreamRecovery | None = None
        with_ids = raw
        why_not = "failover is off" if stream else "not a stream"
        if stream and self.failover_on and (chat or route is self._cmpl):
            why = continuable(chat, body)
            if why is None:
                rec = StreamRecovery(chat, body)
                with_ids = inject_token_ids(raw, body)
            else:
                why_not = why
                logger.debug("request %s: no mid-stream failover (%s)", rid.decode("latin-1"), why)
        load = _Load(tokens, max_tokens)
        try:
            res = await self._dispatch(route.path, raw, with_ids, fwd, model, info, load, set(),
                                       stream, candidates)
        except asyncio.CancelledError:
            metrics.CLIENT_DISCONNECTS.labels("before_answer").inc()
            raise
        if isinstance(res, _Fail):
            self._fail(route, resp, res.status, res.message, rid_header)
            return
        if isinstance(res, _Whole):
            data, ctype = res.data, res.ctype
            if res.status >= 400 and not _is_openai_error(data):
                text = data[:512].decode("utf-8", "replace")
                data = error_body(res.status, f"engine answered {res.status}: {text}")
                ctype = _JSON
            route.count(res.status)
            resp.send(res.status, data, content_type=ctype, headers=rid_header + res.headers)
            elapsed = time.perf_counter() - t0
            route.ttft.observe(elapsed)
            route.e2e.observe(elapsed)
            return
        await self._stream(route, res, resp, rid_header, t0, rec, raw, fwd, model, info, load,
                           why_not)

    # -- dispatch: pick, send, retry before the first byte --------------------------------
    def _ids_for(self, ep: EndpointState) -> bool:
        return self.token_ids_mode == "always" or ep.engine is not EngineKind.SGLANG

    async def _dispatch(self, path: bytes, raw: bytes, with_ids: bytes,
                        fwd: list[tuple[bytes, bytes]], model: str | None, info: RequestInfo,
                        load: "_Load", tried: set[EndpointState],
                        stream: bool, first: "list[EndpointState] | None" = None,
                        ) -> "_Fail | _Whole | _Sse":
        """Send the request to an endpoint, retrying on another one (bounded, with backoff)
        while nothing reached the client: transport errors, an endpoint leaving the routable
        set, retryable statuses (:func:`retryable_status`). A streamed answer comes back open
        (:class:`_Sse`, its endpoint still acquired); any other answer is read whole.
        ``first``: the candidate list for the first attempt when the caller just built it
        (no await in between); later attempts rebuild it."""
        last_error = "no attempt made"
        last_answer: _Whole | None = None
        idle_s = self.stream_idle_step_s if stream else self.idle_timeout_s
        task = asyncio.current_task()
        n_tried = 0
        for attempt in range(self.max_attempts):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * (2 ** (attempt - 1)), self.backoff_max_s))
            # the caller's list serves the first attempt (built microseconds ago)
            candidates = first if attempt == 0 and first is not None else \
                self.table.candidates(Role.UNION, model)
            if not candidates:
                break
            ep = self.policy.pick(candidates, info, tried)
            if ep is None:
                break
            tried.add(ep)
            n_tried += 1
            prefill_tokens = info.prefill_tokens
            ep.acquire(load.tokens, prefill_tokens, load.decode_tokens)
            self.policy.routed(ep, info)
            keep = False
            try:
                w = Waiting(task)
                ep.waiting.add(w)
                try:
                    up = await ep.pool.request(b"POST", path,
                                               with_ids if with_ids is not raw and self._ids_for(ep)
                                               else raw, fwd,
                                               first_byte_timeout_s=self.first_byte_timeout_s,
                                               idle_timeout_s=idle_s)
                except asyncio.CancelledError:
                    if w.evicted is not None and task is not None and task.uncancel() == 0:
                        last_error = f"{ep.url}: {w.evicted}"
                        metrics.RETRIES.labels("endpoint_left").inc()
                        continue
                    raise
                except UpstreamTimeout as e:
                    metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout").inc()
                    ep.failed()
                    if e.phase == "connect":
                        last_error = f"{ep.url}: {e}"
                        metrics.RETRIES.labels("connect_timeout").inc()
                        continue
                    return _Fail(504, f"engine {ep.instance_id} did not answer within "
                                      f"{e.timeout_s:g} s")
                except (UpstreamClosed, OSError) as e:
                    refused = isinstance(e, ConnectionRefusedError)
                    kind = "connect" if refused else "closed"
                    metrics.UPSTREAM_ERRORS.labels(ep.url, kind).inc()
                    ep.failed(certain=refused)
                    last_error = f"{ep.url}: {type(e).__name__}: {e}"
                    metrics.RETRIES.labels(kind).inc()
                    logger.debug("attempt %d on %s failed: %s", attempt + 1, ep.url, e)
                    continue
                finally:
                    ep.waiting.discard(w)
                status = up.status
                if status >= 500 and status != 503:
                    ep.failed()
                    metrics.UPSTREAM_ERRORS.labels(ep.url, "status").inc()
                else:
                    ep.succeeded()
                ctype = up.header(b"content-type", _JSON) or _JSON
                if status < 300 and ctype.startswith(b"text/event-stream"):
                    keep = True
                    return _Sse(ep, up, ctype, prefill_tokens)
                try:
                    async with up:
                        data = await self._read_whole(up)
                except UpstreamTimeout as e:
                    metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout").inc()
                    return _Fail(504, f"engine {ep.instance_id} stopped answering for "
                                      f"{e.timeout_s:g} s")
                except (UpstreamClosed, OSError) as e:
                    # nothing reached the client yet: the answer can still come from elsewhere
                    metrics.UPSTREAM_ERRORS.labels(ep.url, "closed").inc()
                    ep.failed()
                    last_error = f"{ep.url}: {type(e).__name__}: {e}"
                    metrics.RETRIES.labels("closed").inc()
                    continue
                retry_after = up.header(b"retry-after")
                extra = ((b"retry-after", retry_after),) if retry_after is not None else ()
                answer = _Whole(status, ctype, data, extra)
                if status >= 400 and retryable_status(status, up.headers, self.retry_statuses):
                    last_answer = answer
                    last_error = f"{ep.url}: answered {status}"
                    metrics.RETRIES.labels(f"status_{status}").inc()
                    continue
                return answer
            finally:
                if not keep:
                    ep.release(load.tokens, prefill_tokens, load.decode_tokens)
        if last_answer is not None:
            return last_answer
        return _Fail(502 if n_tried else 503,
                     f"no engine could take the request after {n_tried} attempt(s): {last_error}")

    async def _read_whole(self, up: UpstreamResponse) -> bytes:
        """The whole body; the idle timeout counts silence across keep-alive steps."""
        parts: list[bytes] = []
        silence = 0.0
        while True:
            try:
                chunk = await up.next_chunk()
            except UpstreamTimeout as e:
                if e.phase != "idle" or e.timeout_s >= self.idle_timeout_s:
                    raise
                silence += e.timeout_s
                if silence >= self.idle_timeout_s:
                    raise UpstreamTimeout("idle", self.idle_timeout_s) from None
                continue
            if chunk is None:
                return b"".join(parts)
            silence = 0.0
            parts.append(chunk)

    # -- streams ----------------------------------------------------------------------
    async def _pump(self, up: UpstreamResponse, resp: Response, rec: "SseFeed | None",
                    route: _Route, t0: float, first: bool,
                    on_first: Callable[[], object] | None = None,
                    on_prefill_done: Callable[[], object] | None = None
                    ) -> tuple[BaseException | None, bool]:
        """Relay one leg's SSE events to the client, cut at event boundaries, each block
        passed through ``rec.feed`` (stream recovery here, the usage merge of the PD modes).
        ``on_first``: called at the first event written to the client (``first``);
        ``on_prefill_done``: called once, at this leg's first engine event past its
        prefill (:func:`_past_prefill`).

        Returns (the error that ended the leg or ``None``, whether anything was written)."""
        tail = b""
        wrote = False
        silence = 0.0
        idle_s = self.idle_timeout_s
        try:
            while True:
                try:
                    chunk = await up.next_chunk()
                except UpstreamTimeout as e:
                    if e.phase != "idle" or e.timeout_s >= idle_s:
                        raise
                    silence += e.timeout_s
                    if silence >= idle_s:
                        raise UpstreamTimeout("idle", idle_s) from None
                    resp.write(b": keep-alive\n\n")
                    continue
                if chunk is None:
                    break
                silence = 0.0
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
                if on_prefill_done is not None and _past_prefill(chunk):
                    on_prefill_done()
                    on_prefill_done = None
                if rec is not None:
                    chunk = rec.feed(chunk)
                    if not chunk:
                        continue
                resp.write(chunk)
                wrote = True
                if first:
                    first = False
                    route.ttft.observe(time.perf_counter() - t0)
                    if on_first is not None:
                        on_first()
                await resp.drain()
        except (UpstreamTimeout, UpstreamClosed, OSError) as e:
            return e, wrote
        if tail:
            # the engine ended without a blank line: pass it on as sent (case B04 b)
            if rec is not None:
                tail = rec.feed(tail + b"\n\n")
            resp.write(tail)
            wrote = True
        return None, wrote

    async def _stream(self, route: _Route, res: "_Sse", resp: Response,
                      rid_header: tuple[tuple[bytes, bytes], ...], t0: float,
                      rec: StreamRecovery | None, raw: bytes, fwd: list[tuple[bytes, bytes]],
                      model: str | None, info: RequestInfo, load: "_Load", why_not: str) -> None:
        """Relay a streamed answer, continuing it on another instance when its engine fails
        (``rec`` set) or restarting it while no event reached the client; ends exactly once."""
        ep: EndpointState | None = res.ep
        up: UpstreamResponse | None = res.up
        # the current leg's prefill tokens still counted on ep: they leave its load at the
        # leg's first token (the engine is decoding then), the rest at release
        prefill_tokens = res.prefill_tokens

        def prefill_done() -> None:
            nonlocal prefill_tokens
            if ep is not None and prefill_tokens:
                ep.prefill_done(prefill_tokens)
                prefill_tokens = 0
        resp.start(200, content_type=res.ctype, headers=rid_header)
        status = 200
        wrote_any = False
        legs = 0
        try:
            while True:
                assert ep is not None and up is not None
                err, wrote = await self._pump(up, resp, rec, route, t0, not wrote_any,
                                              on_prefill_done=prefill_done)
                wrote_any = wrote_any or wrote
                up.close()
                if rec is None:
                    if err is None:
                        ep.succeeded()
                        resp.end()
                        break
                    reason = "broken"
                else:
                    if err is None:
                        if rec.done:
                            ep.succeeded()
                            resp.end()
                            break
                        if rec.recomputed:
                            ep.succeeded()
                            reason = "recomputed"
                        elif rec.engine_error is not None:
                            reason = "engine_error"
                        elif rec.finished:   # finishing chunk seen, [DONE] missing
                            ep.succeeded()
                            resp.end(rec.tail_after_finish())
                            break
                        else:
                            reason = "broken"
                    else:
                        reason = "broken"
                if isinstance(err, UpstreamTimeout):
                    metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout").inc()
                    ep.failed()
                    if resp.client_gone:
                        raise asyncio.CancelledError()
                    status = 504
                    resp.end(sse_error_event(504, f"engine {ep.instance_id} stopped sending for "
                                                  f"longer than the idle timeout "
                                                  f"({self.idle_timeout_s:g} s)"))
                    break
                if reason != "recomputed":
                    if err is not None:
                        metrics.UPSTREAM_ERRORS.labels(ep.url, "closed").inc()
                    ep.failed()
                if resp.client_gone:
                    raise asyncio.CancelledError()
                if rec is not None and rec.finished and not rec.recomputed:
                    resp.end(rec.tail_after_finish())   # broke after the finishing chunk
                    break
                why: str | None = None
                if legs >= self.max_continuations:
                    why = f"{legs} continuation(s) already"
                elif rec is not None:
                    why = rec.why_not()
                elif wrote_any:
                    why = f"the request cannot be continued exactly ({why_not})"
                if why is not None:
                    metrics.FAILOVER_REFUSED.labels("refused").inc()
                    status = 502
                    msg = f"engine {ep.instance_id} failed mid-stream ({err or reason}); " \
                          f"not continued: {why}"
                    logger.warning("stream from %s ended early: %s", ep.url, msg)
                    if rec is not None and rec.engine_error is not None \
                            and rec.engine_error.startswith(b"data:"):
                        resp.end(rec.engine_error + SSE_DONE)
                    else:
                        resp.end(sse_error_event(502, msg))
                    break
                if rec is not None:
                    rem = rec.remaining()
                    if rem is not None and rem <= 0:
                        resp.end(rec.length_tail())
                        break
                    path, body = rec.continuation(route.path)
                    if not wrote_any and reason == "broken":
                        reason = "restart"
                else:
                    path, body = route.path, raw
                    reason = "restart"
                failed_ep = ep
                ep.release(load.tokens, prefill_tokens, load.decode_tokens)
                ep = None
                legs += 1
                metrics.FAILOVERS.labels(reason).inc()
                logger.info("stream from %s continues elsewhere (%s, leg %d)", failed_ep.url,
                            reason, legs + 1)
                nxt = await self._dispatch(path, body, body, fwd, model, info, load, {failed_ep},
                                           True)
                if not isinstance(nxt, _Sse):
                    status = nxt.status if nxt.status >= 400 else 502
                    msg = nxt.message if isinstance(nxt, _Fail) else \
                        nxt.data[:512].decode("utf-8", "replace")
                    resp.end(sse_error_event(status, f"the stream could not be continued: {msg}"))
                    break
                ep, up, prefill_tokens = nxt.ep, nxt.up, nxt.prefill_tokens
        except (asyncio.CancelledError, ConnectionError):
            metrics.CLIENT_DISCONNECTS.labels("streaming").inc()
            raise
        finally:
            if up is not None:
                up.close()
            if ep is not None:
                ep.release(load.tokens, prefill_tokens, load.decode_tokens)
        route.count(status)
        route.e2e.observe(time.perf_counter() - t0)


class _Load:
    """What a request adds to an endpoint's load counters while it runs there."""

    __slots__ = ("tokens", "decode_tokens")

    def __init__(self, tokens: int, decode_tokens: int) -> None:
        self.tokens = tokens
        self.decode_tokens = decode_tokens


class _Fail:
    """No engine answer to pass on: motor answers ``status`` with an OpenAI error."""

    __slots__ = ("status", "message")

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message


class _Whole:
    """An engine's complete (non-streamed) answer."""

    __slots__ = ("status", "ctype", "data", "headers")

    def __init__(self, status: int, ctype: bytes, data: bytes,
                 headers: tuple[tuple[bytes, bytes], ...]) -> None:
        self.status = status
        self.ctype = ctype
        self.data = data
        self.headers = headers


class _Sse:
    """An engine's streamed answer, open; its endpoint stays acquired until released."""

    __slots__ = ("ep", "up", "ctype", "prefill_tokens")

    def __init__(self, ep: EndpointState, up: UpstreamResponse, ctype: bytes,
                 prefill_tokens: int) -> None:
        self.ep = ep
        self.up = up
        self.ctype = ctype
        self.prefill_tokens = prefill_tokens
