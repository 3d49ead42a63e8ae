"""``kv_affinity``: the candidate where the request's first token comes soonest.

Optimises: TTFT through prefix-cache reuse, weighed against each instance's queue, so a
hot prefix never melts its holder (case N07) and a short prompt never waits behind a
long prefill it could avoid.

Inputs per candidate endpoint ``i``: the request's routing key (token ids of the whole
templated conversation or of the prompt, :mod:`motor.coordinator.tokenize`, hashed
into blocks of ``coordinator.kv.block_size``), the leading blocks of that key cached
on ``i`` per tier (:meth:`motor.coordinator.kv.KvRouter.match`: exact index from KV
events, approximate index from routing history), the load in flight on ``i`` (this
coordinator's, summed over workers; with workers > 1 also the engine's reported waiting
and running requests) and ``i``'s learned rates (:mod:`motor.coordinator.policy.ttft`).

``coordinator.kv.cost: time`` (opt-in; see docs/benchmarks.md), in seconds (:func:`motor._fast.scoring.pick_ttft`)::

    saved_i    = block_size * (credit_device * ov_device + credit_host * ov_host
                               + credit_disk * ov_disk)                     tokens
    uncached_i = max(prompt_tokens - saved_i, 0)                            tokens
    queued_i   = max(prefill tokens in flight on i,
                     engine-reported waiting x mean uncached tokens)        tokens
    running_i  = max(requests in flight on i, engine waiting + running)     sequences
    work_i     = queued_i + uncached_i;  steps_i = max(1, ceil(work_i / chunk_tokens))
    ttft_i     = steps_i * (step_s_i + decode_s_per_seq_i * running_i)
                 + prefill_s_per_token_i * work_i                           seconds
    compared_i = ttft_i + stall_weight * running_i * prefill_s_per_token_i * uncached_i

(the second term: the time this request's prefill holds up the sequences already in i's
batch; it keeps new conversations, which have nothing cached anywhere, off the busiest
instance, where learned rates a few per cent apart would otherwise pile them up).

Settings (``coordinator.kv.ttft``): prior rates ``step_ms`` 6, ``prefill_us_per_token``
37, ``decode_us_per_seq`` 100 (an 8B dense model in bf16 on one H100), ``chunk_tokens``
8192, ``stall_weight`` 1, and the learning (``learn``, ``halflife_requests`` 64,
``prior_weight`` 1). There is no load guard: an instance whose queue makes it slower than
recomputing the prefix elsewhere loses on its predicted TTFT, and its learned rates show
when it is slower than its queue suggests.

``coordinator.kv.cost: tokens`` (the default) keeps the earlier cost in prompt-token equivalents
(:func:`motor._fast.scoring.pick`: ``prefill_weight``, ``decode_weight``,
``queue_penalty_tokens``, ``load_guard``; docs/kv-routing.md).

Sessions (``coordinator.kv.session``, :mod:`motor.coordinator.policy.sessions`): a request
naming a session (its ``x-session-id`` header, configurable, or else the body's ``user``)
leans to the endpoint that served the session's last request: that candidate's cost is
lowered by ``credit_tokens`` (1024) prompt-token equivalents, or with ``cost: time`` by
``credit_tokens`` x its prefill time per token (seconds; 38 ms at the prior rate), for the
comparison only. A soft preference: any candidate cheaper by more than the credit (a
shorter queue, a longer cached prefix) still wins. Memory: the ``max_sessions`` (65536)
most recently routed sessions, per worker; a session not remembered breaks ties from a
stable hash of its name (the same endpoint in every worker).

Tie-break: lowest cost, then lowest load (time: the queued time), then rotation (equal
candidates, e.g. with no cached prefix anywhere, spread like round robin). Excluded
endpoints (retries) are skipped unless nothing else is left. A request that cannot be
tokenized is routed on load alone, and so is one with a candidate that has no KV slot (more
than 256 endpoints at once: warned once). Each decision is logged at debug level with its
terms and their units.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from motor._fast.columns import gather
from motor._fast.kvpick import TokenPick
from motor._fast.scoring import pick as score_pick
from motor._fast.scoring import pick_ttft
from motor.config.schema import KvCost
from motor.coordinator import metrics
from motor.coordinator.kv.router import MAX_INSTANCES, KvRouter
from motor.coordinator.loadtable import Columns, load_columns
from motor.coordinator.policy.base import Policy, RequestInfo
from motor.coordinator.policy.sessions import SessionTable, session_of, session_start
from motor.coordinator.policy.ttft import RateModel, TtftWatch, engine_columns

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointState

logger = logging.getLogger(__name__)


class KvAffinity(Policy):
    name = "kv_affinity"
    uses_prefix = True

    def __init__(self, router: KvRouter | None = None) -> None:
        self.router = router or KvRouter()
        c = self.router.cfg
        self.tier_credit = np.array([c.tier_credit.device, c.tier_credit.host, c.tier_credit.disk],
                                    dtype=np.float64)
        self._credit = (float(c.tier_credit.device), float(c.tier_credit.host),
                        float(c.tier_credit.disk))
        #: the token cost's weights (``kv.cost: tokens``), read once: a pydantic model's
        #: attribute costs ~10x a plain one's on every decision
        self._score_cfg = (c.prefill_weight, c.decode_weight, c.queue_penalty_tokens,
                           c.load_guard, c.load_guard_min_tokens)
        #: the token cost's decision in one compiled call (None: ``kv.cost: time``)
        self._token_pick = None if c.cost is KvCost.TIME else TokenPick(
            c.block_size, self._credit, *self._score_cfg)
        self._next = 0
        self.time_cost = c.cost is KvCost.TIME
        t = c.ttft
        self.learn = t.learn
        self.learns_ttft = self.time_cost and t.learn
        self.chunk_tokens = float(t.chunk_tokens)
        self.stall_weight = float(t.stall_weight)
        self.engine_max_age_s = t.engine_figures_max_age_s
        #: learned rates per instance slot (reset when the slot's endpoint leaves)
        self.rates = RateModel(t, MAX_INSTANCES)
        self.router.on_forget.append(self.rates.reset)
        #: exponentially weighted mean of the uncached tokens routed (tokens): what one
        #: engine-reported waiting request is taken to weigh
        self.mean_uncached = 512.0
        ss = c.session
        #: the endpoint each session was last routed to (None: session affinity off)
        self.sessions = (SessionTable(ss.max_sessions)
                         if ss.enabled and ss.credit_tokens > 0 else None)
        self.session_credit_tokens = float(ss.credit_tokens)
        self.session_user_field = ss.user_field
        #: ``on_session(session, ep)`` after each named session's routing: a multi-worker
        #: coordinator's :class:`~motor.coordinator.rings.WorkerLink` tells the other workers
        self.on_session: Callable[[bytes | str, EndpointState], None] | None = None
        self._session_kept = metrics.KV_SESSION_ROUTES.labels("kept")
        self._session_moved = metrics.KV_SESSION_ROUTES.labels("moved")
        self._session_new = metrics.KV_SESSION_ROUTES.labels("new")
        #: the hit-ratio counters' updates, on every decision (without the library's checks)
        self._count_prompt = metrics.counter_inc(metrics.KV_PROMPT_TOKENS)
        self._count_matched = metrics.counter_inc(metrics.KV_MATCHED_TOKENS)

    def prepare(self, info: RequestInfo, route: str, body: dict[str, Any],
                off_loop: bool = False) -> Awaitable[None] | None:
        """Fill ``info.block_hashes`` and ``info.prompt_tokens`` from the request body.

        The key comes from the routing tokenizers' cache when the same request was seen,
        and a prefix seen before is not tokenized nor hashed again
        (:meth:`motor.coordinator.tokenize.Tokenizers.block_key`). ``off_loop``: a long text is
        encoded in the tokenizers' thread pool, and the coroutine returned fills ``info``
        once it is done (short ones are done inline: ``None``). Without a session header,
        ``info.session`` becomes the body's ``user`` (``coordinator.kv.session.user_field``)."""
        if info.session is None and self.sessions is not None:
            info.session = session_of(None, body, self.session_user_field)
        if off_loop:
            fut = self.router.tokenizers.warm(route, body)
            if fut is not None:
                return self._prepare_after(fut, info, route, body)
        key = self.router.request_hashes(route, body)
        if key is not None:
            info.prompt_tokens, info.block_hashes = key
            info.prefill_tokens = info.prompt_tokens
        return None

    async def _prepare_after(self, fut: Awaitable[object], info: RequestInfo, route: str,
                             body: dict[str, Any]) -> None:
        try:
            await fut                   # the ids land in the cache
        except Exception:  # noqa: BLE001 - the inline encode below meets it again and says so
            pass
        self.prepare(info, route, body)

    def pick(self, candidates: list[EndpointState], request: RequestInfo,
             exclude: set[EndpointState] | None = None) -> EndpointState | None:
        if not candidates:
            return None
        cands = [e for e in candidates if e not in exclude] if exclude else candidates
        if not cands:
            cands = candidates
        r = self.router
        last = self._session_last(request)
        start = self._next
        self._next = start + 1
        tp = self._token_pick
        if tp is not None and not logger.isEnabledFor(logging.DEBUG):
            # the token cost in one compiled call: _pick_columns' decision without its
            # numpy arrays (motor._fast.kvpick; the tests compare the two)
            hashes = request.block_hashes
            exact = approx = None
            if hashes is not None and len(hashes):
                exact, approx = r.indexes(request.model)
            else:
                hashes = None
            alt = session_start(request.session) \
                if request.session is not None and self.sessions is not None else -1
            loads = None if getattr(cands[0], "shared", None) is None else load_columns(cands)
            got = tp.pick(cands, r.slot_map, hashes, exact, approx, request.prompt_tokens,
                          start, alt, last, self.session_credit_tokens, loads)
            if got is None:         # an endpoint new to KV routing: give it a slot
                keys = [e.key for e in cands]
                if r.give_slots(keys):
                    got = tp.pick(cands, r.slot_map, hashes, exact, approx,
                                  request.prompt_tokens, start, alt, last,
                                  self.session_credit_tokens, loads)
                else:               # no slot left for it: on load alone
                    got = tp.pick(cands, r.load_alone(keys), None, None,
                                  None, request.prompt_tokens, start, alt, last,
                                  self.session_credit_tokens, loads)
                assert got is not None
            pos, cost, o0, o1, o2, _ = got
        else:
            pos, cost, o0, o1, o2 = self._pick_columns(cands, request, start, last)
        c0, c1, c2 = self._credit
        bs = r.block_size
        prompt = request.prompt_tokens
        cached = (o0 + o1 + o2) * bs
        request.cached_tokens = cached if cached < prompt else prompt
        request.cost = cost
        left = int(prompt - bs * (c0 * o0 + c1 * o1 + c2 * o2))
        request.prefill_tokens = left if left > 0 else 0
        if request.block_hashes is not None and not exclude:
            # once a request (leg): a retry's decision, with the tried endpoints excluded,
            # is not counted again
            self._count_prompt(prompt)
            self._count_matched(request.cached_tokens)
        return cands[pos]

    def _pick_columns(self, cands: list[EndpointState], request: RequestInfo, start: int,
                      last: str | None) -> tuple[int, float, int, int, int]:
        """The decision from numpy columns (match, :func:`~motor._fast.columns.gather`,
        then :meth:`_pick_time` or :meth:`_pick_tokens`): (position, cost, the chosen one's
        cached blocks per tier). ``start``: the rotation's offset; ``last``: the session's
        last endpoint."""
        r = self.router
        hashes = request.block_hashes
        m = r.match(hashes, request.model) if hashes is not None and len(hashes) else None
        # one worker: this process's counters; several: the shared table (load_columns)
        local = getattr(cands[0], "shared", None) is None
        slots, overlap, loads, missing, fav = gather(cands, r.slot_map, m, local, last)
        slotted = True
        if missing:                 # an endpoint new to KV routing: give it a slot
            keys = [e.key for e in cands]
            slotted = r.give_slots(keys)
            slots, overlap, loads, missing, fav = gather(
                cands, r.slot_map if slotted else r.load_alone(keys),
                m if slotted else None, local, last)    # no slot left for one: load alone
        cols = (loads[0], loads[1], loads[2]) if loads is not None else load_columns(cands)
        if fav < 0 and request.session is not None and self.sessions is not None:
            start = session_start(request.session)   # the same endpoint in every worker
        if self.time_cost:
            pos, cost = self._pick_time(cands, request, overlap, slots, cols, start, fav)
            if not slotted:
                request.ttft_obs = None     # slot 0's rates stood in for all: not learned
        else:
            pos, cost = self._pick_tokens(cands, request, overlap, cols, start, fav)
        o0, o1, o2 = overlap[pos].tolist()
        return pos, cost, o0, o1, o2

    def _session_last(self, request: RequestInfo) -> str | None:
        """Key of the endpoint that served ``request``'s session last (None: no session,
        affinity off, or not remembered)."""
        s = request.session
        if s is None or self.sessions is None:
            return None
        return self.sessions.last(s)

    def _pick_time(self, cands: list[EndpointState], request: RequestInfo,
                   overlap: np.ndarray, slots: np.ndarray, cols: Columns, start: int,
                   fav: int = -1) -> tuple[int, float]:
        """Argmin of the predicted TTFT (seconds); sets ``request.ttft_obs``. ``cols``: the
        candidates' (prefill tokens, decode tokens, requests) in flight; ``fav``: the
        session's endpoint (position), credited ``credit_tokens`` at its prefill rate."""
        r = self.router
        queued, _, running = cols
        if getattr(cands[0], "shared", None) is not None:
            eng = engine_columns(cands, time.time(), self.engine_max_age_s)
            if eng is not None:
                waiting, eng_running = eng
                running = np.maximum(running, waiting + eng_running)
                queued = np.maximum(queued, waiting * self.mean_uncached)
        rates = self.rates.rates(slots)
        credit = self.session_credit_tokens * float(rates[fav, 1]) if fav >= 0 else 0.0
        pos, ttft = pick_ttft(overlap, request.prompt_tokens, r.block_size, self.tier_credit,
                              queued, running, rates, None, self.chunk_tokens, start,
                              favored=fav, favored_credit=credit,
                              stall_weight=self.stall_weight)
        o0, o1, o2 = overlap[pos].tolist()
        c0, c1, c2 = self._credit
        uncached = max(0.0, request.prompt_tokens - r.block_size * (c0 * o0 + c1 * o1 + c2 * o2))
        self.mean_uncached += 0.05 * (uncached - self.mean_uncached)
        if self.learn:
            request.ttft_obs = (int(slots[pos]), self.rates.features(
                float(queued[pos]), uncached, float(running[pos])))
        if logger.isEnabledFor(logging.DEBUG):
            self._log_time(cands, request, overlap, queued, running, rates, pos, ttft, fav,
                           credit)
        return pos, ttft

    def _log_time(self, cands: list[EndpointState], request: RequestInfo, overlap: np.ndarray,
                  queued: np.ndarray, running: np.ndarray, rates: np.ndarray, pos: int,
                  ttft: float, fav: int = -1, credit: float = 0.0) -> None:
        bs = self.router.block_size
        terms = []
        for j, e in enumerate(cands):
            step_s, pre_s, dec_s = rates[j].tolist()
            unc = max(0.0, request.prompt_tokens - bs * float(self.tier_credit @ overlap[j]))
            x = self.rates.features(float(queued[j]), unc, float(running[j]))
            terms.append(
                f"{e.key}: cached blocks {overlap[j].tolist()}, uncached {unc:.0f} tokens x "
                f"{1e6 * pre_s:.1f} us = {1e3 * pre_s * unc:.1f} ms, queued {queued[j]:.0f} "
                f"tokens = {1e3 * pre_s * queued[j]:.1f} ms, {x[0]:.0f} step(s) x "
                f"({1e3 * step_s:.2f} ms + {running[j]:.0f} running x {1e6 * dec_s:.0f} us) = "
                f"{1e3 * (x[0] * step_s + x[1] * dec_s):.1f} ms, "
                f"ttft {1e3 * (x[0] * step_s + x[1] * dec_s + x[2] * pre_s):.1f} ms, "
                f"stall {self.stall_weight:g} x {running[j]:.0f} running x "
                f"{1e3 * pre_s * unc:.1f} ms = "
                f"{1e3 * self.stall_weight * running[j] * pre_s * unc:.1f} ms")
        logger.debug("kv_affinity: %d prompt tokens -> %s predicted ttft %.1f ms; %s%s",
                     request.prompt_tokens, cands[pos].key, 1e3 * ttft, "; ".join(terms),
                     f"; session credit {1e3 * credit:.1f} ms to {cands[fav].key}"
                     if fav >= 0 else "")

    def _pick_tokens(self, cands: list[EndpointState], request: RequestInfo,
                     overlap: np.ndarray, cols: Columns, start: int,
                     fav: int = -1) -> tuple[int, float]:
        """Argmin of the cost in prompt-token equivalents (``kv.cost: tokens``); ``cols``: the
        candidates' (prefill tokens, decode tokens, requests) in flight; ``fav``: the
        session's endpoint (position), credited ``credit_tokens``."""
        r = self.router
        pw, dw, qp, guard, guard_min = self._score_cfg
        prefill, decode, queue = cols
        pos, cost = score_pick(overlap, request.prompt_tokens, r.block_size, self.tier_credit,
                               prefill, decode, queue, None, pw, dw, qp, guard, start,
                               favored=fav,
                               favored_credit=self.session_credit_tokens if fav >= 0 else 0.0,
                               guard_min_load=guard_min)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv_affinity: %d prompt tokens -> %s cost %.0f prompt-token equivalents; "
                "candidates %s%s", request.prompt_tokens, cands[pos].key, cost, ", ".join(
                    f"{e.key}: overlap blocks {overlap[j].tolist()} prefill {prefill[j]:.0f} "
                    f"tokens, decode {decode[j]:.0f} tokens, queue {queue[j]:.0f} requests"
                    for j, e in enumerate(cands)),
                f"; session credit {self.session_credit_tokens:.0f} prompt-token equivalents "
                f"to {cands[fav].key}" if fav >= 0 else "")
        return pos, cost

    def watch(self, ep: EndpointState, info: RequestInfo) -> Callable[[float], None] | None:
        """The learner of ``ep``'s rates for this attempt (``kv.cost: time``, ``ttft.learn``)."""
        o = info.ttft_obs
        if o is None:
            return None
        return TtftWatch(self.rates, o[0], o[1])

    def routed(self, ep: EndpointState, request: RequestInfo) -> None:
        """The request went to ``ep`` (approximate mode remembers it, and the session table
        its session's endpoint)."""
        self.router.routed(ep, request.model, request.block_hashes)
        if request.session is not None and self.sessions is not None:
            last = self.sessions.last(request.session)
            (self._session_new if last is None else
             self._session_kept if last == ep.key else self._session_moved).inc()
            self.sessions.routed(request.session, ep.key)
            if self.on_session is not None:
                self.on_session(request.session, ep)
