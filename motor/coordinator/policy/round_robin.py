"""``round_robin``: each candidate in turn.

Optimises: even spread when requests are alike. Inputs: the candidate list only.
Settings: none. Tie-break: not applicable; the rotation skips excluded endpoints
(a retry never lands on the endpoint that just failed while another exists).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from motor.coordinator.policy.base import Policy, RequestInfo

if TYPE_CHECKING:
    from motor.coordinator.endpoints import EndpointState


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: list[EndpointState], request: RequestInfo,
             exclude: set[EndpointState] | None = None) -> EndpointState | None:
        n = len(candidates)
        if n == 0:
            return None
        start = self._next
        self._next = start + 1
        if not exclude:
            return candidates[start % n]
        for i in range(n):
            ep = candidates[(start + i) % n]
            if ep not in exclude:
                self._next = start + i + 1
                return ep
        return candidates[start % n]
