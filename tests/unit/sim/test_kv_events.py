"""KV events on ZMQ in vLLM's wire format: PUB stream, replay ROUTER, event fields."""
from __future__ import annotations

import msgpack
import pytest
import zmq

from motor.sim.kv import block_hashes
from motor.sim.kv_events import offset_endpoint

from .helpers import SimThread, get_json, post_json, request


@pytest.fixture
def kv_sim(model_dir):
    with SimThread(model_dir, engine={"time_scale": 0, "num_gpu_blocks": 8, "max_model_len": 128,
                                      "block_size": 16},
                   kv_events_endpoint="tcp://127.0.0.1:0",
                   kv_events_replay_endpoint="tcp://127.0.0.1:0", kv_events_topic="kv") as s:
        yield s


def _replay(endpoint: str, start: int) -> list[list[bytes]]:
    ctx = zmq.Context()
    try:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVTIMEO, 5000)
        d.connect(endpoint)
        d.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = d.recv_multipart()
            if frames[2] == b"\xff" * 8:
                assert frames == [b"", b"", b"\xff" * 8, b""]
                break
            out.append(frames[1:])
        d.close()
        return out
    finally:
        ctx.term()


def _events(msgs: list[list[bytes]]) -> list[dict]:
    out = []
    for topic, seq8, payload in msgs:
        assert topic == b"kv" and len(seq8) == 8
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        out.extend(events)
    return out


def test_offset_endpoint():
    assert offset_endpoint("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset_endpoint("tcp://*:0", 1) == "tcp://*:*"
    assert offset_endpoint("ipc:///tmp/x", 3) == "ipc:///tmp/x"


def test_block_stored_removed_cleared_via_replay(kv_sim):
    st = get_json(kv_sim.port, "/admin/stats")["kv_events"]
    sources = get_json(kv_sim.port, "/kv_event_sources")
    assert sources["0"]["endpoint"] == st["endpoint"] and sources["0"]["topic"] == "kv"
    prompt = "A" * 20 + "B" * 20  # 40 tokens: 2 full blocks of 16 are computed
    status, d = post_json(kv_sim.port, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200
    evs = _events(_replay(st["replay_endpoint"], 0))
    stored = [e for e in evs if e["type"] == "BlockStored"]
    assert len(stored) == 1
    e = stored[0]
    ids = list(prompt.encode())
    assert e["block_hashes"] == block_hashes(ids, 16)
    assert e["parent_block_hash"] is None and e["token_ids"] == ids[:32]
    assert e["block_size"] == 16 and e["medium"] == "GPU"
    assert e["lora_id"] is None and "lora_name" in e
    # fill the 8-block cache with other prompts: the first prompt's blocks get evicted
    for k in range(4):
        post_json(kv_sim.port, "/v1/completions", {"prompt": chr(0x61 + k) * 40, "max_tokens": 1})
    msgs = _replay(st["replay_endpoint"], 0)
    seqs = [int.from_bytes(m[1], "big") for m in msgs]
    assert seqs == list(range(len(seqs)))
    removed = [h for ev in _events(msgs) if ev["type"] == "BlockRemoved" for h in ev["block_hashes"]]
    assert set(e["block_hashes"]) <= set(removed)
    assert all(ev["medium"] == "GPU" for ev in _events(msgs) if ev["type"] == "BlockRemoved")
    # replay from a later seq gives only the tail
    assert len(_replay(st["replay_endpoint"], seqs[-1])) == 1
    status, _, _ = request(kv_sim.port, "POST", "/reset_prefix_cache")
    assert status == 200
    last = _events(_replay(st["replay_endpoint"], seqs[-1] + 1))
    assert last == [{"type": "AllBlocksCleared"}]


def test_pub_socket_delivers_batches(kv_sim):
    st = get_json(kv_sim.port, "/admin/stats")["kv_events"]
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(st["endpoint"])
        got = None
        for k in range(50):  # the subscription takes a moment to reach the PUB socket
            post_json(kv_sim.port, "/v1/completions", {"prompt": f"{k:03d}" * 12, "max_tokens": 1})
            if sub.poll(100):
                got = sub.recv_multipart()
                break
        assert got is not None, "no KV event batch arrived"
        topic, seq8, payload = got
        assert topic == b"kv"
        ts, events, rank = msgpack.unpackb(payload)
        assert events and {e["type"] for e in events} <= {"BlockStored", "BlockRemoved"}
        sub.close()
    finally:
        ctx.term()
