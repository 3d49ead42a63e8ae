"""What the three PD modes share: the PD request path's frame, pair selection and legs.

A PD mode is a :class:`PdPath` subclass with one coroutine, :meth:`PdPath.run`, called by
:meth:`PdPath.handle` for ``/v1/chat/completions`` and ``/v1/completions``. Every mode

* picks the prefill instance with the prefill policy and the decode instance with the
  decode policy (``coordinator.pd``); with no decode (or no prefill) instance ready it
  falls back to a ``union`` instance through the union path it holds
  (:class:`~motor.coordinator.routing.union.UnionPath`), else 503;
* sends both legs the same ``X-Request-Id`` (made up when the client sent none);
* holds each leg's load on its endpoint exactly while that leg runs (an
  :class:`~motor.coordinator.endpoints.Lease`), closes each leg's upstream connection when
  the request ends for any reason (client gone, timeout, the other leg failed), and answers
  exactly once;
* streams the decode answer through :func:`~motor.coordinator.routing.base.relay_sse` (cut
  at event boundaries, never buffered, one SSE error event + ``[DONE]`` when the decode
  breaks), continuing a broken decode stream as a fresh PD request when
  :func:`motor.coordinator.recovery.after_leg` says so.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from functools import partial
from typing import Any

import orjson

from motor.config.schema import CoordinatorConfig, PolicyName, Role
from motor.coordinator import metrics
from motor.coordinator.admission import Refused
from motor.coordinator.endpoints import EndpointState, EndpointTable, Lease
from motor.coordinator.kv.router import KvRouter
from motor.coordinator.metrics import PD_DECODE, PD_PREFILL, PD_REQUESTS, PD_ROUTE, PD_TTFT
from motor.coordinator.observe import Obs
from motor.coordinator.policy import Policy, RequestInfo, make_policy
from motor.coordinator.policy.pairs import Choice, PairChooser
from motor.coordinator.recovery import END, REFUSE, StreamRecovery, after_leg, continuable
from motor.coordinator.routing.base import (DECODE, JSON, PREFILL, UNION, Parsed, RequestPath,
                                            Route, Settings,
                                            engine_error_body, estimate_prompt_tokens,
                                            failure_text, note_status, parse_request,
                                            read_whole, relay_sse, settle_leg,
                                            transport_failed)
from motor.coordinator.routing.union import UnionPath, prepare_traced, prepare_traced_off_loop
from motor.http.client import UpstreamClosed, UpstreamEvicted, UpstreamResponse, UpstreamTimeout
from motor.http.server import Request, Response
from motor.protocol.openai import error_body, max_tokens_of, sse_error_event

logger = logging.getLogger(__name__)


class LegFailed(Exception):
    """A leg could not produce an answer; the client gets ``status`` with ``body`` (an
    engine's own error body when the engine refused, else an OpenAI error of ``message``)."""

    def __init__(self, status: int, message: str, body: bytes | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.body = body if body is not None else error_body(status, message)
        #: seconds for a ``Retry-After`` header (every instance at its cap), None: none
        self.retry_after_s = retry_after_s
        #: ``pd_bootstrap``: another pair may serve the request (the leg's instance refused
        #: or reset the connection, or answered a retryable status), so the pair is chosen
        #: again while nothing reached the client and attempts remain
        self.repairable = False
        #: a repairable failure: the instance that failed (the next pair avoids it), the
        #: ``motor_coordinator_retries_total`` reason of the next pair, and the
        #: ``motor_coordinator_pd_requests_total`` outcome counted if no pair serves it
        self.ep: EndpointState | None = None
        self.retry_reason = "endpoint_left"
        self.outcome: str | None = None


class LegEvicted(LegFailed):
    """A leg's instance left the routable set before its answer's head in a mode whose legs
    cannot move alone (``pd_bootstrap``: the pair shares P's bootstrap room): the pair may
    be chosen again while nothing reached the client, else the client gets this 502."""

    def __init__(self, leg: str, ep: EndpointState, reason: str) -> None:
        super().__init__(502, f"{leg} instance {ep.instance_id} left: {reason}")
        self.leg = leg
        self.repairable = True


class Ctx:
    """One PD request (or one continuation of a broken decode stream): the body, headers
    to forward, ids, timing, and the stream's recovery state shared by its legs."""

    __slots__ = ("route", "path", "chat", "resp", "body", "model", "fwd", "rid", "rid_header",
                 "stream", "info", "max_tokens", "t0", "rec", "cont", "avoid", "legs", "wrote",
                 "obs", "plan", "d_lease", "d_choice")

    def __init__(self, route: Route, resp: Response, p: Parsed) -> None:
        self.route = route
        self.path: bytes = route.path
        self.chat = route.chat
        self.resp = resp
        self.body = p.body
        self.model = p.model
        self.fwd = p.fwd
        self.rid = p.rid
        self.rid_header = p.rid_header
        self.stream = p.stream
        self.max_tokens = p.max_tokens
        self.info = p.info()
        self.t0 = p.t0
        # mid-stream failover (docs/faults.md): the stream's StreamRecovery, the next leg's
        # context once the decode broke, decode endpoints not to use again, legs so far,
        # whether an event reached the client
        self.rec: StreamRecovery | None = None
        self.cont: Ctx | None = None
        self.avoid: set[EndpointState] = set()
        self.legs = 0
        self.wrote = False
        #: the request's observation record (tracing, access log) or None
        self.obs: Obs | None = p.obs
        #: the joint choice (``pd.joint.enabled``) of this leg, None before / without it
        self.plan: Choice | None = None
        #: the decode leg's lease while it runs (its prefill ends at the first event)
        self.d_lease: Lease | None = None
        #: the joint choice of the decode leg when its instance was chosen again
        #: (:meth:`PdPath._pick_decode`), None otherwise
        self.d_choice: Choice | None = None

    def continued(self, path: bytes, body: dict[str, Any]) -> Ctx:
        """The context of the next leg of a broken stream: a fresh PD request for ``path``
        with ``body`` (StreamRecovery's continuation), same client, ids, response and
        recovery state."""
        c = Ctx.__new__(Ctx)
        for k in Ctx.__slots__:
            setattr(c, k, getattr(self, k))
        c.path = path
        c.chat = path == b"/v1/chat/completions"
        c.body = body
        c.stream = True
        c.max_tokens = max_tokens_of(body, c.chat)
        c.info = RequestInfo(self.model, estimate_prompt_tokens(body, len(orjson.dumps(body))),
                             c.max_tokens)
        c.cont = None
        c.plan = None
        c.d_lease = None
        c.d_choice = None
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
    details = p_usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        d_usage = dict(d_usage)
        d_usage["prompt_tokens_details"] = details
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


def failed_outcome(leg: str, status: int) -> str:
    """The ``pd_requests_total`` outcome of a leg that answered ``status`` >= 400 before
    anything reached the client: ``client_error`` for a 4xx other than 429 (the engine
    refused the request itself, e.g. a prompt longer than the context: another engine would
    too; as a broken stream's in-band 4xx, :func:`motor.coordinator.recovery.after_leg`),
    else ``<leg>_failed``."""
    return "client_error" if 400 <= status < 500 and status != 429 else f"{leg}_failed"


def own_policy(name: PolicyName, cfg: CoordinatorConfig) -> Policy:
    """A leg's policy other than the coordinator's. ``kv_affinity`` gets its own router
    with ``coordinator.kv`` (approximate index only: the KV-event feed serves the
    coordinator's policy, so set ``coordinator.policy: kv_affinity`` to route on events)."""
    if name is PolicyName.KV_AFFINITY:
        return make_policy(name.value, router=KvRouter(cfg.kv))
    return make_policy(name.value)


class PdPath(RequestPath):
    """Base of the PD request paths; subclasses implement :meth:`run`.

    ``prefill_policy`` / ``decode_policy``: the coordinator's policy unless
    ``coordinator.pd`` names another; ``prefill_timeout_s``: ``pd.prefill_timeout_s`` or
    the first-token timeout; ``union``: the path a request falls back to."""

    def __init__(self, cfg: CoordinatorConfig, settings: Settings, table: EndpointTable,
                 policy: Policy, union: UnionPath) -> None:
        self.s = settings
        self.table = table
        self.policy = policy
        self.union = union
        pd = cfg.pd
        pp = pd.prefill_policy
        self.prefill_policy: Policy = policy if pp is None or pp == cfg.policy \
            else own_policy(pp, cfg)
        self.decode_policy: Policy = policy if pd.decode_policy == cfg.policy \
            else own_policy(pd.decode_policy, cfg)
        self.prefill_timeout_s: float = settings.prefill_timeout_s
        #: the joint (prefill, decode) choice, None = one policy after the other
        self.joint: PairChooser | None = None
        if pd.joint.enabled:
            router = getattr(self.prefill_policy, "router", None)
            self.joint = PairChooser(cfg, router if isinstance(router, KvRouter) else None)
            if pd.joint.local_prefill and not self.local_ok:
                logger.info("%s: pd.joint.local_prefill does not apply (the decode "
                            "instances of this mode need a prefill peer)", self.name)

    #: whether a decode instance of this mode can prefill a plain request itself
    local_ok = True
    #: whether this mode sends the decode leg after the prefill leg: a planned pair's
    #: decode instance is then chosen again once the prefill is done (the joint cost given
    #: that prefill instance, on the decode instances' load of that moment)
    decode_after_prefill = False
    #: whether a decode leg evicted (its instance left the routable set before the answer's
    #: head) may go to another decode instance; False: :class:`LegEvicted` is raised
    #: (bootstrap: that D joined its P's bootstrap room, and another D would wait for KV
    #: that P sent the first; the mode chooses the pair again)
    evicted_decode_moves = True

    # -- entry ------------------------------------------------------------------------
    async def handle(self, route: Route, req: Request, resp: Response) -> None:
        p = parse_request(self.s, route, req, resp)
        if p is None:
            return
        table = self.table
        if not table.candidates(PREFILL, p.model) or not table.candidates(DECODE,
                                                                                p.model):
            await self.no_pair(route, req, resp, p)
            return
        ctx = Ctx(route, resp, p)
        self.recovery(ctx)
        try:
            await self.prepare_key(ctx)
            await self.run(ctx)
            while ctx.cont is not None:
                # the decode broke mid-stream: the rest is a fresh PD request (new P and D)
                ctx = ctx.cont
                await self.prepare_key(ctx)
                await self.run(ctx)
        except LegFailed as e:
            if not resp.started:
                route.count(e.status)
                hdrs = ctx.rid_header if e.retry_after_s is None else \
                    ctx.rid_header + ((b"retry-after", b"%d" % e.retry_after_s),)
                resp.send(e.status, e.body, headers=hdrs)
            elif not resp.finished:
                resp.end(sse_error_event(e.status, e.message))
                route.count(e.status)
        except (asyncio.CancelledError, ConnectionError):
            PD_REQUESTS.labels(self.name, "client_gone").inc()
            raise

    async def no_pair(self, route: Route, req: Request, resp: Response, p: Parsed) -> None:
        """No prefill or no decode instance is ready: the union path when allowed and a
        union instance serves the model, else 404 (unknown model) or 503."""
        table, model = self.table, p.model
        if self.s.fallback_to_union and table.candidates(UNION, model):
            PD_REQUESTS.labels(self.name, "fallback_union").inc()
            await self.union.handle(route, req, resp, p)
            return
        PD_REQUESTS.labels(self.name, "no_instance").inc()
        if model is not None and not table.has_model(model):
            route.fail(resp, 404, f"The model `{model}` does not exist.", p.rid_header,
                       param="model")
            return
        missing = "decode" if table.candidates(PREFILL, model) else "prefill"
        route.fail(resp, 503, f"no {missing} instance is ready"
                   + (f" for model {model}" if model else "")
                   + " and no union instance to fall back to", p.rid_header)

    async def run(self, ctx: Ctx) -> None:
        raise NotImplementedError

    def recovery(self, ctx: Ctx) -> None:
        """Mid-stream failover for a stream that can be continued exactly: the decode is
        asked for token ids (``return_token_ids`` in both legs' body; not for SGLang decode
        instances unless ``failover.request_token_ids: always``)."""
        s = self.s
        if not (ctx.stream and s.failover_on and ctx.route.name in ("chat", "completions")):
            return        # SGLang's native /generate streams are not OpenAI chunks
        why = continuable(ctx.chat, ctx.body)
        if why is not None:
            logger.debug("request %s: no mid-stream failover (%s)", ctx.rid.decode("latin-1"),
                         why)
            return
        if s.token_ids_mode != "always" and all(
                not s.ids_for(e) for e in self.table.candidates(DECODE, ctx.model)):
            return
        ctx.rec = StreamRecovery(ctx.chat, ctx.body)
        if ctx.body.get("return_token_ids") is not True:
            ctx.body = dict(ctx.body, return_token_ids=True)

    # -- selection --------------------------------------------------------------------
    def pick(self, role: Role, ctx: Ctx, exclude: set[EndpointState],
             cands: list[EndpointState] | None = None) -> EndpointState | None:
        """The ``role`` leg's endpoint among ``cands`` (default: the routable ones) by that
        role's policy; None when there is none. For the prefill role ``ctx.info.
        prefill_tokens`` is then the prompt tokens the chosen instance computes (its uncached
        part when the policy knows its cache, as ``kv_affinity`` does; else the prompt)."""
        if cands is None:
            cands = self.table.candidates(role, ctx.model)
        if not cands:
            return None
        policy = self.prefill_policy if role is PREFILL else self.decode_policy
        obs = ctx.obs
        if role is PREFILL:
            if policy.uses_prefix and ctx.info.block_hashes is None:
                self.prepare(ctx, policy)
            # the whole prompt unless the policy knows P's cached prefix (kv_affinity sets
            # it; another pick of this request, e.g. D's, may have set it before)
            ctx.info.prefill_tokens = ctx.info.prompt_tokens
        if obs is None:
            ep = policy.pick(cands, ctx.info, exclude)
        else:
            rs = obs.start("motor.route")
            ep = policy.pick(cands, ctx.info, exclude)
            obs.decision(rs, policy.name, role.value, len(cands), ep, ctx.info)
        if ep is not None:
            policy.routed(ep, ctx.info)
        return ep

    async def prepare_key(self, ctx: Ctx) -> None:
        """The prefill policy's routing key (``kv_affinity``'s) before the legs are chosen,
        a long text (:data:`motor.coordinator.tokenize.OFF_LOOP_MIN_CHARS` characters or
        more not cached) encoded in the routing tokenizers' pool, off the event loop, as
        the union path does; :meth:`prepare` then finds it made."""
        pp = self.prefill_policy
        if not pp.uses_prefix or ctx.info.block_hashes is not None:
            return
        route = "chat" if ctx.chat else "completions"
        if ctx.obs is None:
            later = pp.prepare(ctx.info, route, ctx.body, off_loop=True)
            if later is not None:
                await later
        else:
            await prepare_traced_off_loop(pp, ctx.obs, ctx.info, route, ctx.body)

    def prepare(self, ctx: Ctx, policy: Policy) -> None:
        """The routing key, once per request (a retry reuses it), on the loop when
        :meth:`prepare_key` did not make it (a body it cannot be made for)."""
        route = "chat" if ctx.chat else "completions"
        if ctx.obs is None:
            policy.prepare(ctx.info, route, ctx.body)
        else:
            prepare_traced(policy, ctx.obs, ctx.info, route, ctx.body)

    # -- per-instance caps ------------------------------------------------------------
    def _refused(self, e: Refused) -> LegFailed:
        metrics.INSTANCE_CAP_REFUSALS.inc()
        PD_REQUESTS.labels(self.name, "instance_cap").inc()
        return LegFailed(503, f"every instance that can serve the request is at its limit of "
                              f"requests in flight ({e.reason}, waited "
                              f"{self.table.slots.timeout_s:g} s); please retry after "
                              f"{e.retry_after_s} s", retry_after_s=math.ceil(e.retry_after_s))

    async def room(self, role: Role, model: str | None) -> list[EndpointState]:
        """The routable ``role`` endpoints below their cap (all of them when nothing is
        capped), waiting in the table's slot queue while every one is full. The caller
        picks and leases before it awaits anything else. Raises :class:`LegFailed` (503
        with Retry-After) after ``admission.queue_timeout_s``; ``[]`` when none is
        routable."""
        table = self.table
        cands = table.candidates(role, model)
        if not table.gated or not cands:
            return cands
        room = table.with_room(cands) if not table.slots.queued else None
        if room is not None:
            return room
        metrics.INSTANCE_CAP_WAITS.inc()
        try:
            return await table.slots.wait(
                lambda: table.with_room(table.candidates(role, model)))
        except Refused as e:
            raise self._refused(e) from None

    async def room_pair(self, model: str | None, local: bool
                        ) -> tuple[list[EndpointState], list[EndpointState]]:
        """(prefill, decode) endpoints below their cap, waiting until both roles have one
        (or, ``local``, a decode instance alone has room). Raises :class:`LegFailed` as
        :meth:`room`."""
        table = self.table

        def both() -> tuple[list[EndpointState], list[EndpointState]] | None:
            ds = table.with_room(table.candidates(DECODE, model))
            if ds is None:
                return None
            ps = table.with_room(table.candidates(PREFILL, model))
            if ps is None and not local:
                return None
            return ps or [], ds

        if not table.gated:
            return table.candidates(PREFILL, model), table.candidates(DECODE, model)
        got = both() if not table.slots.queued else None
        if got is not None:
            return got
        metrics.INSTANCE_CAP_WAITS.inc()
        try:
            return await table.slots.wait(both)
        except Refused as e:
            raise self._refused(e) from None

    async def plan(self, ctx: Ctx, local: bool | None = None) -> Choice | None:
        """The joint choice of this leg (``pd.joint.enabled``; None without it), in
        ``ctx.plan``: a pair, or with ``local`` (default: this mode allows it) a decode
        instance alone. Its legs take the chosen endpoints first."""
        j = self.joint
        if j is None:
            return None
        local = self.local_ok if local is None else local
        pp = self.prefill_policy
        if pp.uses_prefix and ctx.info.block_hashes is None:
            self.prepare(ctx, pp)
        j.prepare(ctx.info, "chat" if ctx.chat else "completions", ctx.body)
        ps, ds = await self.room_pair(ctx.model, local)
        ch = j.choose(ctx.info, ps, [d for d in ds if d not in ctx.avoid] or ds, local,
                      self.name)
        if ch is None:
            return None
        j.routed(ch, ctx.info, not self.decode_after_prefill)
        PD_ROUTE.labels(self.name, "local" if ch.local else "disaggregated", ch.reason).inc()
        ctx.plan = ch
        return ch

    def planned(self, ep: EndpointState | None) -> bool:
        """Whether the planned endpoint ``ep`` can take its leg now (below its cap)."""
        if ep is None or not ep.routable(time.monotonic()):
            return False
        return not self.table.gated or self.table.with_room([ep]) is not None

    # -- legs -------------------------------------------------------------------------
    async def send(self, ep: EndpointState, ctx: Ctx, body: bytes, first_byte_timeout_s: float,
                   idle_timeout_s: float, fwd: list[tuple[bytes, bytes]] | None = None,
                   evictable: bool = True) -> UpstreamResponse:
        """POST ``body`` to ``ep`` with the request's forwarded headers (``fwd``: a leg's own,
        with its ``traceparent``). Raises :class:`~motor.http.client.UpstreamEvicted` when
        ``ep`` leaves the routable set before the answer's head
        (:meth:`EndpointState.evict_waiting`; not when ``evictable`` is false), and the
        client's transport errors."""
        return await ep.pool.request(b"POST", ctx.path, body, ctx.fwd if fwd is None else fwd,
                                     first_byte_timeout_s=first_byte_timeout_s,
                                     idle_timeout_s=idle_timeout_s,
                                     owner=ep if evictable else None)

    def leg_transport_failed(self, leg: str, ep: EndpointState, e: BaseException) -> str:
        """A leg's transport failure on ``ep`` (:func:`transport_failed`): the text of the
        failure when the leg may be retried elsewhere; raises :class:`LegFailed` (504) for
        a timeout once connected. An eviction (``ep`` left the routable set before the
        answer's head) is retried and not held against ``ep``'s breaker."""
        if isinstance(e, UpstreamEvicted):
            metrics.RETRIES.labels("endpoint_left").inc()
            return f"{ep.url}: {e.reason}"
        reason = transport_failed(ep, e)
        if reason is None:
            assert isinstance(e, UpstreamTimeout)
            PD_REQUESTS.labels(self.name, f"{leg}_failed").inc()
            raise LegFailed(504, f"{leg} instance {ep.instance_id} did not answer within "
                                 f"{e.timeout_s:g} s") from None
        metrics.RETRIES.labels(reason).inc()
        return failure_text(ep, e)

    async def prefill(self, ctx: Ctx, body: bytes, exclude: set[EndpointState],
                      ep: EndpointState | None = None) -> tuple[EndpointState, dict[str, Any]]:
        """Run a non-streamed prefill leg to its end, retrying transport failures, 5xx and
        retryable statuses on other prefill instances (bounded). Returns the endpoint and
        its JSON answer; raises :class:`LegFailed` (the engine's 4xx passes through)."""
        s = self.s
        last = "no prefill instance"
        t = time.perf_counter()
        for attempt in range(s.max_attempts):
            if attempt:
                await s.pause(attempt)
            plan = ctx.plan
            tokens = ctx.info.prompt_tokens
            # P's in-flight prefill counts what P computes: a planned leg's uncached tokens,
            # else what the prefill policy found uncached there (the prompt when unknown)
            work = tokens
            if attempt == 0 and ep is None and plan is not None and self.planned(plan.p):
                ep = plan.p
                work = plan.p_uncached
            elif ep is None or attempt:
                ep = self.pick(PREFILL, ctx, exclude,
                               await self.room(PREFILL, ctx.model))
                work = ctx.info.prefill_tokens
                plan = None
            if ep is None:
                break
            exclude.add(ep)
            obs = ctx.obs
            span, fwd = (None, None) if obs is None else obs.leg("prefill", ep, ctx.fwd, attempt)
            with ep.lease(tokens, work, 0) as lease:
                if plan is not None and plan.p is ep and self.joint is not None:
                    lease.watch(self.joint.watch(plan.p_obs))
                try:
                    up = await self.send(ep, ctx, body, self.prefill_timeout_s,
                                         self.prefill_timeout_s, fwd)
                    status = up.status
                    data = up.read_now()     # came whole with its head: no wait
                    if data is None:
                        async with up:
                            data = await read_whole(up, self.prefill_timeout_s)
                    if status < 400:
                        lease.answered()
                except (UpstreamTimeout, UpstreamClosed, OSError, UpstreamEvicted) as e:
                    if obs is not None:
                        obs.end(span, error=type(e).__name__)
                    last = self.leg_transport_failed("prefill", ep, e)
                    if obs is not None:
                        obs.event("motor.retry", {"motor.leg": "prefill", "motor.attempt": attempt,
                                                  "motor.endpoint": ep.url, "motor.reason": last})
                    continue
            if obs is not None:
                obs.end(span, {"http.response.status_code": status},
                        str(status) if status >= 500 else None)
            note_status(ep, status)
            if status >= 400:
                if status in s.retry_statuses:
                    last = f"{ep.url}: answered {status}"
                    if obs is not None:
                        obs.event("motor.retry", {"motor.leg": "prefill", "motor.attempt": attempt,
                                                  "motor.endpoint": ep.url, "motor.reason": last})
                    continue
                if status >= 500:
                    last = f"{ep.url}: answered {status}: {data[:200].decode('utf-8', 'replace')}"
                    if obs is not None:
                        obs.event("motor.retry", {"motor.leg": "prefill", "motor.attempt": attempt,
                                                  "motor.endpoint": ep.url, "motor.reason": last})
                    continue
                PD_REQUESTS.labels(self.name, failed_outcome("prefill", status)).inc()
                raise LegFailed(status, f"prefill answered {status}",
                                engine_error_body(status, data))
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                PD_REQUESTS.labels(self.name, "prefill_failed").inc()
                raise LegFailed(502, f"prefill instance {ep.instance_id} answered a body that "
                                     f"is not a JSON object")
            PD_PREFILL.labels(self.name).observe(time.perf_counter() - t)
            return ep, obj
        PD_REQUESTS.labels(self.name, "prefill_failed").inc()
        raise LegFailed(502, f"the prefill leg failed: {last}")

    async def open_decode(self, ctx: Ctx, body: bytes, exclude: set[EndpointState],
                          retry: bool = True) -> tuple[EndpointState, UpstreamResponse, Lease]:
        """Send the decode leg; returns once its status and headers arrived, with the
        endpoint's lease still held (the caller releases it). A refused or reset connection
        before any answer, or the instance leaving the routable set before its answer's head
        (evicted), is retried on another decode (``retry``)."""
        s = self.s
        last = "no decode instance"
        exclude.update(ctx.avoid)   # a continuation avoids the decode that broke
        for attempt in range(s.max_attempts if retry else 1):
            if attempt:
                await s.pause(attempt)
                self.decode_moved(ctx)
            plan = ctx.plan
            ep: EndpointState | None
            ctx.d_choice = None
            if attempt == 0 and plan is not None and plan.d not in exclude \
                    and self.planned(plan.d) and (plan.local or not self.decode_after_prefill):
                ep = plan.d
            else:
                # a local leg's plain body may go to any decode instance on a retry
                ep = self._pick_decode(ctx, exclude, await self.room(DECODE, ctx.model))
                plan = None
            if ep is None:
                break
            exclude.add(ep)
            local = plan is not None and plan.local
            lease = ep.lease(ctx.max_tokens + ctx.info.prompt_tokens,
                             plan.d_uncached if local and plan is not None else 0,
                             ctx.max_tokens)
            ch = plan if plan is not None else ctx.d_choice
            if self.joint is not None and ch is not None and ch.d is ep:
                # the hand-off's learning: this leg's time to its first token
                lease.watch(self.joint.watch_decode(ch, not self.decode_after_prefill))
            ctx.d_lease = lease
            obs = ctx.obs
            span, fwd = (None, None) if obs is None else obs.leg(
                "continuation" if ctx.legs else "decode", ep, ctx.fwd, attempt)
            try:
                up = await self.send(ep, ctx, body, s.first_byte_timeout_s,
                                     s.stream_idle_step_s, fwd)
            except (UpstreamTimeout, UpstreamClosed, OSError, UpstreamEvicted) as e:
                lease.release()
                if obs is not None:
                    obs.end(span, error=type(e).__name__)
                if isinstance(e, UpstreamEvicted) and not self.evicted_decode_moves:
                    raise LegEvicted("decode", ep, e.reason) from None
                last = self.leg_transport_failed("decode", ep, e)
                if obs is not None:
                    obs.event("motor.retry", {"motor.leg": "decode", "motor.attempt": attempt,
                                              "motor.endpoint": ep.url, "motor.reason": last})
                continue
            except BaseException as e:
                lease.release()
                if obs is not None:
                    obs.end(span, error=type(e).__name__)
                raise
            if span is not None:
                assert obs is not None
                span.set_attribute("http.response.status_code", up.status)
                obs.decode_span = span      # ended when its answer has been relayed
            return ep, up, lease
        PD_REQUESTS.labels(self.name, "decode_failed").inc()
        raise LegFailed(502, f"the decode leg failed: {last}")

    def decode_moved(self, ctx: Ctx) -> None:
        """:meth:`open_decode` sends the decode leg again, to another instance: undo what the
        mode tied to the last one (nothing here; :class:`DecodeFirst` forgets the prefills
        that the last one asked for)."""

    def _pick_decode(self, ctx: Ctx, exclude: set[EndpointState],
                     cands: list[EndpointState]) -> EndpointState | None:
        """The decode endpoint of a leg not (or no longer) planned: the joint cost given
        the prefill instance already chosen, else the decode policy."""
        plan, j = ctx.plan, self.joint
        if j is not None and plan is not None and plan.p is not None and cands:
            left = [e for e in cands if e not in exclude]
            if left:
                when = "after the prefill" if self.decode_after_prefill else "again"
                ch = j.decode_for(ctx.info, plan.p, left,
                                  f"{self.name} (decode leg chosen {when})", plan.reason)
                ctx.d_choice = ch
                return ch.d if ch is not None else None
        return self.pick(DECODE, ctx, exclude, cands)

    @staticmethod
    async def end_legs(*tasks: asyncio.Future[Any]) -> None:
        """Cancel the legs still running, wait until every one has finished and retrieve
        their outcomes (nothing logged as "never retrieved")."""
        for t in tasks:
            if not t.done():
                t.cancel()
        pending = [t for t in tasks if not t.done()]
        if pending:
            await asyncio.wait(pending)
        for t in tasks:
            if not t.cancelled():
                t.exception()

    @staticmethod
    def drop_decode(d_task: asyncio.Future[tuple[EndpointState, UpstreamResponse, Lease]]
                    ) -> None:
        """A finished ``open_decode`` task whose answer nobody relays (the request ended
        the same turn the decode answered): close its upstream, release its lease (both
        idempotent, so also safe after the request path did)."""
        if d_task.done() and not d_task.cancelled() and d_task.exception() is None:
            _, up, lease = d_task.result()
            up.close()
            lease.release()

    async def serve_local(self, ctx: Ctx, body: dict[str, Any]) -> None:
        """Conditional disaggregation: a decode instance alone serves ``body`` (no
        ``kv_transfer_params``: it prefills the prompt itself)."""
        t_decode = time.perf_counter()
        ep, up, lease = await self.open_decode(ctx, orjson.dumps(body), set())
        with lease:
            try:
                await self.answer_decode(ctx, ep, up, None, t_decode)
            finally:
                up.close()

    async def answer_decode(self, ctx: Ctx, ep: EndpointState, up: UpstreamResponse,
                            p_answer: dict[str, Any] | None, t_decode: float) -> None:
        """Relay the decode's answer to the client: SSE streamed event by event (usage
        merged with the prefill's), anything else whole (usage and prompt_logprobs merged)."""
        status = up.status
        ctype = up.header(b"content-type", JSON) or JSON
        obs = ctx.obs
        try:
            if status < 300 and ctype.startswith(b"text/event-stream"):
                await self._relay_decode(ctx, ep, up, ctype, p_answer, t_decode)
            elif ctx.resp.started:
                await self._failed_continuation(ep, up)
            else:
                await self._whole_decode(ctx, ep, up, ctype, p_answer, t_decode)
        except BaseException as e:
            if obs is not None and obs.decode_span is not None:
                obs.end(obs.decode_span, error=type(e).__name__)
                obs.decode_span = None
            raise
        if obs is not None and obs.decode_span is not None:
            obs.end(obs.decode_span, None, "broken" if ctx.cont is not None else None)
            obs.decode_span = None

    async def _relay_decode(self, ctx: Ctx, ep: EndpointState, up: UpstreamResponse,
                            ctype: bytes, p_answer: dict[str, Any] | None,
                            t_decode: float) -> None:
        resp, route, rec = ctx.resp, ctx.route, ctx.rec
        if not resp.started:
            resp.start(200, content_type=ctype, headers=ctx.rid_header)
        p_usage = p_answer.get("usage") if p_answer else None
        feed: Any = UsageMerger(p_usage) if rec is None else _Chain(rec, UsageMerger(p_usage))
        first = not ctx.wrote
        try:
            err, wrote = await relay_sse(
                up, resp, feed, route, ctx.t0, first, self.s.idle_timeout_s,
                (lambda: PD_TTFT.labels(self.name).observe(time.perf_counter() - ctx.t0))
                if first else None,
                ctx.d_lease.prefill_done if ctx.d_lease is not None else None,
                timing=ep.timing)
        finally:
            up.close()
        ctx.wrote = ctx.wrote or wrote
        if rec is not None and not isinstance(err, UpstreamTimeout):
            self._after_leg(ctx, rec, ep, err)
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
                   f"idle timeout ({self.s.idle_timeout_s:g} s)" if timeout else
                   f"decode instance {ep.instance_id} broke the stream: {err}")
            logger.warning("PD stream from %s ended early: %s", ep.url, msg)
            resp.end(sse_error_event(st, msg))
            route.count(st)
            PD_REQUESTS.labels(self.name, "decode_failed").inc()
        PD_DECODE.labels(self.name).observe(time.perf_counter() - t_decode)
        route.e2e.observe(time.perf_counter() - ctx.t0)

    async def _failed_continuation(self, ep: EndpointState, up: UpstreamResponse) -> None:
        """A continuation's decode answered with an error status: the stream is open."""
        status = up.status
        if status >= 500 and status != 503:
            ep.failed()
        try:
            data = up.read_now()     # came whole with its head: no wait
            if data is None:
                async with up:
                    data = await read_whole(up, self.s.idle_timeout_s)
        except (UpstreamTimeout, UpstreamClosed, OSError):
            data = b""
        PD_REQUESTS.labels(self.name, "decode_failed").inc()
        raise LegFailed(status if status >= 400 else 502,
                        f"the stream could not be continued: decode instance "
                        f"{ep.instance_id} answered {status}: "
                        f"{data[:512].decode('utf-8', 'replace')}")

    async def _whole_decode(self, ctx: Ctx, ep: EndpointState, up: UpstreamResponse,
                            ctype: bytes, p_answer: dict[str, Any] | None,
                            t_decode: float) -> None:
        resp, route = ctx.resp, ctx.route
        status = up.status
        try:
            data = up.read_now()     # came whole with its head: no wait
            if data is None:
                async with up:
                    data = await read_whole(up, self.s.idle_timeout_s)
        except UpstreamTimeout as e:
            ep.failed()
            raise LegFailed(504, f"decode instance {ep.instance_id} stopped answering for "
                                 f"{e.timeout_s:g} s") from None
        except (UpstreamClosed, OSError) as e:
            ep.failed()
            raise LegFailed(502, f"decode instance {ep.instance_id} closed the connection: "
                                 f"{e}") from None
        note_status(ep, status)
        if status >= 400:
            PD_REQUESTS.labels(self.name, failed_outcome("decode", status)).inc()
            raise LegFailed(status, f"decode answered {status}", engine_error_body(status, data))
        if p_answer is not None and status == 200:
            data = merge_answer(data, p_answer)
        route.count(status)
        resp.send(status, data, content_type=ctype, headers=ctx.rid_header)
        now = time.perf_counter()
        PD_TTFT.labels(self.name).observe(now - ctx.t0)
        PD_DECODE.labels(self.name).observe(now - t_decode)
        route.ttft.observe(now - ctx.t0)
        route.e2e.observe(now - ctx.t0)
        ep.timing.ttft.observe(now - ctx.t0)
        PD_REQUESTS.labels(self.name, "ok").inc()

    def _after_leg(self, ctx: Ctx, rec: StreamRecovery, ep: EndpointState,
                   err: BaseException | None) -> None:
        """A recoverable decode stream's leg ended (not by an idle timeout): end the answer
        or set ``ctx.cont`` to the next leg (StreamRecovery's continuation, sent by
        :meth:`handle` as a fresh PD request: new prefill, new decode)."""
        resp, route = ctx.resp, ctx.route
        v = after_leg(rec, err, legs=ctx.legs, max_continuations=self.s.max_continuations,
                      wrote_any=ctx.wrote, path=ctx.path,
                      max_model_len=partial(self.table.context_length, ctx.model))
        settle_leg(ep, err, v.engine_ok)
        if v.action == END and err is None:
            resp.end(v.tail or b"")
            route.count(200)
            PD_REQUESTS.labels(self.name, "ok").inc()
            return
        if resp.client_gone:
            raise asyncio.CancelledError()
        if v.action == END:     # broke after its finishing chunk: motor ends it
            resp.end(v.tail or b"")
            route.count(200)
            PD_REQUESTS.labels(self.name, "ok").inc()
            return
        if v.action == REFUSE:
            client_error = v.status < 500
            metrics.FAILOVER_REFUSED.labels("client_error" if client_error else "refused").inc()
            msg = (f"decode instance {ep.instance_id} failed mid-stream ({err or v.reason}); "
                   f"not continued: {v.why}")
            logger.log(logging.INFO if client_error else logging.WARNING,
                       "PD stream from %s ended early: %s", ep.url, msg)
            resp.end(v.tail if v.tail is not None else sse_error_event(v.status, msg))
            route.count(v.status)
            PD_REQUESTS.labels(self.name, "client_error" if client_error
                               else "decode_failed").inc()
            return
        metrics.FAILOVERS.labels(v.reason).inc()
        ctx.avoid.add(ep)
        ctx.cont = ctx.continued(v.path, orjson.loads(v.body))
        if ctx.obs is not None:
            ctx.obs.event("motor.failover", {"motor.reason": v.reason, "motor.endpoint": ep.url,
                                             "motor.leg.index": ctx.cont.legs})
        logger.info("PD stream from %s continues as a new PD request (%s, leg %d)", ep.url,
                    v.reason, ctx.cont.legs + 1)


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


__all__ = ["Ctx", "LegFailed", "PdPath", "failed_outcome", "merge_answer", "merge_usage",
           "prefill_body"]
