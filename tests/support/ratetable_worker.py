"""A coordinator worker's rate limiting alone in a process (test_ratetable.py): it admits
greedily at every step of a fake clock that the test's processes advance in lockstep."""
from __future__ import annotations

from typing import Any

from motor.coordinator.ratelimit import Limit
from motor.coordinator.ratetable import RateTable, SharedRateLimiter


class StepClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def greedy(table_name: str, worker: int, limits: dict[str, Limit], name: str, t0: float,
           steps: int, step_s: float, barrier: Any, result: Any) -> None:
    """At each of ``steps`` clock values ``t0 + i * step_s`` (all processes at the same one:
    ``barrier``), admit requests of ``name`` until one is refused; ``result[worker]``: how many
    were admitted."""
    table = RateTable.attach(table_name)
    clock = StepClock(t0)
    rl = SharedRateLimiter(limits, Limit(), 1.0, table, worker, clock=clock)
    n = 0
    for i in range(steps):
        barrier.wait()
        clock.t = t0 + i * step_s
        while rl.admit(name, 0) is None:
            n += 1
    result[worker] = n
    table.close()
