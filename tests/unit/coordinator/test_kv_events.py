"""Decoding of engine KV event batches (vLLM map and array forms, SGLang) and addresses."""
from __future__ import annotations

import msgpack
import pytest

from motor.errors import WireError
from motor.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventsAddress,
    UnknownEvent,
    decode_batch,
    split_message,
    split_replay,
    subscriber_address,
    tier_of_medium,
)

# the real vLLM 0.32 output of ../shared/real-engine/README.md section 4 (token ids shortened)
VLLM_MAP = [1.5, [
    {"type": "BlockStored", "block_hashes": [9792370900860081027, 11607786706065288645],
     "parent_block_hash": None, "token_ids": list(range(64)), "block_size": 32, "lora_id": None,
     "medium": "GPU", "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
     "kv_cache_spec_kind": "full_attention"},
    {"type": "BlockRemoved", "block_hashes": [12296492276662415096], "medium": "GPU",
     "group_idx": 0},
    {"type": "AllBlocksCleared"},
], 0]


def test_vllm_map_form() -> None:
    b = decode_batch(msgpack.packb(VLLM_MAP))
    assert b.ts == 1.5 and b.dp_rank == 0
    s, r, c = b.events
    assert s == BlockStored([9792370900860081027, 11607786706065288645], None, list(range(64)), 32,
                            "GPU", None)
    assert r == BlockRemoved([12296492276662415096], "GPU")
    assert c == AllBlocksCleared()


def test_vllm_array_form_with_trailing_defaults_trimmed() -> None:
    payload = msgpack.packb([2.0, [["BlockStored", [1, 2], 7, list(range(8)), 4],
                                   ["BlockRemoved", [1]], ["AllBlocksCleared"]], 1])
    b = decode_batch(payload)
    assert b.events == [BlockStored([1, 2], 7, list(range(8)), 4, None, None),
                        BlockRemoved([1], None), AllBlocksCleared()]
    assert b.dp_rank == 1


def test_sglang_negative_hashes_null_rank_and_medium() -> None:
    payload = msgpack.packb([3.0, [{"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": -9,
                                    "token_ids": [1, 2], "block_size": 2, "lora_id": None,
                                    "medium": "CPU_PINNED"}], None])
    b = decode_batch(payload)
    assert b.dp_rank is None
    assert b.events[0].block_hashes == [-5] and b.events[0].parent_block_hash == -9
    assert tier_of_medium(b.events[0].medium) == 1


def test_bytes_hashes_and_unknown_type_stay_visible() -> None:
    payload = msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]},
                                   {"type": "SomethingNew", "x": 1}], 0], use_bin_type=True)
    b = decode_batch(payload)
    assert b.events == [BlockRemoved([b"\x01" * 32], None), UnknownEvent("SomethingNew")]


@pytest.mark.parametrize("medium,tier", [(None, 0), ("GPU", 0), ("CPU", 1), ("cpu", 1),
                                         ("CPU_PINNED", 1), ("STORAGE", 2), ("DISK", 2),
                                         ("EXTERNAL", 2), ("FLOPPY", None)])
def test_medium_to_tier(medium: str | None, tier: int | None) -> None:
    assert tier_of_medium(medium) == tier


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0, 5, 0]),
                                     msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                                           "parent_block_hash": None,
                                                           "token_ids": [1], "block_size": 2}], 0]),
                                     msgpack.packb([1.0, [42], 0])])
def test_malformed_batches_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_frames() -> None:
    assert split_message([b"kv", (5).to_bytes(8, "big"), b"p"]) == (b"kv", 5, b"p")
    assert split_replay([b"", b"kv", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")
    assert split_replay([b"", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")  # before vLLM 0.26
    assert split_replay([b"", b"", b"\xff" * 8, b""])[0] == -1
    with pytest.raises(WireError):
        split_message([b"x"])


def test_address_forms() -> None:
    a = KvEventsAddress.parse("tcp://127.0.0.1:5557;replay=tcp://127.0.0.1:5558")
    assert a == KvEventsAddress("tcp://127.0.0.1:5557", False, "tcp://127.0.0.1:5558")
    assert a.for_dp_rank(2) == KvEventsAddress("tcp://127.0.0.1:5559", False, "tcp://127.0.0.1:5560")
    b = KvEventsAddress.parse("bind:tcp://127.0.0.1:5557")
    assert b.bind and str(b) == "bind:tcp://127.0.0.1:5557"
    assert KvEventsAddress.parse("ipc:///tmp/x").for_dp_rank(1).endpoint == "ipc:///tmp/x"
    for bad in ("http://x:1", "tcp://h:1;nope=1"):
        with pytest.raises(ValueError):
            KvEventsAddress.parse(bad)


def test_bind_connect_direction_per_engine_and_endpoint_form() -> None:
    # vLLM: '*' binds (we connect, wildcard replaced by the engine host), explicit host connects
    assert subscriber_address("vllm", "tcp://*:5557", "10.0.0.2") == \
        KvEventsAddress("tcp://10.0.0.2:5557", False, None)
    assert subscriber_address("vllm", "tcp://127.0.0.1:5557", "h").bind is True
    assert subscriber_address("vllm", "tcp://0.0.0.0:5557", "h").bind is True
    assert subscriber_address("vllm", "ipc:///tmp/kv", "h").bind is False
    # SGLang binds 0.0.0.0 too; motor sim always binds
    assert subscriber_address("sglang", "tcp://0.0.0.0:5557", "h") == \
        KvEventsAddress("tcp://h:5557", False, None)
    assert subscriber_address("sim", "tcp://127.0.0.1:5557", "h").bind is False


@pytest.mark.parametrize("kv_cfg, expected", [
    # vLLM binds a wildcard host: motor connects to the engine's host
    ({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"},
     "tcp://10.0.0.5:5557"),
    # vLLM connects to an explicit host: motor binds there
    ({"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5600",
      "replay_endpoint": "tcp://*:5601"},
     "bind:tcp://127.0.0.1:5600;replay=tcp://10.0.0.5:5601"),
    ({"enable_kv_cache_events": True}, "tcp://10.0.0.5:5557"),          # vLLM's default endpoint
    ({"enable_kv_cache_events": True, "endpoint": "ipc:///tmp/kv"}, "ipc:///tmp/kv"),
    ({"enable_kv_cache_events": False, "endpoint": "tcp://*:5557"}, None),
    ({"enable_kv_cache_events": True, "publisher": "null"}, None),
])
def test_vllm_node_manager_registers_the_subscriber_address(kv_cfg: dict, expected: str | None) -> None:
    from motor.config.schema import EngineConfig, NodeConfig
    from motor.node_manager.engines import plan_node
    (plan,) = plan_node(NodeConfig(name="n", engines=[EngineConfig(
        name="e", kind="vllm", model="/m", base_port=9000, host="10.0.0.5",
        engine_config={"kv-events-config": kv_cfg})]))
    assert plan.kv_events == expected
    if expected is not None:
        addr = KvEventsAddress.parse(expected)
        assert addr.bind == expected.startswith("bind:")
