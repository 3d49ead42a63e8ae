"""``pd_decode_first``: vLLM-Ascend's layerwise connector with a "metaserver".

1. D gets the client's body plus ``kv_transfer_params: {do_remote_decode: false,
   do_remote_prefill: true, metaserver: <this coordinator>/v1/metaserver}`` and the
   ``X-Request-Id``;
2. D's connector POSTs its block coordinates to the metaserver, with ``request_id``
   ``chatcmpl-<X-Request-Id>`` (chat) or ``cmpl-<X-Request-Id>-<prompt index>``;
3. the coordinator sends P the original body with that callback body verbatim as
   ``kv_transfer_params``, ``stream: false``, ``max_tokens: 1``, ``min_tokens: 1``, no
   ``stream_options`` (vLLM-Ascend ``load_balance_proxy_layerwise_server_example.py``),
   and answers the callback ``{"status":"ok"}`` once P is done (404 for an unknown id,
   502 when P failed; the connector ignores the answer);
4. D's answer goes to the client. A failed P ends D at once (it would wait forever for
   the KV) with P's error; the client leaving or D ending cancels P;
5. D failing before its answer's head (connection refused or reset), or leaving the
   routable set then (evicted: :meth:`PdPath.send`), moves the leg to another D: the
   prefills the first D asked for are cancelled (their callbacks answered 502) and the new
   D's callbacks run new ones (:meth:`DecodeFirst.decode_moved`). The new D gets its own
   ``X-Request-Id`` (``<id>.d<n>``, so its callbacks' ``request_id`` too): a callback of
   the D that left, arriving late, names an id the request no longer waits under and is
   answered 404, where it was taken for the new D's and its prefill pushed the KV to the
   D that left.

With ``pd.joint.enabled`` the pair is chosen at once (:meth:`PdPath.plan`: D's leg and
then P's callback take the chosen instances when they still have room); a request planned
on a decode instance alone goes there without ``kv_transfer_params`` (D prefills it).

A multi-prompt completion's children call back one by one; each child's P request
carries that prompt alone. The pending callbacks live in the worker that took the
client's request, so this mode needs ``coordinator.workers: 1`` for now.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import orjson

from motor.config.schema import CoordinatorConfig
from motor.coordinator.endpoints import EndpointTable
from motor.coordinator.policy import Policy
from motor.coordinator.routing.base import Settings
from motor.coordinator.routing.union import UnionPath
from motor.http.server import Request, Response
from motor.coordinator.routing.pd_common import Ctx, LegFailed, PdPath, prefill_body
from motor.protocol.openai import error_body

logger = logging.getLogger(__name__)

METASERVER_PATH = "/v1/metaserver"


def engine_rid(ctx: Ctx) -> bytes:
    """The ``X-Request-Id`` the request's legs are sent (``ctx.fwd``; the client's id, or
    ``<id>.d<n>`` once the decode leg moved)."""
    for k, v in reversed(ctx.fwd):
        if k == b"x-request-id":
            return v
    return ctx.rid


class _Pending:
    """One awaited callback (one child of a request)."""

    __slots__ = ("ctx", "cid", "old", "body", "failed", "p_answer", "p_task", "called",
                 "moves")

    def __init__(self, ctx: Ctx, cid: str, body: dict[str, Any]) -> None:
        self.ctx = ctx
        #: the callback's ``request_id`` this child waits for (its key in ``pending``)
        self.cid = cid
        #: the ids it waited under before its decode leg moved: kept in ``pending`` until
        #: the request ends, so that their late callbacks are answered 404 and a request
        #: that reuses one is refused (409)
        self.old: list[str] = []
        #: how many times the decode leg moved to another D
        self.moves = 0
        self.body = body
        self.failed: asyncio.Future[LegFailed] = asyncio.get_running_loop().create_future()
        self.p_answer: dict[str, Any] | None = None
        self.p_task: asyncio.Task[Any] | None = None
        self.called = False


class DecodeFirst(PdPath):
    name = "pd_decode_first"

    def __init__(self, cfg: CoordinatorConfig, settings: Settings, table: EndpointTable,
                 policy: Policy, union: UnionPath) -> None:
        super().__init__(cfg, settings, table, policy, union)
        url = cfg.pd.metaserver_url
        if not url:
            host = cfg.host
            if host in ("0.0.0.0", "::", ""):
                host = socket.gethostbyname(socket.gethostname())
            url = f"http://{host}:{cfg.port}{METASERVER_PATH}"
        self.metaserver_url: str = url
        self.pending: dict[str, _Pending] = {}

    def routes(self) -> list[tuple[str, str, Callable[[Request, Response], Any]]]:
        """D's connector calls back on ``POST /v1/metaserver``."""
        return [("POST", METASERVER_PATH, self.on_metaserver)]

    def child_ids(self, ctx: Ctx, engine_rid: bytes) -> list[tuple[str, dict[str, Any]]]:
        """Each child's callback ``request_id`` (vLLM's, from the ``X-Request-Id``
        ``engine_rid`` D was sent) and its body."""
        rid = engine_rid.decode("latin-1")
        if ctx.chat:
            return [(f"chatcmpl-{rid}", ctx.body)]
        p = ctx.body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return [(f"cmpl-{rid}-{i}", dict(ctx.body, prompt=item)) for i, item in enumerate(p)]
        return [(f"cmpl-{rid}-0", ctx.body)]

    async def run(self, ctx: Ctx) -> None:
        plan = await self.plan(ctx)
        if plan is not None and plan.local:
            await self.serve_local(ctx, ctx.body)   # conditional disaggregation: D alone
            return
        children = self.child_ids(ctx, engine_rid(ctx))
        pend = [_Pending(ctx, cid, b) for cid, b in children]
        for p in pend:
            other = self.pending.get(p.cid)
            if other is not None:
                made = "" if other.ctx.rid == ctx.rid else \
                    f" (motor's id for the decode instance request " \
                    f"{other.ctx.rid.decode('latin-1')!r} moved to)"
                raise LegFailed(409, f"a request with id {p.cid} is already in flight{made}; "
                                     f"X-Request-Id must be unique")
        self.pending.update((p.cid, p) for p in pend)
        d_body = dict(ctx.body)
        d_body["kv_transfer_params"] = {"do_remote_decode": False, "do_remote_prefill": True,
                                        "metaserver": self.metaserver_url}
        t_decode = time.perf_counter()
        d_task = asyncio.ensure_future(self.open_decode(ctx, orjson.dumps(d_body), set(),
                                                        retry=True))
        fails = [p.failed for p in pend]
        try:
            waiters: set[asyncio.Future[Any]] = {d_task, *fails}
            done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            if d_task not in done:
                await self.end_legs(d_task)
                raise next(f for f in fails if f.done()).result()
            ep, up, lease = d_task.result()
            with lease:
                try:
                    p_answer = next((p.p_answer for p in pend if p.p_answer), None)
                    await self.answer_decode(ctx, ep, up, p_answer, t_decode)
                finally:
                    up.close()
        finally:
            for p in pend:
                for cid in (p.cid, *p.old):
                    if self.pending.get(cid) is p:
                        del self.pending[cid]
                if p.p_task is not None and not p.p_task.done():
                    p.p_task.cancel()
            await self.end_legs(d_task)
            self.drop_decode(d_task)   # D answered the turn the request ended

    def decode_moved(self, ctx: Ctx) -> None:
        """The decode leg goes to another D (a retry: the last one failed or left before its
        answer's head). A prefill the last D asked for pushes its KV to that D, so it is
        cancelled, and the child waits for the new D's metaserver call, which runs a new one
        (without this the call was answered 404 and the new D failed the request).

        The new D is sent its own ``X-Request-Id``, ``<client id>.d<moves>`` (``ctx.fwd``),
        and the children wait under the ids its callbacks will carry. The ids they waited
        under stay in ``pending`` until the request ends: a late callback of the D that
        left is answered 404 (it was taken for the new D's, its prefill pushed the KV to
        the D that left, and the new D's own call got a 404), and a request reusing one
        is refused (409)."""
        moving = [(i, p) for i, (cid, _) in enumerate(self.child_ids(ctx, engine_rid(ctx)))
                  if (p := self.pending.get(cid)) is not None and p.ctx is ctx]
        if not moving:
            return
        moves = moving[0][1].moves
        while True:         # an id no other request waits under (a client may send any id)
            moves += 1
            new = b"%s.d%d" % (ctx.rid, moves)
            new_ids = self.child_ids(ctx, new)
            if not any(cid in self.pending for cid, _ in new_ids):
                break
        for _, p in moving:
            if p.p_task is not None:
                p.p_task.cancel()
            p.called = False
            p.p_task = None
            p.p_answer = None
        for i, p in moving:
            p.old.append(p.cid)         # stays in pending: a late call of it gets 404
            p.cid = new_ids[i][0]
            p.moves = moves
            self.pending[p.cid] = p
        ctx.fwd = [(k, new) if k == b"x-request-id" else (k, v) for k, v in ctx.fwd]

    async def on_metaserver(self, req: Request, resp: Response) -> None:
        """D's connector calls back: run P for that child, answer when it is done."""
        try:
            params = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            resp.send(400, error_body(400, f"metaserver body is not valid JSON: {e}"))
            return
        rid = params.get("request_id") if isinstance(params, dict) else None
        p = self.pending.get(rid) if isinstance(rid, str) else None
        if p is None or p.called or p.cid != rid:
            why = "" if p is None or p.cid == rid else \
                " (the call of a decode instance the request moved away from)"
            resp.send(404, error_body(404, f"no request waits for a prefill as {rid!r}{why}"))
            return
        p.called = True
        ctx = p.ctx
        p_body = prefill_body(p.body, params, min_tokens_1=True)
        task = p.p_task = asyncio.ensure_future(self.prefill(ctx, orjson.dumps(p_body), set()))
        await asyncio.wait({task})
        if task.cancelled() or p.p_task is not task:
            # the request ended, or its decode leg moved to another D (decode_moved); a
            # prefill that ended before it was cancelled is the D that left's: its outcome
            # is dropped (retrieved, so asyncio does not log it as never retrieved)
            if not task.cancelled():
                task.exception()
            resp.send(502, error_body(502, "the prefill was cancelled: the request ended or "
                                           "its decode leg moved to another instance"))
            return
        err = task.exception()
        if err is not None:
            lf = err if isinstance(err, LegFailed) else LegFailed(502, f"prefill failed: {err}")
            if not p.failed.done():
                p.failed.set_result(lf)
            resp.send(502, error_body(502, lf.message))
            return
        _, p.p_answer = task.result()
        resp.send(200, b'{"status":"ok"}')
