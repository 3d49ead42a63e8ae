"""``least_load``: the candidate with the least work in flight.

Optimises: queueing delay when requests differ in size. Inputs per endpoint:
in-flight requests and in-flight tokens (prompt + max_tokens of requests this
coordinator has in flight there, summed over all workers when ``coordinator.workers``
> 1, :mod:`motor.coordinator.loadtable`). Cost = in-flight tokens + ``request_weight_tokens``
x in-flight requests. Settings: ``request_weight_tokens`` (default 256 tokens: a
request costs at least this much). Tie-break: rotation, so equal loads spread
like round robin.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from motor.coordinator.policy.base import Policy, RequestInfo

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointState


class LeastLoad(Policy):
    name = "least_load"

    def __init__(self, request_weight_tokens: int = 256) -> None:
        self.request_weight_tokens = request_weight_tokens
        self._next = 0

    def pick(self, candidates: list[EndpointState], request: RequestInfo,
             exclude: set[EndpointState] | None = None) -> EndpointState | None:
        n = len(candidates)
        if n == 0:
            return None
        start = self._next
        self._next = start + 1
        w = self.request_weight_tokens
        best = None
        best_cost = 0
        for i in range(n):
            ep = candidates[(start + i) % n]
            if exclude and ep in exclude:
                continue
            sh = ep.shared
            if sh is None:
                cost = ep.inflight_tokens + w * ep.inflight
            else:  # workers > 1: summed over all workers' rows of the shared load table
                n_req, tokens, _, _ = sh.totals()
                cost = tokens + w * n_req
            if best is None or cost < best_cost:
                best, best_cost = ep, cost
        request.cost = best_cost
        return best if best is not None else candidates[start % n]
