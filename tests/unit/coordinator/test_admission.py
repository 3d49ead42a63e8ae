"""Admission control: cap, bounded queue, strict classes, fair turns between keys, timeouts."""
from __future__ import annotations

import asyncio

import pytest

from motor.coordinator.admission import Admission, Refused


def run(coro):
    return asyncio.run(coro)


async def _enter_all(adm, reqs, log):
    """Start one waiter per (key, class) of ``reqs``; each appends its label when admitted."""
    async def one(label, key, cls):
        await adm.enter(key, cls)
        log.append(label)
    tasks = [asyncio.create_task(one(lbl, k, c)) for lbl, k, c in reqs]
    await asyncio.sleep(0)
    return tasks


def test_enters_at_once_below_the_cap_then_queues():
    async def main():
        adm = Admission(2, 10, 5.0, ["interactive", "batch"])
        await adm.enter("a", 0)
        await adm.enter("a", 0)
        assert adm.in_flight == 2 and adm.admitted_now == 2
        log: list[str] = []
        tasks = await _enter_all(adm, [("x", "a", 0)], log)
        assert adm.queued == 1 and log == []
        adm.leave()
        await asyncio.gather(*tasks)
        assert log == ["x"] and adm.in_flight == 2 and adm.queued == 0
        assert adm.admitted_waited == 1
    run(main())


def test_higher_class_first_and_keys_take_turns_by_weight():
    async def main():
        adm = Admission(1, 100, 5.0, ["interactive", "batch"], weights={"heavy": 2})
        await adm.enter("seed", 0)
        log: list[str] = []
        reqs = [(f"b{i}", "bulk", 1) for i in range(3)]            # batch, queued first
        reqs += [(f"h{i}", "heavy", 0) for i in range(4)]          # interactive, weight 2
        reqs += [(f"l{i}", "light", 0) for i in range(2)]          # interactive, weight 1
        tasks = await _enter_all(adm, reqs, log)
        for _ in range(len(reqs)):
            adm.leave()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        # interactive before batch; heavy gets 2 per turn, light 1
        assert log == ["h0", "h1", "l0", "h2", "h3", "l1", "b0", "b1", "b2"]
    run(main())


def test_flooding_key_does_not_delay_another_keys_request():
    async def main():
        adm = Admission(1, 100, 5.0, ["default"])
        await adm.enter("seed", 0)
        log: list[str] = []
        tasks = await _enter_all(adm, [(f"f{i}", "flood", 0) for i in range(20)]
                                 + [("victim", "quiet", 0)], log)
        adm.leave()
        await asyncio.sleep(0)
        adm.leave()
        await asyncio.sleep(0)
        assert log == ["f0", "victim"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert adm.queued == 0
    run(main())


def test_queue_full_and_queue_timeout_are_refused_with_retry_after():
    async def main():
        adm = Admission(1, 1, 0.05, ["default"])
        await adm.enter("k", 0)
        waiting = asyncio.create_task(adm.enter("k", 0))
        await asyncio.sleep(0)
        with pytest.raises(Refused) as full:
            await adm.enter("k", 0)
        assert full.value.reason == "queue full" and full.value.retry_after_s >= 1
        with pytest.raises(Refused) as late:
            await waiting
        assert late.value.reason == "queue timeout"
        assert adm.queued == 0 and adm.in_flight == 1
        assert adm.refused == {"queue full": 1, "displaced": 0, "queue timeout": 1,
                               "predicted wait": 0}
        adm.leave()
        assert adm.in_flight == 0
    run(main())


def test_cancelled_waiter_takes_no_slot():
    async def main():
        adm = Admission(1, 10, 5.0, ["default"])
        await adm.enter("k", 0)
        gone = asyncio.create_task(adm.enter("k", 0))
        log: list[str] = []
        tasks = await _enter_all(adm, [("next", "k", 0)], log)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert adm.queued == 1
        adm.leave()
        await asyncio.gather(*tasks)
        assert log == ["next"] and adm.in_flight == 1
    run(main())


def test_granted_then_cancelled_gives_the_slot_back():
    async def main():
        adm = Admission(1, 10, 5.0, ["default"])
        await adm.enter("k", 0)
        t = asyncio.create_task(adm.enter("k", 0))
        await asyncio.sleep(0)
        adm.leave()          # granted to t, which is cancelled before it runs
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        assert adm.in_flight == 0 and adm.queued == 0
    run(main())


def test_unknown_class_is_served_last():
    adm = Admission(1, 1, 1.0, ["interactive", "batch"])
    assert adm.class_of("interactive") == 0 and adm.class_of("nope") == 1
    assert adm.class_of(None) == 1


def test_full_queue_of_a_lower_class_makes_room_for_a_higher_one():
    async def main():
        adm = Admission(1, 3, 5.0, ["interactive", "batch"])
        await adm.enter("seed", 0)
        log: list[str] = []
        batch = [("b0", "bulk", 1), ("b1", "bulk", 1), ("o0", "other", 1)]
        tasks = await _enter_all(adm, batch, log)
        assert adm.queued == 3
        # an interactive request at a full queue: the newest waiter of the longest batch key
        # queue (b1) is refused at once and the interactive one waits in its place
        inter = await _enter_all(adm, [("i0", "chat", 0)], log)
        assert adm.queued == 3
        with pytest.raises(Refused) as out:
            await tasks[1]
        assert out.value.reason == "displaced" and out.value.retry_after_s >= 1
        # another batch request finds no lower class to displace: refused itself
        with pytest.raises(Refused) as full:
            await adm.enter("bulk", 1)
        assert full.value.reason == "queue full"
        assert adm.refused == {"queue full": 1, "displaced": 1, "queue timeout": 0,
                               "predicted wait": 0}
        for _ in range(3):
            adm.leave()
            await asyncio.sleep(0)
        await asyncio.gather(tasks[0], tasks[2], *inter)
        assert log == ["i0", "b0", "o0"] and adm.queued == 0 and adm.in_flight == 1
    run(main())
