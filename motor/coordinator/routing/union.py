"""``union``: the request path of the default mode (one instance computes prefill and decode).

1. :func:`~motor.coordinator.routing.base.parse_request` reads the body once for
   ``model``, ``stream``, ``max_tokens`` and a prompt-size estimate (400 for a body that is
   not a JSON object): in place (:mod:`motor._fast.reqscan`), the dict parsed only when
   something needs it (a policy that reads the prompt, a stream whose failover set-up
   reads more than the length bound, a continuation);
2. candidates = routable endpoints of role ``union`` serving the model (404 if no endpoint
   serves it, 503 if none is routable); the policy picks one (``kv_affinity`` tokenizes
   the request once for its routing key);
3. the client's body bytes go upstream unchanged (extension fields, ``stream_options``,
   token-id prompts all pass as sent; ``return_token_ids`` spliced in for mid-stream
   failover) with the forwarded headers and ``x-request-id``;
4. a connection refused / reset before any answer byte, a connect timeout, the endpoint
   leaving the routable set while the request waits for its first byte, or a retryable
   status is retried on another endpoint (``retries.max_attempts``, doubling backoff;
   :func:`motor.coordinator.recovery.retryable_status`);
5. the answer goes back with the engine's status: SSE streams chunk by chunk as they
   arrive, cut only at event boundaries (:func:`~motor.coordinator.routing.base.relay_sse`);
   a stream whose engine fails is continued on another instance or ended with one SSE error
   event and ``data: [DONE]`` (:func:`motor.coordinator.recovery.after_leg`); other bodies
   whole, an engine error that is not an OpenAI error body wrapped into one, status kept.

Every accepted request ends with exactly one terminal answer; the endpoint's load is a
:class:`~motor.coordinator.endpoints.Lease` released in a ``finally``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from motor.config.schema import Role
from motor.coordinator import metrics
from motor.coordinator.admission import Refused
from motor.coordinator.endpoints import EndpointState, EndpointTable, Lease
from motor.coordinator.observe import Obs
from motor.coordinator.policy import Policy, RequestInfo
from motor.coordinator.recovery import (END, REFUSE, StreamRecovery, Verdict, after_leg,
                                        continuable, inject_token_ids, retryable_status,
                                        with_token_ids)
from motor.coordinator.routing.base import (ANSWERED, JSON, UNION, Headers, Parsed, RequestPath,
                                            Route, Settings,
                                            SseFeed,
                                            engine_error_body, failure_text, note_status,
                                            parse_request, read_whole, relay_sse, settle_leg,
                                            transport_failed)
from motor.http.client import UpstreamClosed, UpstreamEvicted, UpstreamResponse, UpstreamTimeout
from motor.http.server import Request, Response
from motor.protocol.openai import sse_error_event

logger = logging.getLogger(__name__)


class Load:
    """What a request adds to an endpoint's load counters while it runs there (tokens:
    prompt estimate + max_tokens; decode_tokens: max_tokens), and the role of the endpoints
    that serve it (retries and restarts pick among them)."""

    __slots__ = ("tokens", "decode_tokens", "role")

    def __init__(self, tokens: int, decode_tokens: int, role: Role = UNION) -> None:
        self.tokens = tokens
        self.decode_tokens = decode_tokens
        self.role = role


class Fail:
    """No engine answer to pass on: motor answers ``status`` with an OpenAI error
    (``retry_after_s``: with a ``Retry-After`` header)."""

    __slots__ = ("status", "message", "retry_after_s")

    def __init__(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s

    def headers(self, base: Headers) -> Headers:
        if self.retry_after_s is None:
            return base
        return base + ((b"retry-after", b"%d" % self.retry_after_s),)


class Whole:
    """An engine's complete (non-streamed) answer."""

    __slots__ = ("status", "ctype", "data", "headers", "ep")

    def __init__(self, status: int, ctype: bytes, data: bytes, headers: Headers,
                 ep: EndpointState) -> None:
        self.status = status
        self.ctype = ctype
        self.data = data
        self.headers = headers
        self.ep = ep


class Opened:
    """An engine's streamed answer, open; its lease is held until the stream's leg ends."""

    __slots__ = ("ep", "up", "ctype", "lease", "span")

    def __init__(self, ep: EndpointState, up: UpstreamResponse, ctype: bytes,
                 lease: Lease, span: Any = None) -> None:
        self.ep = ep
        self.up = up
        self.ctype = ctype
        self.lease = lease
        #: the leg's span while the stream is relayed (tracing)
        self.span = span


class Retry:
    """One attempt failed before anything reached the client: try another endpoint.
    ``busy``: the endpoint had no room for it (no free pooled connection within
    ``pool_wait_s``, or at its cap): when every attempt ends so, the answer is 503."""

    __slots__ = ("error", "answer", "busy")

    def __init__(self, error: str, answer: Whole | None = None, busy: bool = False) -> None:
        self.error = error
        self.answer = answer
        self.busy = busy


def prepare_traced(policy: Policy, obs: Obs, info: RequestInfo, route: str,
                   body: dict[str, object]) -> None:
    """``policy.prepare`` (the tokenization of the routing key) in a ``motor.tokenize``
    span."""
    span = obs.start("motor.tokenize", {"motor.policy": policy.name})
    try:
        policy.prepare(info, route, body)
    finally:
        _end_tokenize(obs, span, info)


async def prepare_traced_off_loop(policy: Policy, obs: Obs, info: RequestInfo, route: str,
                                  body: dict[str, object]) -> None:
    """:func:`prepare_traced` with a long text encoded off the event loop."""
    span = obs.start("motor.tokenize", {"motor.policy": policy.name})
    try:
        later = policy.prepare(info, route, body, off_loop=True)
        if later is not None:
            await later
    finally:
        _end_tokenize(obs, span, info)


def _end_tokenize(obs: Obs, span: Any, info: RequestInfo) -> None:
    h = info.block_hashes
    obs.end(span, {"motor.prompt_tokens": info.prompt_tokens,
                   "motor.tokenized": h is not None,
                   "motor.blocks": 0 if h is None else len(h)})


class UnionPath(RequestPath):
    """The ``union`` request path over an endpoint table and a policy."""

    name = "union"

    def __init__(self, settings: Settings, table: EndpointTable, policy: Policy) -> None:
        self.s = settings
        self.table = table
        self.policy = policy
        #: ``policy.routed`` when the policy has one of its own (kv_affinity: the approximate
        #: index, sessions); ``None`` for the base class's no-op: no call per attempt
        self._routed: Callable[[EndpointState, RequestInfo], None] | None = \
            policy.routed if type(policy).routed is not Policy.routed else None
        table.configure_caps(settings.max_inflight_per_instance, settings.shed_waiting,
                             settings.slot_wait_s, settings.engine_max_age_s)

    def handle(self, route: Route, req: Request, resp: Response,
               p: Parsed | None = None) -> Awaitable[object]:
        """Answer the request from a union instance. ``p``: the request as already parsed
        (a PD mode falling back to union passes its own). Returns what to await: the
        :meth:`serve` coroutine itself (no coroutine layer of its own on the hot path)."""
        if p is None:
            p = parse_request(self.s, route, req, resp)
            if p is None:
                return ANSWERED
        candidates = self.table.candidates(UNION, p.model)
        if not candidates:
            self.no_candidates(route, resp, p)
            return ANSWERED
        return self.serve(route, p, resp, candidates)

    def no_candidates(self, route: Route, resp: Response, p: Parsed) -> None:
        """404 when no endpoint serves ``p.model``, else 503 (none routable now)."""
        if p.model is not None and not self.table.has_model(p.model):
            route.fail(resp, 404, f"The model `{p.model}` does not exist.", p.rid_header,
                       param="model")
        else:
            route.fail(resp, 503, "no ready instance can serve this request"
                       + (f" (model {p.model})" if p.model else ""), p.rid_header)

    async def serve(self, route: Route, p: Parsed, resp: Response,
                    candidates: list[EndpointState], retry_also: frozenset[int] = frozenset(),
                    tap: Callable[[EndpointState], SseFeed] | None = None) -> Fail | Whole | None:
        """Answer ``p`` from ``candidates`` (their first attempt; retries rebuild the list of
        their role).
        ``retry_also``: statuses this request retries elsewhere besides the configured ones;
        ``tap(ep)``: a feed over a stream's events from ``ep`` (not continuable streams).
        Returns the answer sent when it was not a stream (``Whole.ep`` says whose)."""
        info = p.info()
        obs = p.obs
        if self.policy.uses_prefix and route.name in ("chat", "completions"):
            # kv_affinity: routing key = the tokenized request (only what the engine prefills
            # and caches: not /tokenize, /v1/responses and the like)
            if obs is None:
                later = self.policy.prepare(info, route.name, p.body, off_loop=True)
                if later is not None:
                    await later
            else:
                await prepare_traced_off_loop(self.policy, obs, info, route.name, p.body)
        if p.stream:
            rec, with_ids, why_not = self._recovery(route, p)
        else:
            rec, with_ids, why_not = None, p.raw, "not a stream"
        load = Load(info.prompt_tokens + p.max_tokens, p.max_tokens, candidates[0].role)
        try:
            res = await self.dispatch(route.path, p.raw, with_ids, p.fwd, info, load, set(),
                                      p.stream, candidates, retry_also, obs)
        except asyncio.CancelledError:
            metrics.CLIENT_DISCONNECTS.labels("before_answer").inc()
            raise
        if isinstance(res, Fail):
            route.fail(resp, res.status, res.message, res.headers(p.rid_header))
            return res
        if isinstance(res, Whole):
            self._answer_whole(route, p, resp, res)
            return res
        await self._stream(route, p, resp, res, rec, info, load, why_not, tap)
        return None

    def _recovery(self, route: Route, p: Parsed
                  ) -> tuple[StreamRecovery | None, bytes, str]:
        """A stream's (mid-stream recovery or ``None``, the body with ``return_token_ids``,
        why not continuable when ``None``)."""
        if not (self.s.failover_on and route.name in ("chat", "completions")):
            return None, p.raw, "failover is off"
        if p.plain:     # the scan saw nothing continuable() refuses: no parse of the body
            return (StreamRecovery(route.chat, None, parsed=p, bound=p.bound),
                    with_token_ids(p.raw), "")
        why = continuable(route.chat, p.body)
        if why is not None:
            logger.debug("request %s: no mid-stream failover (%s)", p.rid.decode("latin-1"), why)
            return None, p.raw, why
        return StreamRecovery(route.chat, p.body), inject_token_ids(p.raw, p.body), ""

    def _answer_whole(self, route: Route, p: Parsed, resp: Response, res: Whole) -> None:
        data, ctype = res.data, res.ctype
        if res.status >= 400:
            wrapped = engine_error_body(res.status, data)
            if wrapped is not data:
                data, ctype = wrapped, JSON
        route.count(res.status)
        resp.send(res.status, data, content_type=ctype, headers=p.rid_header + res.headers)
        elapsed = time.perf_counter() - p.t0
        route.ttft.observe(elapsed)
        route.e2e.observe(elapsed)
        res.ep.timing.ttft.observe(elapsed)

    # -- dispatch: pick, send, retry before the first byte ------------------------------
    async def dispatch(self, path: bytes, raw: bytes, with_ids: bytes,
                       fwd: list[tuple[bytes, bytes]], info: RequestInfo, load: Load,
                       tried: set[EndpointState], stream: bool,
                       first: list[EndpointState] | None = None,
                       retry_also: frozenset[int] = frozenset(), obs: Obs | None = None,
                       leg: str = "union") -> Fail | Whole | Opened:
        """Send the request to an endpoint, retrying on another one (bounded, with backoff)
        while nothing reached the client. A streamed answer comes back open
        (:class:`Opened`); any other answer is read whole. ``with_ids``: the body with
        ``return_token_ids`` (``raw`` itself when not needed), sent to endpoints
        :meth:`Settings.ids_for` accepts. ``first``: the candidate list for the first
        attempt when the caller just built it (no await in between). ``obs``: the request's
        observation record (tracing, access log); ``leg``: the legs' span name."""
        s = self.s
        last_error = "no attempt made"
        last_answer: Whole | None = None
        n_tried = 0
        busy = True     # every attempt so far found its engine without room
        for attempt in range(s.max_attempts):
            if attempt:
                await s.pause(attempt)
            candidates = first if attempt == 0 and first is not None else \
                self.table.candidates(load.role, info.model)
            if not candidates:
                break
            if self.table.gated:
                room = self.table.with_room(candidates) if not self.table.slots.queued \
                    else None
                try:
                    if room is None:
                        metrics.INSTANCE_CAP_WAITS.inc()
                        room = await self._wait_room(load.role, info.model)
                    candidates = room
                except Refused as e:
                    metrics.INSTANCE_CAP_REFUSALS.inc()
                    return Fail(503, f"every instance that can serve the request is at its "
                                     f"limit of requests in flight ({e.reason}, waited "
                                     f"{self.table.slots.timeout_s:g} s); please retry after "
                                     f"{e.retry_after_s} s", math.ceil(e.retry_after_s))
            if obs is None:
                ep = self.policy.pick(candidates, info, tried)
            else:
                rs = obs.start("motor.route")
                ep = self.policy.pick(candidates, info, tried)
                obs.decision(rs, self.policy.name, load.role.value, len(candidates), ep, info)
            if ep is None:
                break
            tried.add(ep)
            n_tried += 1
            body = with_ids if with_ids is not raw and s.ids_for(ep) else raw
            if obs is None:
                res = await self._attempt(ep, path, body, fwd, info, load, stream, retry_also)
            else:
                res = await self._traced_attempt(obs, leg, attempt, ep, path, body, fwd, info,
                                                 load, stream, retry_also)
            if not isinstance(res, Retry):
                return res
            if obs is not None:
                obs.event("motor.retry", {"motor.attempt": attempt, "motor.endpoint": ep.url,
                                          "motor.reason": res.error})
            last_error = res.error
            busy = busy and res.busy
            if res.answer is not None:
                last_answer = res.answer
        if last_answer is not None:
            return last_answer
        if n_tried and busy:        # every engine tried was full, none failed: overloaded
            return Fail(503, f"every engine tried was busy after {n_tried} attempt(s): "
                             f"{last_error}; please retry", 1)
        return Fail(502 if n_tried else 503,
                    f"no engine could take the request after {n_tried} attempt(s): {last_error}")

    def _wait_room(self, role: Role, model: str | None) -> Awaitable[list[EndpointState]]:
        """Every candidate is at its cap (or others wait already): wait, in arrival order,
        for candidates with room (:meth:`EndpointTable.with_room`, re-read as endpoints come
        and go and requests end). The caller picks and leases before it awaits anything
        else. Raises :class:`Refused` after ``admission.queue_timeout_s``."""
        table = self.table
        return table.slots.wait(lambda: table.with_room(table.candidates(role, model)))

    async def _traced_attempt(self, obs: Obs, leg: str, attempt: int, ep: EndpointState,
                              path: bytes, body: bytes, fwd: list[tuple[bytes, bytes]],
                              info: RequestInfo, load: Load, stream: bool,
                              retry_also: frozenset[int]) -> Fail | Whole | Opened | Retry:
        """:meth:`_attempt` in its leg span (the engine gets the leg's ``traceparent``); a
        stream's span goes on with it (``Opened.span``)."""
        span, fwd = obs.leg(leg, ep, fwd, attempt)
        try:
            res = await self._attempt(ep, path, body, fwd, info, load, stream, retry_also)
        except BaseException as e:
            obs.end(span, error=type(e).__name__)
            raise
        if isinstance(res, Opened):
            if span is not None:
                span.set_attribute("http.response.status_code", res.up.status)
            res.span = span
        elif isinstance(res, Whole):
            obs.end(span, {"http.response.status_code": res.status},
                    str(res.status) if res.status >= 500 else None)
        elif isinstance(res, Retry):
            st = res.answer.status if res.answer is not None else None
            obs.end(span, {"http.response.status_code": st} if st else None, res.error)
        else:
            obs.end(span, None, f"{res.status}: {res.message}")
        return res

    async def _attempt(self, ep: EndpointState, path: bytes, body: bytes,
                       fwd: list[tuple[bytes, bytes]], info: RequestInfo, load: Load,
                       stream: bool, retry_also: frozenset[int]) -> Fail | Whole | Opened | Retry:
        s = self.s
        lease = ep.lease(load.tokens, info.prefill_tokens, load.decode_tokens)
        if ep.max_inflight and ep.over_cap():   # another worker took its last slot just now
            lease.release()
            return Retry(f"{ep.url} at its limit of {ep.max_inflight} requests in flight",
                         busy=True)
        if self._routed is not None:
            self._routed(ep, info)
        if self.policy.learns_ttft:
            lease.watch(self.policy.watch(ep, info))
        handed = False
        try:
            try:
                # owner=ep: evicted (UpstreamEvicted) when ep leaves the routable set before
                # the answer's head (EndpointState.evict_waiting)
                up = await ep.pool.request(b"POST", path, body, fwd,
                                           first_byte_timeout_s=s.first_byte_timeout_s,
                                           idle_timeout_s=s.stream_idle_step_s if stream
                                           else s.idle_timeout_s, owner=ep)
            except UpstreamEvicted as e:
                metrics.RETRIES.labels("endpoint_left").inc()
                return Retry(f"{ep.url}: {e.reason}")
            except (UpstreamTimeout, UpstreamClosed, OSError) as e:
                reason = transport_failed(ep, e)
                if reason is None:
                    assert isinstance(e, UpstreamTimeout)
                    return Fail(504, f"engine {ep.instance_id} did not answer within "
                                     f"{e.timeout_s:g} s")
                metrics.RETRIES.labels(reason).inc()
                logger.debug("attempt on %s failed: %s", ep.url, e)
                return Retry(failure_text(ep, e), busy=reason == "pool_wait")
            status = up.status
            note_status(ep, status)
            ctype = up.header(b"content-type", JSON) or JSON
            if status < 300 and ctype.startswith(b"text/event-stream"):
                handed = True   # the stream holds the lease now
                return Opened(ep, up, ctype, lease)
            try:
                data = up.read_now()    # came whole with its head: no wait
                if data is None:
                    async with up:
                        # opened with the idle timeout as its step (not a stream), silence
                        # is the compiled read's own timeout: no step counting needed
                        data = await (read_whole(up, s.idle_timeout_s) if stream
                                      else up.read())
                if status < 400 and lease.watcher is not None:
                    lease.answered()
            except UpstreamTimeout as e:
                metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout").inc()
                return Fail(504, f"engine {ep.instance_id} stopped answering for "
                                 f"{e.timeout_s:g} s")
            except (UpstreamClosed, OSError) as e:
                # nothing reached the client yet: the answer can still come from elsewhere
                metrics.UPSTREAM_ERRORS.labels(ep.url, "closed").inc()
                ep.failed()
                metrics.RETRIES.labels("closed").inc()
                return Retry(failure_text(ep, e))
        finally:
            if not handed:
                lease.release()
        # a whole answer: for the client, or a retryable status to try elsewhere
        retry_after = up.header(b"retry-after")
        extra = ((b"retry-after", retry_after),) if retry_after is not None else ()
        answer = Whole(status, ctype, data, extra, ep)
        if status >= 400 and (status in retry_also
                              or retryable_status(status, up.headers, s.retry_statuses)):
            metrics.RETRIES.labels(f"status_{status}").inc()
            return Retry(f"{ep.url}: answered {status}", answer)
        return answer

    # -- streams ----------------------------------------------------------------------
    async def _stream(self, route: Route, p: Parsed, resp: Response, leg: Opened,
                      rec: StreamRecovery | None, info: RequestInfo, load: Load,
                      why_not: str, tap: Callable[[EndpointState], SseFeed] | None = None
                      ) -> None:
        """Relay a streamed answer, continuing it on another instance when its engine fails
        (``rec`` set) or restarting it while no event reached the client; ends exactly once.
        The answer is corked (``Response.cork``): its head goes out
        with the first events, each read's events in one write, the last ones with the end
        (the relay flushes before it waits, :meth:`_next_leg` before it dispatches)."""
        resp.cork()
        resp.start(200, content_type=leg.ctype, headers=p.rid_header)
        status = 200
        wrote_any = False
        legs = 0
        cur: Opened | None = leg
        try:
            while cur is not None:
                leg = cur
                feed = rec if rec is not None or tap is None else tap(leg.ep)
                err, wrote = await relay_sse(leg.up, resp, feed, route, p.t0, not wrote_any,
                                             self.s.idle_timeout_s,
                                             on_prefill_done=leg.lease.prefill_done,
                                             timing=leg.ep.timing)
                wrote_any = wrote_any or wrote
                leg.up.close()
                if leg.span is not None:
                    assert p.obs is not None
                    p.obs.end(leg.span, None, None if err is None else type(err).__name__)
                v = self._leg_ended(route, p, resp, leg, err, rec, legs, wrote_any, why_not)
                if isinstance(v, int):
                    status, cur = v, None
                else:
                    status, cur = await self._next_leg(p, resp, leg, v, info, load, legs)
                legs += 1
        except (asyncio.CancelledError, ConnectionError):
            metrics.CLIENT_DISCONNECTS.labels("streaming").inc()
            raise
        finally:
            leg.up.close()
            leg.lease.release()
        route.count(status)
        route.e2e.observe(time.perf_counter() - p.t0)

    def _leg_ended(self, route: Route, p: Parsed, resp: Response, leg: Opened,
                   err: BaseException | None, rec: StreamRecovery | None, legs: int,
                   wrote_any: bool, why_not: str) -> int | Verdict:
        """After a leg: end the answer (returns its status) or say how to continue."""
        ep = leg.ep
        if err is None and (rec is None or rec.done):
            # the engine ended the stream itself ([DONE] relayed): after_leg's END "done"
            # verdict, without building it (every stream that ends well comes here)
            settle_leg(ep, None, True)
            resp.end(b"")
            return 200
        if isinstance(err, UpstreamTimeout):
            metrics.UPSTREAM_ERRORS.labels(ep.url, "timeout").inc()
            ep.failed()
            if resp.client_gone:
                raise asyncio.CancelledError()
            resp.end(sse_error_event(504, f"engine {ep.instance_id} stopped sending for "
                                          f"longer than the idle timeout "
                                          f"({self.s.idle_timeout_s:g} s)"))
            return 504
        v = after_leg(rec, err, legs=legs, max_continuations=self.s.max_continuations,
                      wrote_any=wrote_any, path=route.path, raw=p.raw, why_not=why_not,
                      max_model_len=partial(self.table.context_length, p.model))
        settle_leg(ep, err, v.engine_ok)
        if v.action == END and err is None:
            resp.end(v.tail or b"")
            return 200
        if resp.client_gone:
            raise asyncio.CancelledError()
        if v.action == END:     # broke after its finishing chunk: motor ends it
            resp.end(v.tail or b"")
            return 200
        if v.action == REFUSE:
            client_error = v.status < 500
            metrics.FAILOVER_REFUSED.labels("client_error" if client_error else "refused").inc()
            msg = f"engine {ep.instance_id} failed mid-stream ({err or v.reason}); " \
                  f"not continued: {v.why}"
            logger.log(logging.INFO if client_error else logging.WARNING,
                       "stream from %s ended early: %s", ep.url, msg)
            resp.end(v.tail if v.tail is not None else sse_error_event(v.status, msg))
            return v.status
        return v

    async def _next_leg(self, p: Parsed, resp: Response, leg: Opened, v: Verdict,
                        info: RequestInfo, load: Load, legs: int) -> tuple[int, Opened | None]:
        """Open the next leg of a broken stream (``v``: CONTINUE) on another endpoint; ends
        the answer with an error event when none takes it."""
        ep = leg.ep
        resp.flush()        # what the broken leg relayed goes out before the wait
        leg.lease.release()
        metrics.FAILOVERS.labels(v.reason).inc()
        logger.info("stream from %s continues elsewhere (%s, leg %d)", ep.url, v.reason,
                    legs + 2)
        obs = p.obs
        if obs is not None:
            obs.event("motor.failover", {"motor.reason": v.reason, "motor.endpoint": ep.url,
                                         "motor.leg.index": legs + 1})
        nxt = await self.dispatch(v.path, v.body, v.body, p.fwd, info, load, {ep}, True,
                                  obs=obs, leg="continuation")
        if isinstance(nxt, Opened):
            return 200, nxt
        st = nxt.status if nxt.status >= 400 else 502
        msg = nxt.message if isinstance(nxt, Fail) else nxt.data[:512].decode("utf-8", "replace")
        resp.end(sse_error_event(st, f"the stream could not be continued: {msg}"))
        return st, None


__all__ = ["Fail", "Load", "Opened", "UnionPath", "Whole", "prepare_traced",
           "prepare_traced_off_loop"]
