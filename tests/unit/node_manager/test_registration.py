"""Registration / heartbeat payloads (issue 8 item 5): what an instance registers, and wire
compatibility of the new optional fields in both directions."""
from __future__ import annotations

import orjson

from motor.config.schema import NodeConfig
from motor.node_manager.engines import plan_node
from motor.protocol.instances import Heartbeat, InstanceSpec, NodeRegistration


def node(platform: str = "ascend", **engine: object) -> NodeConfig:
    e = {"name": "e", "model": "/models/m", "served_model_name": "m", "base_port": 9000, **engine}
    return NodeConfig(name="n0", host="10.0.0.5", platform=platform, engines=[e])


def test_vllm_decode_registration_payload() -> None:
    # platform cuda: NixlConnector default (Ascend: tests/unit/node_manager/test_ascend_defaults.py)
    (plan,) = plan_node(node(platform="cuda", kind="vllm", role="decode", dp_size=2, tp_size=4,
                             host="10.0.0.5",
                             engine_config={"kv_events_config": {
                                 "enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": "tcp://*:5557"}}))
    spec = plan.spec()
    d = orjson.loads(spec.model_dump_json())
    assert d == {
        "id": "n0/e/0", "model": "m", "role": "decode", "engine": "vllm",
        "endpoints": [{"host": "10.0.0.5", "port": 9000, "dp_rank": 0, "scheme": "http"},
                      {"host": "10.0.0.5", "port": 9001, "dp_rank": 1, "scheme": "http"}],
        "kv_events": "tcp://10.0.0.5:5557", "bootstrap_port": None, "healthy": False,
        "dp_size": 2, "tp_size": 4,
        "kv_transfer": {"connector": "NixlConnector", "role": "kv_both", "engine_id": "n0/e/0",
                        "kv_port": None},
        "max_inflight": None, "metaserver": False}


def test_metaserver_connector_from_config_and_union_has_none() -> None:
    cfg = {"kv_connector": "MooncakeLayerwiseConnector", "kv_role": "kv_consumer",
           "kv_port": "30100", "kv_connector_extra_config": {"prefill": {"dp_size": 1}}}
    (plan,) = plan_node(node(kind="vllm", role="decode", engine_config={"kv-transfer-config": cfg}))
    spec = plan.spec()
    assert spec.metaserver is True
    assert spec.kv_transfer is not None
    assert (spec.kv_transfer.connector, spec.kv_transfer.role, spec.kv_transfer.kv_port) == (
        "MooncakeLayerwiseConnector", "kv_consumer", 30100)
    # JSON-string form of the same config
    (plan,) = plan_node(node(kind="vllm", role="decode",
                             engine_config={"kv_transfer_config": orjson.dumps(cfg).decode()}))
    assert plan.spec().metaserver is True
    (plan,) = plan_node(node(kind="vllm"))
    assert plan.spec().kv_transfer is None and plan.spec().metaserver is False
    (plan,) = plan_node(node(kind="sim"))
    assert plan.spec().kv_transfer is None


def test_sglang_prefill_registration_has_bootstrap_port_and_backend() -> None:
    (plan,) = plan_node(node(kind="sglang", role="prefill", dp_size=2,
                             engine_config={"disaggregation_transfer_backend": "ascend"}))
    spec = plan.spec()
    assert spec.bootstrap_port == 8998 and spec.dp_size == 2
    assert [e.port for e in spec.endpoints] == [9000]
    assert spec.kv_transfer is not None and spec.kv_transfer.connector == "sglang-ascend"


def test_wire_compatibility_both_ways() -> None:
    # a v1 node manager's heartbeat / registration (no new fields) still parses
    hb = Heartbeat.model_validate_json(b'{"node":"n0","health":{"a":true},"failed":[],"reasons":{}}')
    assert hb.engines == {} and hb.npu == []
    reg = NodeRegistration.model_validate_json(orjson.dumps({"node": "n0", "instances": [{
        "id": "a", "model": "m", "role": "union", "engine": "sim",
        "endpoints": [{"host": "h", "port": 1}]}]}))
    assert reg.mgmt_port is None
    assert reg.instances[0].dp_size == 1 and reg.instances[0].kv_transfer is None
    # a newer sender's unknown fields are ignored
    new = orjson.dumps({"node": "n0", "health": {"a": False}, "future_field": 1,
                        "engines": {"a": {"state": "unhealthy", "http_healthy": True,
                                          "virtual_inference": {"state": "unhealthy",
                                                                "failures": 6, "later": 0}}},
                        "npu": [{"npu": 0, "chip": 0, "device": 0, "aicore_pct": 12.5,
                                 "bus_id": "0000:C1:00.0"}]})
    hb = Heartbeat.model_validate_json(new)
    assert hb.engines["a"].virtual_inference is not None
    assert hb.engines["a"].virtual_inference.failures == 6
    assert hb.npu[0].aicore_pct == 12.5
    assert InstanceSpec.model_validate({"id": "a", "model": "m", "role": "decode", "engine": "vllm",
                                        "endpoints": [{"host": "h", "port": 1}],
                                        "metaserver": True, "x": 1}).metaserver is True
