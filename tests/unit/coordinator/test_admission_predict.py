"""Admission's prediction: refusal at arrival from the predicted wait, slots held for higher
classes, per-class longest waits (motor/coordinator/admission.py, module doc).

The clock is the test's own: the rates are exponentially weighted over RATE_TAU_S, so a
steady warm-up of known period and concurrency gives known figures (service time S, capacity
max_in_flight / S, the higher classes' demand)."""
from __future__ import annotations

import asyncio

import pytest

from motor.coordinator.admission import MIN_ENDS, Admission, Refused


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def warm(adm: Admission, clock: Clock, per_cycle: int, cycles: int = 40, cls: int = 0,
         period_s: float = 0.5) -> None:
    """Steady load of class ``cls``: ``per_cycle`` requests in flight, each ``period_s``
    long, one ending and the next entering every ``period_s / per_cycle`` (S = period_s,
    ``per_cycle / period_s`` requests/s); then they all end."""
    started: list[float] = []

    async def main() -> None:
        for _ in range(per_cycle):
            await adm.enter("warm", cls)
            started.append(clock())
            clock.t += period_s / per_cycle
        for _ in range(cycles * per_cycle):
            adm.leave(cls, started.pop(0))
            await adm.enter("warm", cls)
            started.append(clock())
            clock.t += period_s / per_cycle
        for _ in range(per_cycle):
            adm.leave(cls, started.pop(0))
    asyncio.run(main())
    assert adm.in_flight == 0 and adm._ends_n >= MIN_ENDS


def test_no_prediction_before_enough_requests_ended():
    async def main():
        adm = Admission(1, 10, 5.0, ["default"], max_wait_s={"default": 0.05}, predict=True)
        await adm.enter("k", 0)
        assert adm.predicted_wait_s(0) == 0.0
        with pytest.raises(Refused) as e:        # it waited its class's 50 ms, then refused
            await adm.enter("k", 0)
        assert e.value.reason == "queue timeout"
        assert adm.refused["predicted wait"] == 0 and adm.refused["queue timeout"] == 1
    asyncio.run(main())


def test_a_request_predicted_to_wait_past_its_class_budget_is_refused_at_once():
    clock = Clock()
    adm = Admission(2, 10, 30.0, ["interactive", "batch"],
                    max_wait_s={"interactive": 0.1}, predict=True, clock=clock)
    warm(adm, clock, per_cycle=2)           # S = 0.5 s, capacity 2 / 0.5 = 4 requests/s

    async def main():
        await adm.enter("a", 0)
        await adm.enter("a", 0)             # both slots taken
        # the next slot is expected in 1 / 4 s = 250 ms > the interactive budget of 100 ms
        assert adm.predicted_wait_s(0) == pytest.approx(0.25, rel=0.2)
        with pytest.raises(Refused) as e:
            await adm.enter("a", 0)
        assert e.value.reason == "predicted wait" and e.value.retry_after_s == 1
        assert adm.queued == 0 and adm.in_flight == 2
    asyncio.run(main())


def test_lower_class_is_refused_at_once_while_higher_demand_takes_the_capacity():
    clock = Clock()
    adm = Admission(4, 10, 30.0, ["interactive", "batch"], predict=True, clock=clock)
    warm(adm, clock, per_cycle=4)           # S = 0.5 s, capacity 8 requests/s

    async def main():
        for _ in range(4):
            await adm.enter("i", 0)         # every slot interactive
        # then interactive arrivals at 40 requests/s for 1 s: they queue (budget 30 s)
        waiting = []
        for _ in range(40):
            clock.t += 0.025
            waiting.append(asyncio.ensure_future(adm.enter("i", 0)))
            await asyncio.sleep(0)
        assert adm.queued == 10             # then "queue full"
        assert adm.predicted_wait_s(1) == float("inf")
        for t in waiting:                   # those clients go away, one request ends:
            t.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        adm.leave(0)
        assert adm.in_flight == 3 and adm.queued == 0
        # a slot is free, yet a batch request is told at once that it will not get one:
        # the interactive demand (40/s) is above the capacity (8/s)
        with pytest.raises(Refused) as e:
            await adm.enter("b", 1)
        assert e.value.reason == "predicted wait"
        assert e.value.retry_after_s == 30      # at most queue_timeout_s
        await adm.enter("i", 0)                 # the interactive class takes it
        assert adm.in_flight == 4
    asyncio.run(main())


def test_free_slots_are_held_for_the_higher_class_expected_demand():
    clock = Clock()
    adm = Admission(8, 10, 30.0, ["interactive", "batch"], predict=True, clock=clock)
    # interactive: 2 in flight for 0.5 s, 4 requests/s: it is expected to hold L = 2 slots;
    # R = ceil(L + sqrt(L)) = 4 stay free for it (3 or 4 with the rates' ripple)
    warm(adm, clock, per_cycle=2)

    _, held = adm._held(1, adm._service(clock())[1], clock())
    assert held in (3, 4)

    async def main():
        for _ in range(8 - held):
            await adm.enter("b", 1)         # batch requests take the slots not held
        assert adm.in_flight == 8 - held
        late = asyncio.ensure_future(adm.enter("b", 1))   # one more would eat a held slot
        await asyncio.sleep(0)
        assert not late.done() and adm.queued == 1 and adm.in_flight == 8 - held
        # an interactive request takes a held slot at once, past the waiting batch one
        await adm.enter("i", 0)
        assert adm._in_flight_by == [1, 8 - held]
        # the interactive one ends: its slot is held again, the batch waiter keeps waiting
        adm.leave(0)
        await asyncio.sleep(0)
        assert not late.done() and adm.in_flight == 8 - held
        # ... until the interactive demand has faded: 10 s later (5 x RATE_TAU_S), the
        # next batch request to end hands its slot on
        clock.t += 10.0
        adm.leave(1)
        await asyncio.wait_for(late, 1.0)
        assert adm._in_flight_by == [0, 8 - held]
        assert adm.refused["predicted wait"] == 0
    asyncio.run(main())


def test_each_class_waits_at_most_its_own_longest_wait():
    async def main():
        adm = Admission(1, 10, 5.0, ["interactive", "batch"],
                        max_wait_s={"interactive": 0.03})
        await adm.enter("k", 1)
        batch = asyncio.ensure_future(adm.enter("b", 1))
        with pytest.raises(Refused) as e:
            await adm.enter("i", 0)         # 30 ms, not the 5 s of queue_timeout_s
        assert e.value.reason == "queue timeout"
        assert not batch.done()             # batch still waits (5 s)
        adm.leave(1)
        await asyncio.wait_for(batch, 1.0)
        assert adm.in_flight == 1
    asyncio.run(main())


def test_an_idle_spell_does_not_inflate_the_prediction():
    # the mean time in flight is measured per request: ten idle seconds change nothing, and
    # a burst after them is predicted as before (a rate of ends would have faded to ~0)
    clock = Clock()
    adm = Admission(2, 10, 30.0, ["interactive", "batch"],
                    max_wait_s={"interactive": 0.4}, predict=True, clock=clock)
    warm(adm, clock, per_cycle=2)           # S = 0.5 s, capacity 4 requests/s
    clock.t += 10.0

    async def main():
        await adm.enter("a", 0)
        await adm.enter("a", 0)
        assert adm.predicted_wait_s(0) == pytest.approx(0.25, rel=0.2)
        waiting = asyncio.ensure_future(adm.enter("a", 0))   # 0.25 s < 0.4 s: it queues
        await asyncio.sleep(0)
        assert not waiting.done() and adm.queued == 1
        adm.leave(0, clock())
        assert await waiting == 0.0            # the fake clock did not move
    asyncio.run(main())
