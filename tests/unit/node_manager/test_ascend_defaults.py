"""Golden argv / env of vLLM on Ascend (vLLM-Ascend), single node: union, PD prefill-first,
PD decode-first (issue 16 item 4), and the devices of several engine groups on one node.

Where each expected value comes from (vllm-project/vllm-ascend, read through the code index):

* [SN] ``docs/source/tutorials/features/pd_disaggregation_mooncake_single_node.md``: one node,
  1P1D: ``kv_connector`` ``MooncakeConnectorV1``, ``kv_role`` ``kv_producer`` (P) /
  ``kv_consumer`` (D), ``kv_port`` as a string, ``engine_id`` per instance,
  ``kv_connector_extra_config: {"prefill": {"dp_size", "tp_size"}, "decode": {...}}``; env
  ``ASCEND_RT_VISIBLE_DEVICES`` (P and D on different NPUs: "set ASCEND_RT_VISIBLE_DEVICES and
  port to different values for each P process"), ``HCCL_IF_IP`` = the node's IP,
  ``OMP_PROC_BIND=false``, ``OMP_NUM_THREADS=10``.
* [MN] ``docs/source/tutorials/features/pd_disaggregation_mooncake_multi_node.md``: the
  "Layerwise" scripts (``MooncakeLayerwiseConnector``, same keys), the "kv_port Configuration
  Guide" (ports kv_port .. kv_port + chips; recommended kv_port >= 36000 for 16 NPUs).
* [BW] ``vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake/base_worker.py``: a rank listens
  on ``kv_port + dp_rank * tp_size (* pp * pcp) + tp_rank``: one port per device of the instance.
* [PD] docs/pd.md of motor: pd_decode_first is the metaserver protocol of
  MooncakeLayerwiseConnector (vllm-ascend ``load_balance_proxy_layerwise_server_example.py``).
* [V] vLLM ``vllm serve`` flags (``--tensor-parallel-size``, ``--data-parallel-size``,
  ``--data-parallel-rank``, ``--data-parallel-address``, ``--data-parallel-rpc-port``,
  ``--kv-transfer-config``), as motor's other vLLM goldens (test_engine_backends.py).

Not run here: the real ``vllm serve`` argument parser of the vLLM CPU venv on these argv (the
real-engine lane; needs that venv).
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from motor.config import ConfigError, parse_config
from motor.config.schema import ClusterConfig, EngineConfig, NodeConfig
from motor.node_manager.engines import InstancePlan, plan_node

ACCESS_LOG = ["--disable-access-log-for-endpoints", "/health,/metrics"]
MOTOR_ENV = {"PYTHONUNBUFFERED", "MOTOR_INSTANCE_ID", "MOTOR_DP_RANK"}


def cluster(mode: str, *engines: dict[str, Any], host: str = "192.0.0.1",
            **node: Any) -> ClusterConfig:
    return parse_config({"coordinator": {"mode": mode},
                         "nodes": [{"name": "n0", "host": host, "engines": list(engines),
                                    **node}]})


def plans(cfg: ClusterConfig) -> list[InstancePlan]:
    return plan_node(cfg.nodes[0], cfg)


def engine_env(env: dict[str, str]) -> dict[str, str]:
    """The env a backend adds, without motor's own bookkeeping variables."""
    return {k: v for k, v in env.items() if k not in MOTOR_ENV}


def kv_arg(argv: list[str]) -> dict[str, Any]:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])  # type: ignore[no-any-return]


P = {"name": "p", "kind": "vllm", "role": "prefill", "model": "/models/ds", "served_model_name": "ds",
     "tp_size": 2, "base_port": 9000}
D = {"name": "d", "kind": "vllm", "role": "decode", "model": "/models/ds", "served_model_name": "ds",
     "tp_size": 1, "dp_size": 2, "base_port": 9100}


def test_union_golden() -> None:
    # [V] argv; [SN] ASCEND_RT_VISIBLE_DEVICES; no PD: no kv_transfer_config, no PD env
    cfg = cluster("union", {"name": "u", "kind": "vllm", "model": "/models/q",
                            "served_model_name": "q", "tp_size": 4, "count": 2, "base_port": 9000})
    p0, p1 = plans(cfg)
    assert p1.processes[0].argv == [
        "vllm", "serve", "--host", "127.0.0.1", "--port", "9001", "--model", "/models/q",
        "--served-model-name", "q", "--tensor-parallel-size", "4", *ACCESS_LOG]
    assert engine_env(p0.processes[0].env) == {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"}
    assert engine_env(p1.processes[0].env) == {"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}
    assert p1.spec().kv_transfer is None


def test_pd_prefill_first_golden() -> None:
    cfg = cluster("pd_prefill_first", P, D)
    p, d = plans(cfg)
    # [SN] MooncakeConnectorV1, P kv_producer, extra config of both groups' sizes;
    # [MN]/[BW] kv_port 36000 + the instance's device slot on the node
    assert p.processes[0].argv == [
        "vllm", "serve", "--host", "127.0.0.1", "--port", "9000", "--model", "/models/ds",
        "--served-model-name", "ds", "--tensor-parallel-size", "2",
        "--kv-transfer-config",
        '{"kv_connector":"MooncakeConnectorV1","kv_role":"kv_producer","kv_port":"36000",'
        '"engine_id":"n0/p/0","kv_connector_extra_config":{"prefill":{"dp_size":1,"tp_size":2},'
        '"decode":{"dp_size":2,"tp_size":1}}}',
        *ACCESS_LOG]
    # [SN] env: P on NPUs 0-1, D after them; HCCL_IF_IP = the node's IP; OMP settings
    assert engine_env(p.processes[0].env) == {
        "ASCEND_RT_VISIBLE_DEVICES": "0,1", "HCCL_IF_IP": "192.0.0.1",
        "OMP_PROC_BIND": "false", "OMP_NUM_THREADS": "10"}
    # [V] DP flags; [SN] D kv_consumer; kv_port after P's two device slots
    assert d.processes[1].argv == [
        "vllm", "serve", "--host", "127.0.0.1", "--port", "9101", "--model", "/models/ds",
        "--served-model-name", "ds", "--tensor-parallel-size", "1",
        "--data-parallel-size", "2", "--data-parallel-rank", "1",
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "29551",
        "--kv-transfer-config",
        '{"kv_connector":"MooncakeConnectorV1","kv_role":"kv_consumer","kv_port":"36002",'
        '"engine_id":"n0/d/0","kv_connector_extra_config":{"prefill":{"dp_size":1,"tp_size":2},'
        '"decode":{"dp_size":2,"tp_size":1}}}',
        *ACCESS_LOG]
    assert [engine_env(r.env)["ASCEND_RT_VISIBLE_DEVICES"] for r in d.processes] == ["2", "3"]
    spec = d.spec()
    assert spec.kv_transfer is not None and spec.metaserver is False
    assert (spec.kv_transfer.connector, spec.kv_transfer.role, spec.kv_transfer.kv_port) == (
        "MooncakeConnectorV1", "kv_consumer", 36002)


def test_pd_decode_first_golden() -> None:
    # [MN] "Layerwise": MooncakeLayerwiseConnector, same keys; [PD] metaserver registration
    cfg = cluster("pd_decode_first", {**P, "dp_size": 2}, {**D, "tp_size": 2, "dp_size": 1})
    p, d = plans(cfg)
    extra = {"prefill": {"dp_size": 2, "tp_size": 2}, "decode": {"dp_size": 1, "tp_size": 2}}
    assert kv_arg(p.processes[1].argv) == {
        "kv_connector": "MooncakeLayerwiseConnector", "kv_role": "kv_producer",
        "kv_port": "36000", "engine_id": "n0/p/0", "kv_connector_extra_config": extra}
    assert kv_arg(d.processes[0].argv) == {
        "kv_connector": "MooncakeLayerwiseConnector", "kv_role": "kv_consumer",
        "kv_port": "36004", "engine_id": "n0/d/0", "kv_connector_extra_config": extra}
    assert [engine_env(r.env)["ASCEND_RT_VISIBLE_DEVICES"] for r in p.processes] == ["0,1", "2,3"]
    assert engine_env(d.processes[0].env)["ASCEND_RT_VISIBLE_DEVICES"] == "4,5"
    assert d.spec().metaserver is True and p.spec().metaserver is True


def test_user_values_win_key_by_key() -> None:
    user = {"kv_port": "30100", "kv_buffer_device": "npu",
            "kv_connector_extra_config": {"decode": {"tp_size": 4}, "use_ascend_direct": True}}
    cfg = cluster("pd_prefill_first", {**P, "engine_config": {"kv-transfer-config": user}}, D)
    kv = kv_arg(plans(cfg)[0].processes[0].argv)
    assert kv == {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer",
                  "kv_port": "30100", "engine_id": "n0/p/0", "kv_buffer_device": "npu",
                  "kv_connector_extra_config": {"prefill": {"dp_size": 1, "tp_size": 2},
                                                "decode": {"dp_size": 2, "tp_size": 4},
                                                "use_ascend_direct": True}}
    assert plans(cfg)[0].spec().kv_transfer.kv_port == 30100  # type: ignore[union-attr]
    # the same as JSON text; the user's connector kept (prefill-first mode, layerwise asked)
    text = json.dumps({"kv_connector": "MooncakeLayerwiseConnector"})
    cfg = cluster("pd_prefill_first", {**P, "engine_config": {"kv_transfer_config": text}}, D)
    assert kv_arg(plans(cfg)[0].processes[0].argv)["kv_connector"] == \
        "MooncakeLayerwiseConnector"


def test_other_connector_is_the_users_whole_and_false_drops_it() -> None:
    other = {"kv_connector": "LLMDataDistCMgrConnector", "kv_role": "kv_producer"}
    cfg = cluster("pd_prefill_first", {**P, "engine_config": {"kv_transfer_config": other}}, D)
    p = plans(cfg)[0]
    assert kv_arg(p.processes[0].argv) == other
    cfg = cluster("pd_prefill_first", {**P, "engine_config": {"kv_transfer_config": False}}, D)
    p = plans(cfg)[0]
    assert "--kv-transfer-config" not in p.processes[0].argv and p.spec().kv_transfer is None


def test_hccl_if_ip_only_for_a_real_address() -> None:
    for host in ("127.0.0.1", "0.0.0.0", "node-1.example.com"):
        cfg = cluster("pd_prefill_first", P, D, host=host)
        assert "HCCL_IF_IP" not in plans(cfg)[0].processes[0].env, host
    # the engine's listen address when the node's is not usable; the engine's env wins
    cfg = cluster("pd_prefill_first", {**P, "host": "10.1.2.3"},
                  {**D, "env": {"HCCL_IF_IP": "10.9.9.9", "OMP_NUM_THREADS": "4"}},
                  host="127.0.0.1")
    p, d = plans(cfg)
    assert p.processes[0].env["HCCL_IF_IP"] == "10.1.2.3"
    assert (d.processes[0].env["HCCL_IF_IP"], d.processes[0].env["OMP_NUM_THREADS"]) == (
        "10.9.9.9", "4")


def test_peer_sizes_must_agree_unless_given() -> None:
    d2 = {**D, "name": "d2", "dp_size": 1, "tp_size": 2, "base_port": 9200}
    with pytest.raises(ConfigError) as ei:
        cluster("pd_prefill_first", P, D, d2)
    msg = str(ei.value)
    for part in ("nodes[0].engines[0].engine_config.kv_transfer_config", "one dp_size / tp_size",
                 "nodes[0].engines[1] dp_size 2 tp_size 1",
                 "nodes[0].engines[2] dp_size 1 tp_size 2", "kv_connector_extra_config.decode"):
        assert part in msg, (part, msg)
    given = {"kv_connector_extra_config": {"decode": {"dp_size": 2, "tp_size": 1}}}
    cfg = cluster("pd_prefill_first", {**P, "engine_config": {"kv_transfer_config": given}},
                  {**D, "engine_config": {"kv_transfer_config": {
                      "kv_connector_extra_config": {"prefill": {"dp_size": 1, "tp_size": 2}}}}},
                  {**d2, "engine_config": {"kv_transfer_config": {
                      "kv_connector_extra_config": {"prefill": {"dp_size": 1, "tp_size": 2}}}}})
    assert kv_arg(plans(cfg)[0].processes[0].argv)["kv_connector_extra_config"]["decode"] == \
        {"dp_size": 2, "tp_size": 1}


def test_node_planned_without_cluster_leaves_the_peer_side_out() -> None:
    node = NodeConfig(name="n0", engines=[EngineConfig(**P)])
    kv = kv_arg(plan_node(node)[0].processes[0].argv)
    assert kv["kv_connector"] == "MooncakeConnectorV1"
    assert kv["kv_connector_extra_config"] == {"prefill": {"dp_size": 1, "tp_size": 2}}


def test_node_agent_plans_with_its_cluster() -> None:
    from motor.node_manager.agent import NodeAgent
    cfg = cluster("pd_decode_first", P, D)
    agent = NodeAgent(cfg.nodes[0], "http://127.0.0.1:1", cluster=cfg)
    kv = kv_arg(agent.plans[0].processes[0].argv)
    assert kv["kv_connector"] == "MooncakeLayerwiseConnector"
    assert kv["kv_connector_extra_config"]["decode"] == {"dp_size": 2, "tp_size": 1}


# -- devices of several engine groups on one node ---------------------------------------------

def devices_of(cfg: ClusterConfig) -> list[list[str]]:
    out = []
    for pl in plans(cfg):
        out.append([r.env.get("ASCEND_RT_VISIBLE_DEVICES", r.env.get("CUDA_VISIBLE_DEVICES", "-"))
                    for r in pl.processes])
    return out


def test_groups_get_disjoint_devices_in_config_order() -> None:
    # vLLM: one block of tp_size per DP rank; SGLang: one block of dp_size*tp_size per instance
    sg = {"name": "s", "kind": "sglang", "role": "decode", "model": "/models/ds",
          "served_model_name": "ds", "tp_size": 2, "dp_size": 2, "base_port": 9300}
    sim = {"name": "x", "kind": "sim", "role": "decode", "model": "/models/ds",
           "served_model_name": "ds", "base_port": 9400}
    cfg = cluster("pd_prefill_first", {**P, "count": 2}, D, sg, sim, devices=16)
    # today's code started every group at device 0: [0,1], [2,3], [0], [1], [0..3]
    assert devices_of(cfg) == [["0,1"], ["2,3"], ["4", "5"], ["6,7,8,9"], ["-"]]
    # the peers of a vLLM engine are the vLLM groups (SGLang and sim exchange no KV with it)
    assert kv_arg(plans(cfg)[0].processes[0].argv)["kv_connector_extra_config"]["decode"] == \
        {"dp_size": 2, "tp_size": 1}


def test_explicit_devices_and_automatic_ones_around_them() -> None:
    cfg = cluster("pd_prefill_first", {**P, "devices": [4, 5]}, D)
    assert devices_of(cfg) == [["4,5"], ["0", "1"]]
    cfg = cluster("pd_prefill_first", {**P, "devices": [1, 0]}, {**D, "devices": [7, 6]})
    assert devices_of(cfg) == [["1,0"], ["7", "6"]]
    # the kv_port slot follows the config order, not the ids
    assert kv_arg(plans(cfg)[1].processes[0].argv)["kv_port"] == "36002"


def test_cuda_and_cpu_nodes() -> None:
    cfg = cluster("pd_prefill_first", P, D, platform="cuda")
    assert devices_of(cfg) == [["0,1"], ["2", "3"]]
    p = plans(cfg)[0]
    assert "ASCEND_RT_VISIBLE_DEVICES" not in p.processes[0].env
    assert "OMP_PROC_BIND" not in p.processes[0].env
    assert kv_arg(p.processes[0].argv) == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                                           "engine_id": "n0/p/0"}
    cfg = cluster("pd_prefill_first", P, D, platform="cpu")
    assert devices_of(cfg) == [["-"], ["-", "-"]]


@pytest.mark.parametrize(("p_extra", "d_extra", "node", "parts"), [
    ({"devices": [0, 1]}, {"devices": [1, 2]}, {},
     ["nodes[0].engines[1].devices", "got 1 also in nodes[0].engines[0].devices",
      "engine 'p'", "engine 'd' lists [1, 2]"]),
    ({}, {}, {"devices": 3},
     ["nodes[0].engines[1].devices", "below nodes[0].devices = 3", "engine 'd' allocated 2, 3"]),
    ({"devices": [0, 8]}, {}, {"devices": 8},
     ["nodes[0].engines[0].devices", "below nodes[0].devices = 8", "engine 'p' listing 0, 8"]),
    ({"devices": [0]}, {}, {},
     ["nodes[0].engines[0]", "devices: expected count x dp_size x tp_size = 1 x 1 x 2 = 2",
      "got 1"]),
    ({"devices": [3, 3]}, {}, {}, ["nodes[0].engines[0].devices", "distinct", "3 more than once"]),
    ({"devices": [0, 1]}, {}, {"platform": "cpu"},
     ["nodes[0].engines[0].devices", "expected none on a cpu node"]),
    ({"devices": [0, 1], "kind": "sim"}, {"kind": "sim"}, {},
     ["nodes[0].engines[0]", "devices: expected none for a sim engine"]),
])
def test_bad_devices_are_refused_at_load(p_extra: dict[str, Any], d_extra: dict[str, Any],
                                         node: dict[str, Any], parts: list[str]) -> None:
    with pytest.raises(ConfigError) as ei:
        cluster("pd_prefill_first", {**P, **p_extra}, {**D, **d_extra}, **node)
    msg = str(ei.value)
    for part in parts:
        assert part in msg, (part, msg)


def test_overlap_refused_by_the_node_manager_too() -> None:
    # a NodeConfig built on its own (no cluster load-time check) fails when planned
    node = NodeConfig(name="n0", engines=[EngineConfig(**{**P, "devices": [0, 1]}),
                                          EngineConfig(**{**D, "devices": [5, 0]})])
    with pytest.raises(ConfigError, match=r"engines\[1\]\.devices: .* got 0 also in "
                                          r"engines\[0\]\.devices"):
        plan_node(node)
