"""The index-size gauges follow the index after a burst of batches (found against real vLLM:
two batches within the 0.5 s throttle left ``motor_coordinator_kv_index_blocks`` at the size
before the second one until some later batch came)."""
from __future__ import annotations

import asyncio

from motor.config.schema import KvRoutingConfig
from motor.coordinator import metrics
from motor.coordinator.kv import KvRouter
from motor.protocol.kv_events import BlockStored, EventBatch


def _blocks() -> float:
    return metrics.KV_INDEX_BLOCKS.labels("exact")._value.get()


def _store(router: KvRouter, slot: int, seq: int, tokens: list[int]) -> None:
    bs = router.block_size
    n = len(tokens) // bs
    router.ingest.apply(slot, seq, EventBatch(0.0, [BlockStored(
        [1000 * seq + j for j in range(n)], None, tokens[:n * bs], bs, "GPU")], 0))
    router.update_gauges()


def test_a_throttled_refresh_is_followed_by_a_trailing_one() -> None:
    async def main() -> tuple[float, float, float]:
        router = KvRouter(KvRoutingConfig(block_size=16))
        slot = router.slot("e0")
        router.ingest.add_slot(slot, "e0")
        _store(router, slot, 0, list(range(32)))          # 2 blocks, gauges refreshed
        first = _blocks()
        _store(router, slot, 1, list(range(100, 100 + 64)))  # 4 more, within 0.5 s: throttled
        _store(router, slot, 2, list(range(200, 200 + 16)))  # 1 more, still throttled
        throttled = _blocks()
        await asyncio.sleep(0.7)                           # the trailing refresh ran
        return first, throttled, _blocks()

    first, throttled, after = asyncio.run(main())
    assert first == 2 and throttled == 2
    assert after == 7


def test_without_a_loop_the_throttle_just_skips() -> None:
    router = KvRouter(KvRoutingConfig(block_size=16))
    slot = router.slot("e0")
    router.ingest.add_slot(slot, "e0")
    _store(router, slot, 0, list(range(16)))
    _store(router, slot, 1, list(range(50, 66)))        # no running loop: nothing scheduled
    assert not router._gauges_pending
    router.update_gauges(force=True)
    assert _blocks() == 2
