"""``pd_bootstrap``: SGLang's disaggregation (mini_lb / sgl-model-gateway ``pd_router``).

P and D get the same body at once (OpenAI routes and SGLang's native ``/generate``), plus
``bootstrap_host`` (P's host),
``bootstrap_port`` (P's ``--disaggregation-bootstrap-port``, from its registration or
else its ``GET /server_info`` ``disaggregation_bootstrap_port``) and ``bootstrap_room``
(random in ``[0, 2**63)``). A batch (``prompt`` as a list of prompts; ``/generate``'s
``text`` list or ``input_ids`` list of lists) or ``n`` > 1
gets lists of that length with a distinct room each, like the gateway's
``inject_bootstrap_fields``. D's answer streams to the client; P's answer is read and
dropped. P failing before D's first byte ends D at once (D would wait for KV that never
comes) and the client gets P's error; D ending, failing or the client leaving cancels P.
P or D leaving the routable set before its answer's head (evicted) ends the pair at once:
the pair shares a bootstrap room, so neither leg can move alone; while nothing reached the
client a new pair (a new room) is chosen, at most ``retries.max_attempts`` pairs, then 502.
P of a streamed request is not evicted: D's stream head may have reached the client first.
The same holds for a pair whose P refused or reset the connection, or whose P or D answered
a retryable status (``retries.retry_statuses``, or a 5xx with ``Retry-After``) before
anything reached the client: a new pair, avoiding the instances that failed while others
are routable; the last pair's failure is the client's answer (P's 502, the engine's own
status and body).
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import orjson

from motor.coordinator.endpoints import EndpointState, Lease
from motor.coordinator.metrics import PD_PREFILL, PD_REQUESTS, RETRIES
from motor.coordinator.recovery import retryable_status
from motor.coordinator.routing.base import (PREFILL, engine_error_body, note_status, read_whole,
                                            transport_failed)
from motor.coordinator.routing.pd_common import Ctx, LegEvicted, LegFailed, PdPath, failed_outcome
from motor.http.client import UpstreamEvicted

logger = logging.getLogger(__name__)


def _repairable(e: LegFailed, ep: EndpointState, reason: str, outcome: str) -> LegFailed:
    """``e`` marked for another pair (:meth:`Bootstrap.run`): the instance that failed,
    the ``motor_coordinator_retries_total`` reason, and the
    ``motor_coordinator_pd_requests_total`` outcome counted if no pair serves it."""
    e.repairable = True
    e.ep = ep
    e.retry_reason = reason
    e.outcome = outcome
    return e


def new_room() -> int:
    return secrets.randbits(63)


def batch_size(body: dict[str, Any]) -> int | None:
    """Items the engine runs for this body, when more than one (None: scalar fields).

    OpenAI bodies: a list of prompts, or ``n`` > 1. SGLang's native ``/generate``: ``text``
    as a list, ``input_ids`` as a list of lists, or ``sampling_params.n`` > 1 (the fields
    sglang's ``GenerateReqInput`` batches on)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and not isinstance(p[0], int):
        return len(p)
    text = body.get("text")
    if isinstance(text, list):
        return len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    n = body.get("n")
    if n is None and isinstance(body.get("sampling_params"), dict):
        n = body["sampling_params"].get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        return n
    return None


def with_bootstrap(body: dict[str, Any], host: str, port: int | None) -> dict[str, Any]:
    b = dict(body)
    k = batch_size(body)
    if k is None:
        b["bootstrap_host"], b["bootstrap_port"], b["bootstrap_room"] = host, port, new_room()
    else:
        rooms: set[int] = set()
        while len(rooms) < k:
            rooms.add(new_room())
        b["bootstrap_host"] = [host] * k
        b["bootstrap_port"] = [port] * k
        b["bootstrap_room"] = list(rooms)
    return b


class Bootstrap(PdPath):
    name = "pd_bootstrap"
    #: SGLang decode instances wait for a prefill peer's KV: no local prefill
    local_ok = False
    #: a D evicted before its answer's head joined P's room: not moved alone (PdPath); the
    #: pair is chosen again (run)
    evicted_decode_moves = False

    async def bootstrap_port(self, ep: EndpointState) -> int | None:
        if ep.bootstrap_port is not None:
            return ep.bootstrap_port
        client = self.table.client
        for path in ("/server_info", "/get_server_info"):
            try:
                st, data = await client.get_json_bytes(ep.host, ep.port, path, 5.0)
            except (TimeoutError, OSError):
                return None
            if st == 200:
                try:
                    port = orjson.loads(data).get("disaggregation_bootstrap_port")
                except (orjson.JSONDecodeError, AttributeError):
                    return None
                if isinstance(port, int):
                    ep.bootstrap_port = port
                return ep.bootstrap_port
        return None

    async def run(self, ctx: Ctx) -> None:
        """Run a pair; when one of its legs failed in a way another pair may not
        (:attr:`LegFailed.repairable`: evicted, :class:`LegEvicted`; P's connection refused
        or reset; a retryable status) while nothing reached the client, run a new pair (a
        new room) that avoids the failed instances, at most ``retries.max_attempts`` pairs
        in all."""
        s = self.s
        avoid: set[EndpointState] = set()
        for attempt in range(s.max_attempts):
            if attempt:
                await s.pause(attempt)
            last = attempt + 1 >= s.max_attempts
            try:
                await self._pair(ctx, avoid, last)
                return
            except LegFailed as e:
                if not e.repairable or last or ctx.resp.started:
                    if isinstance(e, LegEvicted):
                        PD_REQUESTS.labels(self.name, f"{e.leg}_failed").inc()
                    elif e.outcome is not None:
                        PD_REQUESTS.labels(self.name, e.outcome).inc()
                    raise
                if e.ep is not None:
                    avoid.add(e.ep)
                RETRIES.labels(e.retry_reason).inc()
                logger.debug("pd_bootstrap: %s; the pair is chosen again", e.message)

    async def _pair(self, ctx: Ctx, avoid: set[EndpointState], last: bool) -> None:
        """One pair. ``avoid``: instances of earlier pairs of this request that failed
        (chosen only when no other is routable); ``last``: no pair follows, so a D's
        retryable status is relayed as it is."""
        # both legs run at once: the pair is taken with room on both sides (a P slot held
        # while waiting for a D slot held by a request waiting for a P slot never happens)
        plan = await self.plan(ctx)
        # P's in-flight prefill counts what P computes: the planned pair's uncached tokens,
        # else what the prefill policy found uncached there (the prompt when unknown)
        if plan is not None and plan.p is not None and plan.p not in avoid:
            p_ep: EndpointState | None = plan.p
            work = plan.p_uncached
            if self.table.gated:
                ps, _ = await self.room_pair(ctx.model, False)
                if p_ep not in ps:
                    p_ep = self.pick(PREFILL, ctx, avoid, ps)
                    work = ctx.info.prefill_tokens
        else:
            ps, _ = await self.room_pair(ctx.model, False)
            p_ep = self.pick(PREFILL, ctx, avoid, ps)
            work = ctx.info.prefill_tokens
        if p_ep is None:
            raise LegFailed(503, "no prefill instance is ready")
        lease = p_ep.lease(ctx.info.prompt_tokens, work, 0)  # before any await: slot taken
        try:
            port = await self.bootstrap_port(p_ep)
        except BaseException:
            lease.release()
            raise
        if port is None:
            logger.warning("prefill %s has no known bootstrap port; the engine's default "
                           "applies", p_ep.url)
        body = orjson.dumps(with_bootstrap(ctx.body, p_ep.host, port))
        p_task = asyncio.ensure_future(self._prefill_leg(ctx, p_ep, body, lease))
        d_task = asyncio.ensure_future(self.open_decode(ctx, body, set(avoid), retry=True))
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if d_task not in done:
                # P finished first: fine when it succeeded, fatal for D otherwise
                err = p_task.exception()
                if err is not None:
                    await self.end_legs(d_task)
                    raise err
                await asyncio.wait({d_task})
            ep, up, lease = d_task.result()   # raises LegFailed when D could not be reached
            with lease:
                try:
                    if p_task.done() and p_task.exception() is not None:
                        # D answered (headers) but P failed: D will not get the KV
                        err = p_task.exception()
                        assert err is not None
                        raise err
                    if not last and up.status >= 400 and not ctx.resp.started and \
                            retryable_status(up.status, up.headers, self.s.retry_statuses):
                        raise self._decode_refused(ctx, ep, up)
                    await self.answer_decode(ctx, ep, up, None, time.perf_counter())
                finally:
                    up.close()
        finally:
            await self.end_legs(p_task, d_task)
            self.drop_decode(d_task)   # D answered the turn the request ended
            lease.release()            # P's task may have been cancelled before it ran

    def _decode_refused(self, ctx: Ctx, ep: EndpointState, up: Any) -> LegFailed:
        """D answered a retryable status before anything reached the client: the failure
        for :meth:`run` to choose another pair. Its body is never relayed (a non-last pair's
        repairable failure is always followed by another pair), so it is not waited for:
        what came with the head, else the connection is closed."""
        note_status(ep, up.status)
        data = up.read_now() or b""
        up.close()
        obs = ctx.obs
        if obs is not None and obs.decode_span is not None:
            obs.end(obs.decode_span, {"http.response.status_code": up.status}, str(up.status))
            obs.decode_span = None
        e = LegFailed(up.status, f"decode instance {ep.instance_id} answered {up.status}",
                      engine_error_body(up.status, data))
        return _repairable(e, ep, f"status_{up.status}", failed_outcome("decode", up.status))

    async def _prefill_leg(self, ctx: Ctx, ep: EndpointState, body: bytes,
                           lease: Lease) -> None:
        """Send P its copy and read its answer to the end (dropped); raises LegFailed.
        ``lease``: P's, taken by the caller, released here."""
        t = time.perf_counter()
        obs = ctx.obs
        span, fwd = (None, None) if obs is None else obs.leg("prefill", ep, ctx.fwd)
        with lease:
            try:
                # a streamed request's D sends its head at once, and it may reach the client
                # before P's does: P is not evicted then (the pair could no longer be chosen
                # again, and D still takes P's KV); P's own stream head comes at once anyway
                up = await self.send(ep, ctx, body, self.prefill_timeout_s, self.prefill_timeout_s,
                                     fwd, evictable=not ctx.stream)
                status = up.status
                data = up.read_now()     # came whole with its head: no wait
                if data is None:
                    async with up:
                        data = await read_whole(up, self.prefill_timeout_s)
            except BaseException as e:
                if obs is not None:
                    obs.end(span, error=type(e).__name__)
                if isinstance(e, UpstreamEvicted):
                    # P left the routable set before its answer's head: D waits for P's KV
                    # through P's bootstrap server, so P cannot move alone (run: a new pair)
                    raise LegEvicted("prefill", ep, e.reason) from None
                if not isinstance(e, (TimeoutError, ConnectionError, OSError)):
                    raise
                reason = transport_failed(ep, e)  # breaker and upstream_errors, as every leg
                if reason is None or (isinstance(e, TimeoutError) and reason == "closed"):
                    # a timeout once connected: P may be working on it (as the union path)
                    PD_REQUESTS.labels(self.name, "prefill_failed").inc()
                    raise LegFailed(504, f"prefill instance {ep.instance_id} did not answer "
                                         f"within {getattr(e, 'timeout_s', self.prefill_timeout_s):g}"
                                         f" s") from None
                # refused or reset: another pair may serve it (run), counted when none does
                raise _repairable(LegFailed(502, f"prefill instance {ep.instance_id} failed: "
                                                 f"{type(e).__name__}: {e}"),
                                  ep, reason, "prefill_failed") from None
        if obs is not None:
            obs.end(span, {"http.response.status_code": status},
                    str(status) if status >= 500 else None)
        note_status(ep, status)
        if status >= 400:
            failure = LegFailed(status, f"prefill instance {ep.instance_id} answered {status}",
                                engine_error_body(status, data))
            if retryable_status(status, up.headers, self.s.retry_statuses):
                raise _repairable(failure, ep, f"status_{status}",
                                  failed_outcome("prefill", status))
            PD_REQUESTS.labels(self.name, failed_outcome("prefill", status)).inc()
            raise failure
        PD_PREFILL.labels(self.name).observe(time.perf_counter() - t)
