"""N12: the gateway follows the engines' model lists: a LoRA adapter loaded at run time
becomes routable (only to the engine that has it) and listed, unloaded it is a 404 again, an
engine restarted with another model serves that one; an adapter's KV blocks are never
credited to the base model (motor salts the block hashes of adapter blocks and adapter
requests with the adapter's name, as vLLM does)."""
from __future__ import annotations

import numpy as np
import orjson

from motor.coordinator.kv import KvRouter
from motor.protocol.kv_events import BlockStored, EventBatch
from tests.cases.harness import FB, cluster, http, run_async, wait_for

ADAPTER = {"id": "sql-lora", "object": "model", "root": "/adapters/sql", "parent": "m"}
BASE = {"id": "m", "object": "model", "root": "m", "parent": None}


def _chat(model: str) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2})


@run_async
async def test_adapter_loaded_and_unloaded_at_run_time():
    a, b = FB(), FB()
    a.model_entries, b.model_entries = [BASE], [BASE]
    async with cluster(fbs=[a, b], probe=True, health_check_interval_s=0.05) as (_, gw):
        assert await wait_for(lambda: all(e.models for e in gw.table.endpoints.values()))
        st, _, out = await http(gw.port, "POST", "/v1/chat/completions", _chat("sql-lora"))
        assert st == 404 and orjson.loads(out)["error"]["code"] == 404
        a.model_entries = [BASE, ADAPTER]               # POST /v1/load_lora_adapter on a
        assert await wait_for(lambda: any("sql-lora" in e.models
                                          for e in gw.table.endpoints.values()))
        _, _, out = await http(gw.port, "GET", "/v1/models")
        assert "sql-lora" in [m["id"] for m in orjson.loads(out)["data"]]
        for _ in range(6):
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", _chat("sql-lora"))
            assert st == 200
        assert not [e for e in b.log if b"sql-lora" in e.body]     # only a has the adapter
        assert len([e for e in a.log if b"sql-lora" in e.body]) == 6
        assert "sql-lora" in gw.table.adapters
        a.model_entries = [BASE]                        # unloaded
        assert await wait_for(lambda: not any("sql-lora" in e.models
                                              for e in gw.table.endpoints.values()))
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", _chat("sql-lora"))
        assert st == 404


@run_async
async def test_engine_restarted_with_another_model():
    a, b = FB(), FB()
    async with cluster(fbs=[a, b], probe=True, health_check_interval_s=0.05) as (_, gw):
        assert await wait_for(lambda: all(e.models for e in gw.table.endpoints.values()))
        b.models = ("m2",)                              # b now serves m2 instead of m
        assert await wait_for(lambda: any(e.models == {"m2"}
                                          for e in gw.table.endpoints.values()))
        n_b = len(b.log)
        for _ in range(4):
            st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", _chat("m"))
            assert st == 200
        assert len(b.log) == n_b                        # m no longer goes to b
        st, _, _ = await http(gw.port, "POST", "/v1/chat/completions", _chat("m2"))
        assert st == 200 and len(b.log) == n_b + 1


def test_adapter_blocks_are_not_credited_to_the_base_model():
    router = KvRouter()
    router.adapters.add("sql-lora")
    a = router.slot("a#0")
    prefix = np.random.default_rng(12).integers(0, 150_000, 4096).tolist()
    n_blocks = len(prefix) // router.block_size
    # engine A computed prefix P under the adapter (vLLM's BlockStored with lora_name)
    router.ingest.apply(a, 0, EventBatch(0.0, [BlockStored(
        list(range(1, n_blocks + 1)), None, prefix, router.block_size, "GPU",
        "sql-lora", 1)], 0))

    def matched(model: str) -> int:
        key = router.request_hashes("completions", {"model": model, "prompt": prefix})
        assert key is not None
        return int(router.match(key[1], None)[a].sum())
    assert matched("sql-lora") == n_blocks        # the adapter's own requests: all cached
    assert matched("m") == 0                       # the base model's: nothing credited
    # base blocks, in turn, are not credited to the adapter
    router.ingest.apply(a, 1, EventBatch(0.0, [BlockStored(
        list(range(10_000, 10_000 + n_blocks)), None, prefix, router.block_size, "GPU")], 0))
    assert matched("m") == n_blocks and matched("sql-lora") == n_blocks
    b = router.slot("b#0")
    router.ingest.apply(b, 0, EventBatch(0.0, [BlockStored(
        list(range(20_000, 20_000 + n_blocks)), None, prefix, router.block_size, "GPU")], 0))
    key = router.request_hashes("completions", {"model": "sql-lora", "prompt": prefix})
    assert key is not None and int(router.match(key[1], None)[b].sum()) == 0

