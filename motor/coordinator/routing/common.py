"""What the three PD modes share: request parsing, pair selection, legs, relay, metrics.

A PD mode is a :class:`PdMode` subclass with one coroutine, :meth:`PdMode.run`, called by
the coordinator for ``/v1/chat/completions`` and ``/v1/completions``. Every mode

* picks the prefill instance with the prefill policy and the decode instance with the
  decode policy (``coordinator.pd``); with no decode (or no prefill) instance ready it
  falls back to a ``union`` instance through the ordinary request path, else 503;
* sends both legs the same ``X-Request-Id`` (made up when the client sent none);
* holds each leg's load on its endpoint exactly while that leg runs (released in a
  ``finally``), closes each leg's upstream connection when the request ends for any
  reason (client gone, timeout, the other leg failed), and answers exactly once;
* streams the decode answer through the coordinator's SSE pump (cut at event boundaries,
  never buffered, one SSE error event + ``[DONE]`` when the decode breaks).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import Counter, Histogram

from motor.config.schema import PolicyName, Role
from motor.coordinator import metrics
from motor.coordinator.endpoints import EndpointState
from motor.coordinator.policy import Policy, RequestInfo, make_policy
from motor.coordinator.recovery import StreamRecovery, continuable
from motor.http.client import UpstreamClosed, UpstreamResponse, UpstreamTimeout
from motor.http.server import Request, Response
from motor.protocol.openai import SSE_DONE, error_body, sse_error_event

if TYPE_CHECKING:
    from motor.coordinator.server import Coordinator

logger = logging.getLogger(__name__)

_JSON = b"application/json"

# -- metrics (per mode) ---------------------------------------------------------------
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
            120.0, 300.0)
PD_TTFT = Histogram(
    "motor_coordinator_pd_time_to_first_token_seconds",
    "PD modes: request received -> first byte of the decode answer sent to the client.",
    ["mode"], buckets=_BUCKETS, registry=metrics.REGISTRY)
PD_PREFILL = Histogram(
    "motor_coordinator_pd_prefill_seconds",
    "PD modes: prefill leg sent -> prefill answer complete (bootstrap: P's answer; "
    "decode-first: metaserver callback -> P done).", ["mode"], buckets=_BUCKETS,
    registry=metrics.REGISTRY)
PD_DECODE = Histogram(
    "motor_coordinator_pd_decode_seconds",
    "PD modes: decode leg sent -> decode answer complete.", ["mode"], buckets=_BUCKETS,
    registry=metrics.REGISTRY)
PD_REQUESTS = Counter(
    "motor_coordinator_pd_requests_total",
    "PD requests by mode and outcome (ok, prefill_failed, decode_failed, fallback_union, "
    "no_instance, client_gone).", ["mode", "outcome"], registry=metrics.REGISTRY)


class LegFailed(Exception):
    """A leg could not produce an answer; the client gets ``status`` with ``body``."""

    def __init__(self, status: int, message: str, body: bytes | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body if body is not None else error_body(status, message)


class Ctx:
    """One PD request: the client's body, headers to forward, ids, timing."""

    __slots__ = ("route", "path", "chat", "req", "resp", "raw", "body", "model", "fwd", "rid",
                 "rid_header", "stream", "info", "max_tokens", "t0", "rec", "cont", "avoid",
                 "legs", "wrote", "decode_load")

    def __init__(self, route: Any, req: Request, resp: Response, raw: bytes,
                 body: dict[str, Any], model: str | None, fwd: list[tuple[bytes, bytes]],
                 rid: bytes) -> None:
        self.route = route
        self.path: bytes = route.path
        self.chat = route.name == "chat"
        self.req = req
        self.resp = resp
        self.raw = raw
        self.body = body
        self.model = model
        self.fwd = fwd
        self.rid = rid
        self.rid_header = ((b"x-request-id", rid),)
        self.stream = body.get("stream") is True
        self._size(len(raw))
        self.t0 = time.perf_counter()
        # mid-stream failover (docs/faults.md): the stream's StreamRecovery, the next leg's
        # context once the decode broke, decode endpoints not to use again, legs so far,
        # whether an event reached the client
        self.rec: StreamRecovery | None = None
        self.cont: Ctx | None = None
        self.avoid: set[EndpointState] = set()
        #: what each decode leg acquired (released exactly, whatever later changes ctx.info)
        self.decode_load: dict[EndpointState, int] = {}
        self.legs = 0
        self.wrote = False

    def _size(self, raw_len: int) -> None:
        body = self.body
        mt = body.get("max_completion_tokens") if self.chat else None
        if mt is None:
            mt = body.get("max_tokens")
        self.max_tokens = mt if isinstance(mt, int) and not isinstance(mt, bool) else 0
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], int):
            prompt_tokens = len(p)
        else:
            prompt_tokens = max(1, raw_len // 4)
        self.info = RequestInfo(self.model, prompt_tokens, self.max_tokens)

    def continued(self, path: bytes, body: dict[str, Any]) -> "Ctx":
        """The context of the next leg of a broken stream: a fresh PD request for ``path``
        with ``body`` (StreamRecovery's continuation), same client, ids, response and
        recovery state."""
        c = Ctx.__new__(Ctx)
        for k in Ctx.__slots__:
            setattr(c, k, getattr(self, k))
        c.path = path
        c.chat = path == b"/v1/chat/completions"
        c.body = body
        c.raw = b""
        c.stream = True
        c._size(len(orjson.dumps(body)))
        c.cont = None
        c.legs = self.legs + 1
        return c


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None,
                 min_tokens_1: bool = False) -> dict[str, Any]:
    """The prefill leg's body: the client's, with ``stream: false``, ``max_tokens: 1``
    (``max_completion_tokens: 1`` when present), no ``stream_options``, no ``min_tokens``
    (vLLM's toy proxy) or ``min_tokens: 1`` (vLLM-Ascend's proxies), and
    ``kv_transfer_params``."""
    b = dict(body)
    b["stream"] = False
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b.pop("stream_options", None)
    b.pop("min_completion_tokens", None)
    if min_tokens_1:
        b["min_tokens"] = 1
    else:
        b.pop("min_tokens", None)
    if kv_transfer_params is not None:
        b["kv_transfer_params"] = kv_transfer_params
    return b


def merge_usage(d_usage: Any, p_usage: Any) -> Any:
    """The decode's usage with the prefill's ``prompt_tokens_details`` (its cached tokens
    are the real prefix-cache hit; D counts the transferred prompt as cached)."""
    if not isinstance(d_usage, dict) or not isinstance(p_usage, dict):
        return d_usage
    ptd = p_usage.get("prompt_tokens_details")
    if isinstance(ptd, dict):
        d_usage = dict(d_usage)
        d_usage["prompt_tokens_details"] = ptd
    return d_usage


class UsageMerger:
    """Rewrites the usage of streamed decode events (``feed`` takes whole SSE events)."""

    def __init__(self, p_usage: Any) -> None:
        self.p_usage = p_usage

    def feed(self, chunk: bytes) -> bytes:
        if not isinstance(self.p_usage, dict) or b'"usage":{' not in chunk:
            return chunk
        out = []
        for ev in chunk.split(b"\n\n"):
            if ev.startswith(b"data: {") and b'"usage":{' in ev:
                try:
                    obj = orjson.loads(ev[6:])
                    obj["usage"] = merge_usage(obj.get("usage"), self.p_usage)
                    ev = b"data: " + orjson.dumps(obj)
                except (orjson.JSONDecodeError, TypeError):
                    pass
            out.append(ev)
        return b"\n\n".join(out)


def _own_policy(name: PolicyName, cfg: Any) -> Policy:
    """A leg's policy other than the coordinator's. ``kv_affinity`` gets its own router
    with ``coordinator.kv`` (approximate index only: the KV-event feed serves the
    coordinator's policy, so set ``coordinator.policy: kv_affinity`` to route on events)."""
    if name is PolicyName.KV_AFFINITY:
        from motor.coordinator.kv.router import KvRouter
        return make_policy(name.value, router=KvRouter(cfg.kv))
    return make_policy(name.value)


class PdMode:
    """Base of the PD modes; subclasses implement :meth:`run`."""

    name = ""

    def __init__(self, coord: "Coordinator") -> None:
        self.coord = coord
        cfg = coord.cfg
        pd = cfg.pd
        pp = pd.prefill_policy
        self.prefill_policy: Policy = coord.policy if pp is None or pp == cfg.policy \
            else _own_policy(pp, cfg)
        self.decode_policy: Policy = coord.policy if pd.decode_policy == cfg.policy \
            else _own_policy(pd.decode_policy, cfg)
        self.prefill_timeout_s: float = pd.prefill_timeout_s or cfg.timeouts.first_token_s
        self.fallback_to_union: bool = pd.fallback_to_union
        self.first_byte_timeout_s = cfg.timeouts.first_token_s
        self.idle_timeout_s = cfg.timeouts.idle_s
        ka = getattr(cfg.timeouts, "keepalive_s", 0.0)
        self.keepalive_s = ka if 0 < ka < self.idle_timeout_s else 0.0
        self.max_attempts = cfg.retries.max_attempts
        self.backoff_s = cfg.retries.backoff_s
        self.backoff_max_s = cfg.retries.backoff_max_s
        self.retry_statuses = frozenset(getattr(cfg.retries, "retry_statuses",
                                                (429, 502, 503, 504)))

    # -- entry ------------------------------------------------------------------------
    async def handle(self, route: Any, req: Request, resp: Response) -> None:
        raw = req.body
        coord = self.coord
        parsed = coord.parse_request(route, req, resp)
        if parsed is None:
            return
        body, model, fwd, rid = parsed
        ctx = Ctx(route, req, resp, raw, body, model, fwd, rid)
        table = self.coord.table
        if not table.candidates(Role.PREFILL, model) or not table.candidates(Role.DECODE, model):
            if self.fallback_to_union and table.candidates(Role.UNION, model):
                PD_REQUESTS.labels(self.name, "fallback_union").inc()
                await self.coord._proxy(route, req, resp, parsed)
                return
            PD_REQUESTS.labels(self.name, "no_instance").inc()
            if model is not None and not table.has_model(model):
                self.fail(route, resp, 404, f"The model `{model}` does not exist.",
                          ctx.rid_header)
                return
            missing = "decode" if table.candidates(Role.PREFILL, model) else "prefill"
            self.fail(route, resp, 503, f"no {missing} instance is ready"
                      + (f" for model {model}" if model else "")
                      + " and no union instance to fall back to", ctx.rid_header)
            return
        self.recovery(ctx)
        try:
            await self.run(ctx)
            while ctx.cont is not None:
                # the decode broke mid-stream: the rest is a fresh PD request (new P and D)
                ctx = ctx.cont
                await self.run(ctx)
        except LegFailed as e:
            if not resp.started:
                self.fail_body(ctx, e.status, e.body)
            elif not resp.finished:
                resp.end(sse_error_event(e.status, e.message))
                route.count(e.status)
        except (asyncio.CancelledError, ConnectionError):
            PD_REQUESTS.labels(self.name, "client_gone").inc()
            raise

    async def run(self, ctx: Ctx) -> None:
        raise NotImplementedError

    def recovery(self, ctx: Ctx) -> None:
        """Mid-stream failover for a stream that can be continued exactly: the decode is
        asked for token ids (``return_token_ids`` in both legs' body; not for SGLang decode
        instances unless ``failover.request_token_ids: always``)."""
        coord = self.coord
        if not (ctx.stream and coord.failover_on):
            return
        why = continuable(ctx.chat, ctx.body)
        if why is not None:
            logger.debug("request %s: no mid-stream failover (%s)", ctx.rid.decode("latin-1"),
                         why)
            return
        if coord.token_ids_mode != "always" and all(
                not coord._ids_for(e) for e in coord.table.candidates(Role.DECODE, ctx.model)):
            return
        ctx.rec = StreamRecovery(ctx.chat, ctx.body)
        if ctx.body.get("return_token_ids") is not True:
            ctx.body = dict(ctx.body, return_token_ids=True)

    # -- answers ----------------------------------------------------------------------
    def fail(self, route: Any, resp: Response, status: int, message: str,
             headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        route.count(status)
        resp.send(status, error_body(status, message), headers=headers)

    def fail_body(self, ctx: Ctx, status: int, body: bytes) -> None:
        ctx.route.count(status)
        ctx.resp.send(status, body, headers=ctx.rid_header)

    # -- selection --------------------------------------------------------------------
    def pick(self, role: Role, ctx: Ctx, exclude: set[EndpointState]) -> EndpointState | None:
        cands = self.coord.table.candidates(role, ctx.model)
        if not cands:
            return None
        policy = self.prefill_policy if role is Role.PREFILL else self.decode_policy
        if policy.uses_prefix and role is Role.PREFILL and ctx.info.block_hashes is None:
            # once per request: a prefill retry reuses the routing key
            policy.prepare(ctx.info, "chat" if ctx.chat else "completions", ctx.body)
        ep = policy.pick(cands, ctx.info, exclude)
        if ep is not None:
            policy.routed(ep, ctx.info)
        return ep

    # -- legs -------------------------------------------------------------------------
    async def send(self, ep: EndpointState, ctx: Ctx, body: bytes, first_byte_timeout_s: float,
                   idle_timeout_s: float) -> UpstreamResponse:
        return await ep.pool.request(b"POST", ctx.path, body, ctx.fwd,
                                     first_byte_timeout_s=first_byte_timeout_s,
                                     idle_timeout_s=idle_timeout_s)

    async def read_whole(self, up: UpstreamResponse) -> bytes:
        parts: list[bytes] = []
        async with up:
            while True:
                chunk = await up.next_chunk()
                if chunk is None:
                    return b"".join(parts)
                parts.append(chunk)

    def transport_failed(self, leg: str, ep: EndpointState, e: BaseException) -> str:
        """Count a leg's transport failure on ``ep`` (metric, breaker) and return the reason
        to retry elsewhere: a refused, reset or closed connection, or a connect timeout.
        Raises :class:`LegFailed` (504) for a timeout once connected (the engine may be
        working on it: not retried)."""
        if isinstance(e, UpstreamTimeout):
            metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout").inc()
            ep.failed()
            if e.phase != "connect":
                raise LegFailed(504, f"{leg} instance {ep.instance_id} did not answer within "
                                     f"{e.timeout_s:g} s") from None
            return f"{ep.url}: {e}"
        metrics.UPSTREAM_ERRORS.labels(ep.url, "closed").inc()
        ep.failed(certain=isinstance(e, ConnectionRefusedError))
        return f"{ep.url}: {type(e).__name__}: {e}"

    async def prefill(self, ctx: Ctx, body: bytes, exclude: set[EndpointState],
                      ep: EndpointState | None = None) -> tuple[EndpointState, dict[str, Any]]:
        """Run a non-streamed prefill leg to its end, retrying transport failures and
        retryable statuses on other prefill instances (bounded). Returns the endpoint and
        its JSON answer; raises :class:`LegFailed` (the engine's 4xx passes through)."""
        last = "no prefill instance"
        t = time.perf_counter()
        for attempt in range(self.max_attempts):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * (2 ** (attempt - 1)), self.backoff_max_s))
            if ep is None or attempt:
                ep = self.pick(Role.PREFILL, ctx, exclude)
            if ep is None:
                break
            exclude.add(ep)
            tokens = ctx.info.prompt_tokens
            ep.acquire(tokens, tokens, 0)
            try:
                try:
                    up = await self.send(ep, ctx, body, self.prefill_timeout_s,
                                         self.prefill_timeout_s)
                    status = up.status
                    data = await self.read_whole(up)
                except (UpstreamTimeout, UpstreamClosed, OSError) as e:
                    last = self.transport_failed("prefill", ep, e)
                    continue
            finally:
                ep.release(tokens, tokens, 0)
            if status >= 500 and status != 503:
                ep.failed()
            else:
                ep.succeeded()
            if status >= 400:
                if status in self.retry_statuses:
                    last = f"{ep.url}: answered {status}"
                    continue
                if status >= 500:
                    last = f"{ep.url}: answered {status}: {data[:200].decode('utf-8', 'replace')}"
                    continue
                raise LegFailed(status, f"prefill answered {status}", _as_error(status, data))
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                raise LegFailed(502, f"prefill instance {ep.instance_id} answered a body that "
                                     f"is not a JSON object")
            PD_PREFILL.labels(self.name).observe(time.perf_counter() - t)
            return ep, obj
        raise LegFailed(502, f"the prefill leg failed: {last}")

    async def open_decode(self, ctx: Ctx, body: bytes, exclude: set[EndpointState],
                          retry: bool = True) -> tuple[EndpointState, UpstreamResponse]:
        """Send the decode leg; returns once its status and headers arrived, the endpoint
        still acquired (the caller releases it with :meth:`release_decode`). A refused or
        reset connection before any answer is retried on another decode (``retry``)."""
        last = "no decode instance"
        exclude.update(ctx.avoid)   # a continuation avoids the decode that broke
        for attempt in range(self.max_attempts if retry else 1):
            if attempt:
                await asyncio.sleep(min(self.backoff_s * (2 ** (attempt - 1)), self.backoff_max_s))
            ep = self.pick(Role.DECODE, ctx, exclude)
            if ep is None:
                break
            exclude.add(ep)
            amount = ctx.max_tokens + ctx.info.prompt_tokens
            ctx.decode_load[ep] = amount
            ep.acquire(amount, 0, ctx.max_tokens)
            ok = False
            try:
                up = await self.send(ep, ctx, body, self.first_byte_timeout_s,
                                     self.keepalive_s or self.idle_timeout_s)
                ok = True
                return ep, up
            except (UpstreamTimeout, UpstreamClosed, OSError) as e:
                last = self.transport_failed("decode", ep, e)
                continue
            finally:
                if not ok:
                    self.release_decode(ctx, ep)
        raise LegFailed(502, f"the decode leg failed: {last}")

    def release_decode(self, ctx: Ctx, ep: EndpointState) -> None:
        ep.release(ctx.decode_load.pop(ep), 0, ctx.max_tokens)

    async def answer_decode(self, ctx: Ctx, ep: EndpointState, up: UpstreamResponse,
                            p_answer: dict[str, Any] | None, t_decode: float) -> None:
        """Relay the decode's answer to the client: SSE streamed event by event (usage
        merged with the prefill's), anything else whole (usage and prompt_logprobs merged)."""
        resp, route = ctx.resp, ctx.route
        status = up.status
        ctype = up.header(b"content-type", _JSON) or _JSON
        p_usage = p_answer.get("usage") if p_answer else None
        rec = ctx.rec
        if status < 300 and ctype.startswith(b"text/event-stream"):
            if not resp.started:
                resp.start(200, content_type=ctype, headers=ctx.rid_header)
            # the coordinator's SSE pump: cut at event boundaries, keep-alive comments,
            # idle timeout; route.ttft observed there, the PD TTFT here
            feed: Any = UsageMerger(p_usage) if rec is None else _Chain(rec, UsageMerger(p_usage))
            first = not ctx.wrote
            try:
                err, wrote = await self.coord._pump(
                    up, resp, feed, route, ctx.t0, first,
                    (lambda: PD_TTFT.labels(self.name).observe(time.perf_counter() - ctx.t0))
                    if first else None)
            finally:
                up.close()
            ctx.wrote = ctx.wrote or wrote
            if rec is not None and not isinstance(err, UpstreamTimeout) \
                    and self.after_leg(ctx, ep, err):
                PD_DECODE.labels(self.name).observe(time.perf_counter() - t_decode)
                if ctx.cont is None:
                    route.e2e.observe(time.perf_counter() - ctx.t0)
                return
            if err is None:
                ep.succeeded()
                resp.end()
                route.count(200)
                PD_REQUESTS.labels(self.name, "ok").inc()
            else:
                if resp.client_gone:
                    raise asyncio.CancelledError()
                ep.failed()
                timeout = isinstance(err, UpstreamTimeout)
                st = 504 if timeout else 502
                metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout" if timeout else "closed").inc()
                msg = (f"decode instance {ep.instance_id} stopped sending for longer than the "
                       f"idle timeout ({self.idle_timeout_s:g} s)" if timeout else
                       f"decode instance {ep.instance_id} broke the stream: {err}")
                logger.warning("PD stream from %s ended early: %s", ep.url, msg)
                resp.end(sse_error_event(st, msg))
                route.count(st)
                PD_REQUESTS.labels(self.name, "decode_failed").inc()
            PD_DECODE.labels(self.name).observe(time.perf_counter() - t_decode)
            route.e2e.observe(time.perf_counter() - ctx.t0)
            return
        if resp.started:
            # a continuation's decode answered with an error status: the stream is open
            if status >= 500 and status != 503:
                ep.failed()
            try:
                data = await self.read_whole(up)
            except (UpstreamTimeout, UpstreamClosed, OSError):
                data = b""
            PD_REQUESTS.labels(self.name, "decode_failed").inc()
            raise LegFailed(status if status >= 400 else 502,
                            f"the stream could not be continued: decode instance "
                            f"{ep.instance_id} answered {status}: "
                            f"{data[:512].decode('utf-8', 'replace')}")
        try:
            data = await self.read_whole(up)
        except UpstreamTimeout as e:
            ep.failed()
            raise LegFailed(504, f"decode instance {ep.instance_id} stopped answering for "
                                 f"{e.timeout_s:g} s") from None
        except (UpstreamClosed, OSError) as e:
            ep.failed()
            raise LegFailed(502, f"decode instance {ep.instance_id} closed the connection: "
                                 f"{e}") from None
        if status >= 500 and status != 503:
            ep.failed()
        else:
            ep.succeeded()
        if status >= 400:
            PD_REQUESTS.labels(self.name, "decode_failed").inc()
            self.fail_body(ctx, status, _as_error(status, data))
            return
        if p_answer is not None and status == 200:
            data = merge_answer(data, p_answer)
        route.count(status)
        resp.send(status, data, content_type=ctype, headers=ctx.rid_header)
        now = time.perf_counter()
        PD_TTFT.labels(self.name).observe(now - ctx.t0)
        PD_DECODE.labels(self.name).observe(now - t_decode)
        route.ttft.observe(now - ctx.t0)
        route.e2e.observe(now - ctx.t0)
        PD_REQUESTS.labels(self.name, "ok").inc()


    def after_leg(self, ctx: Ctx, ep: EndpointState, err: BaseException | None) -> bool:
        """A recoverable decode stream's leg ended (not by an idle timeout): end the answer
        or set ``ctx.cont`` to the next leg (StreamRecovery's continuation, sent by
        :meth:`handle` as a fresh PD request: new prefill, new decode). ``False``: not
        handled here (a stream that broke while the client is still there always is)."""
        rec = ctx.rec
        assert rec is not None
        resp, route = ctx.resp, ctx.route
        end = rec.leg_end()
        if end in ("done", "finished"):
            if err is None:
                ep.succeeded()
            else:
                ep.failed()
            resp.end(rec.tail_after_finish() if end == "finished" else b"")
            route.count(200)
            PD_REQUESTS.labels(self.name, "ok").inc()
            return True
        if end != "recomputed":
            if err is not None:
                metrics.UPSTREAM_ERRORS.labels(ep.url, "closed").inc()
            ep.failed()
        else:
            ep.succeeded()
        if resp.client_gone:
            raise asyncio.CancelledError()
        max_legs = self.coord.max_continuations
        why = f"{ctx.legs} continuation(s) already" if ctx.legs >= max_legs else rec.why_not()
        if why is not None:
            metrics.FAILOVER_REFUSED.labels("refused").inc()
            msg = (f"decode instance {ep.instance_id} failed mid-stream ({err or end}); "
                   f"not continued: {why}")
            logger.warning("PD stream from %s ended early: %s", ep.url, msg)
            if rec.engine_error is not None and rec.engine_error.startswith(b"data:"):
                resp.end(rec.engine_error + SSE_DONE)
            else:
                resp.end(sse_error_event(502, msg))
            route.count(502)
            PD_REQUESTS.labels(self.name, "decode_failed").inc()
            return True
        rem = rec.remaining()
        if rem is not None and rem <= 0:
            resp.end(rec.length_tail())
            route.count(200)
            PD_REQUESTS.labels(self.name, "ok").inc()
            return True
        path, body = rec.continuation(ctx.path)
        reason = "restart" if not ctx.wrote and end == "broken" else end
        metrics.FAILOVERS.labels(reason).inc()
        ctx.avoid.add(ep)
        ctx.cont = ctx.continued(path, orjson.loads(body))
        logger.info("PD stream from %s continues as a new PD request (%s, leg %d)", ep.url,
                    reason, ctx.cont.legs + 1)
        return True


class _Chain:
    """StreamRecovery, then the PD usage merge, over the same SSE events."""

    __slots__ = ("a", "b")

    def __init__(self, a: StreamRecovery, b: UsageMerger) -> None:
        self.a = a
        self.b = b

    def feed(self, block: bytes) -> bytes:
        out = self.a.feed(block)
        return self.b.feed(out) if out else out


def merge_answer(data: bytes, p_answer: dict[str, Any]) -> bytes:
    """A whole decode answer with the prefill's usage details and prompt logprobs."""
    p_usage = p_answer.get("usage")
    p_logprobs = p_answer.get("prompt_logprobs")
    pc = p_answer.get("choices")
    p_choices: list[Any] = pc if isinstance(pc, list) else []
    has_choice_lp = any(isinstance(c, dict) and c.get("prompt_logprobs") is not None
                        for c in p_choices)
    if not isinstance((p_usage or {}).get("prompt_tokens_details"), dict) \
            and p_logprobs is None and not has_choice_lp:
        return data
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(obj, dict):
        return data
    if "usage" in obj:
        obj["usage"] = merge_usage(obj["usage"], p_usage)
    if p_logprobs is not None:
        obj["prompt_logprobs"] = p_logprobs
    if has_choice_lp and isinstance(obj.get("choices"), list):
        by_index = {c.get("index"): c for c in p_choices if isinstance(c, dict)}
        for c in obj["choices"]:
            if isinstance(c, dict):
                pc = by_index.get(c.get("index")) or by_index.get(0)
                if pc is not None and pc.get("prompt_logprobs") is not None:
                    c["prompt_logprobs"] = pc["prompt_logprobs"]
    return orjson.dumps(obj)


def _as_error(status: int, data: bytes) -> bytes:
    try:
        obj = orjson.loads(data)
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
            return data
    except orjson.JSONDecodeError:
        pass
    return error_body(status, f"engine answered {status}: "
                              f"{data[:512].decode('utf-8', 'replace')}")


__all__ = ["Ctx", "LegFailed", "PdMode", "SSE_DONE", "merge_answer", "merge_usage",
           "prefill_body"]
