"""The simulator's blocks under a LoRA adapter: they hash apart from the base model's and
from other adapters' (no cache hit across them, as in vLLM, whose block hashes carry the
LoRA name), and their ``BlockStored`` events name the adapter (``lora_name``), which the
coordinator's KV index salts its own hashes with (case N12)."""
from __future__ import annotations

import numpy as np

from motor._fast.hashing import block_hashes
from motor.protocol.kv_events import adapter_salt
from motor.sim.engine import Engine, EngineConfig
from motor.sim.kv import ROOT_PARENT, lora_root
from motor.sim.kv_events import encode_events

from .test_engine import _finish_all, _req, _run


def test_an_adapters_blocks_hash_apart_and_their_events_name_it():
    events: list[tuple] = []

    async def main():
        eng = Engine(EngineConfig(time_scale=0, block_size=16, record_kv_events=True),
                     on_kv_events=events.extend)
        eng.start()
        prompt = list(range(100))
        out = []
        for rid, lora in (("base", None), ("sql", "sql-lora"), ("sql2", "sql-lora"),
                          ("chat", "chat-lora"), ("base2", None)):
            r = _req(rid, prompt, 2)
            r.lora_name = lora
            eng.submit(r)
            await _finish_all(eng, [r])
            out.append(r.seqs[0].cached_tokens)
        await eng.stop()
        return out
    cached = _run(main())
    # only a second request under the same name (or the base model) finds the blocks
    assert cached == [0, 0, 96, 0, 96]
    assert lora_root(None) == ROOT_PARENT and lora_root("sql-lora") != lora_root("chat-lora")
    stored = [e for e in events if e[0] == "stored"]
    assert [e[4] if len(e) > 4 else None for e in stored] == [None, "sql-lora", "chat-lora"]
    wire = encode_events(stored, 16)
    assert [w["lora_name"] for w in wire] == [None, "sql-lora", "chat-lora"]
    # the coordinator hashes an adapter's tokens with the adapter's salt
    salted = block_hashes(np.asarray(stored[1][3], dtype=np.uint32), 16, 0,
                          adapter_salt("sql-lora"))
    plain = block_hashes(np.asarray(stored[0][3], dtype=np.uint32), 16, 0, 0)
    assert stored[0][3] == stored[1][3] and salted.tolist() != plain.tolist()
