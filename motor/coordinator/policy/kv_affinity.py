"""``kv_affinity``: the candidate where the request's prefill is cheapest.

Optimises: TTFT through prefix-cache reuse, without melting the holder of a hot prefix.

Inputs per candidate endpoint ``i``: the request's routing key (token ids of the whole
templated conversation or of the prompt, :mod:`motor.coordinator.tokenize`, hashed
into blocks of ``coordinator.kv.block_size``), the leading blocks of that key cached
on ``i`` per tier (:meth:`motor.coordinator.kv.KvRouter.match`: exact index from KV
events, approximate index from routing history), and this coordinator's in-flight
load on ``i``. The cost, in prompt-token equivalents (:mod:`motor._fast.scoring`)::

    saved_i = block_size * (credit_device * ov_device + credit_host * ov_host
                            + credit_disk * ov_disk)
    load_i  = prefill_weight * uncached prompt tokens in flight on i
              + decode_weight * max_tokens in flight on i
              + queue_penalty_tokens * requests in flight on i
    cost_i  = max(prompt_tokens - saved_i, 0) + load_i

Settings (``coordinator.kv``): ``tier_credit`` (device 1.0, host 0.75, disk 0.25),
``prefill_weight`` 0.25 (a streamed request's uncached tokens are in flight until its
first token, a whole answer's until it ends; the 0.25 dates from when every request's
counted until its end, docs/benchmarks.md), ``decode_weight`` 0.0, ``queue_penalty_tokens`` 64,
``load_guard`` 2.0 (an instance with load > 2 x the other candidates' mean gets no cache
credit, once some load exceeds ``load_guard_min_tokens`` 4096).

Tie-break: lowest cost, then lowest load, then rotation (equal candidates, e.g. with
no cached prefix anywhere, spread like round robin). Excluded endpoints (retries)
are skipped unless nothing else is left. A request that cannot be tokenized is routed
on load alone. Each decision is logged at debug level with its terms.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from motor._fast.scoring import pick as score_pick
from motor.coordinator import metrics
from motor.coordinator.kv.router import KvRouter
from motor.coordinator.loadtable import load_columns
from motor.coordinator.policy.base import Policy, RequestInfo

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
        self._next = 0

    def prepare(self, info: RequestInfo, route: str, body: dict[str, Any]) -> None:
        """Fill ``info.block_hashes`` and ``info.prompt_tokens`` from the request body."""
        key = self.router.request_hashes(route, body)
        if key is not None:
            info.prompt_tokens, info.block_hashes = key
            info.prefill_tokens = info.prompt_tokens

    def pick(self, candidates: list[EndpointState], request: RequestInfo,
             exclude: set[EndpointState] | None = None) -> EndpointState | None:
        if not candidates:
            return None
        cands = [e for e in candidates if e not in exclude] if exclude else candidates
        if not cands:
            cands = candidates
        k = len(cands)
        r = self.router
        c = r.cfg
        overlap = np.zeros((k, 3), dtype=np.int32)
        hashes = request.block_hashes
        if hashes is not None and len(hashes):
            ov = r.match(hashes, request.model)
            overlap[:] = ov[[r.slot(e.key) for e in cands]]
        prefill, decode, queue = load_columns(cands)  # all workers' load when workers > 1
        guard = c.load_guard
        if guard > 0:
            loads = (c.prefill_weight * prefill + c.decode_weight * decode
                     + c.queue_penalty_tokens * queue)
            if loads.max() <= c.load_guard_min_tokens:
                guard = 0.0
        start = self._next
        self._next = start + 1
        pos, cost = score_pick(overlap, request.prompt_tokens, r.block_size, self.tier_credit,
                               prefill, decode, queue, None, c.prefill_weight, c.decode_weight,
                               c.queue_penalty_tokens, guard, start)
        ep = cands[pos]
        ov = overlap[pos]
        cached_blocks = int(ov.sum())
        saved = r.block_size * float(self.tier_credit @ ov)
        request.cached_tokens = min(cached_blocks * r.block_size, request.prompt_tokens)
        request.cost = cost
        request.prefill_tokens = max(0, int(request.prompt_tokens - saved))
        if hashes is not None:
            metrics.KV_PROMPT_TOKENS.inc(request.prompt_tokens)
            metrics.KV_MATCHED_TOKENS.inc(request.cached_tokens)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "kv_affinity: %d prompt tokens -> %s cost %.0f; candidates %s", request.prompt_tokens,
                ep.key, cost, ", ".join(
                    f"{e.key}: overlap blocks {overlap[j].tolist()} prefill {prefill[j]:.0f} "
                    f"decode {decode[j]:.0f} queue {queue[j]:.0f}" for j, e in enumerate(cands)))
        return ep

    def routed(self, ep: EndpointState, request: RequestInfo) -> None:
        """The request went to ``ep`` (approximate mode remembers it)."""
        self.router.routed(ep, request.model, request.block_hashes)
