"""Golden argv / env of the vLLM and SGLang backends (union, prefill, decode, DP, overrides)."""
from __future__ import annotations

import sys
from typing import Any

import pytest

from motor.config.schema import EngineConfig, NodeConfig
from motor.errors import ConfigError
from motor.node_manager.engines import plan_node


def plans(platform: str = "ascend", **kw: Any) -> list[Any]:
    base: dict[str, Any] = dict(name="e", model="/models/qwen", served_model_name="qwen",
                                base_port=9000)
    base.update(kw)
    return plan_node(NodeConfig(name="n", platform=platform, engines=[EngineConfig(**base)]))


ACCESS_LOG = ["--disable-access-log-for-endpoints", "/health,/metrics"]


def test_vllm_union_golden() -> None:
    p = plans(kind="vllm", count=2, tp_size=2,
              engine_config={"max_model_len": 8192, "enforce-eager": True,
                             "enable_prefix_caching": False})[1]
    proc = p.processes[0]
    assert proc.argv == [
        "vllm", "serve", "--host", "127.0.0.1", "--port", "9001", "--model", "/models/qwen",
        "--served-model-name", "qwen", "--tensor-parallel-size", "2",
        "--max-model-len", "8192", "--enforce-eager", "--no-enable-prefix-caching", *ACCESS_LOG]
    assert proc.env["ASCEND_RT_VISIBLE_DEVICES"] == "2,3"
    assert p.spec().engine.value == "vllm" and p.kv_events is None


def test_vllm_prefill_golden_with_connector_from_config() -> None:
    # platform cuda: the user's kv_transfer_config replaces motor's default whole (Ascend
    # merges it key by key: tests/unit/node_manager/test_ascend_defaults.py)
    kv = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"use_ascend_direct": True}}
    p = plans(platform="cuda", kind="vllm", role="prefill",
              engine_config={"kv_transfer_config": kv})[0]
    assert p.processes[0].argv == [
        "vllm", "serve", "--host", "127.0.0.1", "--port", "9000", "--model", "/models/qwen",
        "--served-model-name", "qwen", "--tensor-parallel-size", "1",
        "--kv-transfer-config",
        '{"kv_connector":"MooncakeConnectorV1","kv_role":"kv_producer",'
        '"kv_connector_extra_config":{"use_ascend_direct":true}}',
        *ACCESS_LOG]


def test_vllm_decode_golden_default_connector_and_dp() -> None:
    # platform cuda: vLLM's NixlConnector default, CUDA_VISIBLE_DEVICES
    p = plans(platform="cuda", kind="vllm", role="decode", dp_size=2,
              launcher=[sys.executable, "-m", "vllm.entrypoints.openai.api_server"],
              engine_config={"kv-events-config": {"enable_kv_cache_events": True,
                                                  "publisher": "zmq",
                                                  "endpoint": "tcp://*:5557"}})[0]
    r1 = p.processes[1]
    assert r1.argv == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", "9001", "--model", "/models/qwen",
        "--served-model-name", "qwen", "--tensor-parallel-size", "1",
        "--data-parallel-size", "2", "--data-parallel-rank", "1",
        "--kv-events-config",
        '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}',
        "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", "29550",
        "--kv-transfer-config",
        '{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"n/e/0"}',
        *ACCESS_LOG]
    assert r1.name == "n-e-0-dp1" and r1.env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "ASCEND_RT_VISIBLE_DEVICES" not in r1.env
    assert p.kv_events == "tcp://127.0.0.1:5557"
    assert [e.port for e in p.spec().endpoints] == [9000, 9001]


@pytest.mark.parametrize("key", ["disable_access_log_for_endpoints",
                                 "disable-access-log-for-endpoints"])
def test_vllm_user_overrides_default_in_both_spellings(key: str) -> None:
    argv = plans(kind="vllm", engine_config={key: "/metrics"})[0].processes[0].argv
    assert argv.count("--disable-access-log-for-endpoints") == 1
    assert argv[-2:] == ["--disable-access-log-for-endpoints", "/metrics"]


def test_vllm_managed_flag_rejected_and_env_wins() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        plans(kind="vllm", engine_config={"tensor_parallel_size": 4})
    p = plans(kind="vllm", env={"ASCEND_RT_VISIBLE_DEVICES": "7"})[0]
    assert p.processes[0].env["ASCEND_RT_VISIBLE_DEVICES"] == "7"


def test_sglang_prefill_golden() -> None:
    p = plans(kind="sglang", role="prefill", count=2, tp_size=2,
              engine_config={"disaggregation_transfer_backend": "ascend",
                             "mem_fraction_static": 0.8})[1]
    proc = p.processes[0]
    assert proc.argv == [
        sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", "9001",
        "--model-path", "/models/qwen", "--served-model-name", "qwen", "--tp-size", "2",
        "--disaggregation-mode", "prefill",
        "--disaggregation-transfer-backend", "ascend", "--mem-fraction-static", "0.8",
        "--disaggregation-bootstrap-port", "8999"]
    assert proc.env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "true"
    assert proc.env["ASCEND_RT_VISIBLE_DEVICES"] == "2,3"
    assert p.bootstrap_port == 8999 and p.spec().bootstrap_port == 8999


def test_sglang_decode_golden_and_bootstrap_override() -> None:
    p = plans(kind="sglang", role="decode", dp_size=2)[0]
    assert p.processes[0].argv == [
        sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", "9000",
        "--model-path", "/models/qwen", "--served-model-name", "qwen", "--tp-size", "1",
        "--dp-size", "2", "--disaggregation-mode", "decode"]
    assert p.bootstrap_port is None and len(p.processes) == 1
    for key in ("disaggregation_bootstrap_port", "disaggregation-bootstrap-port"):
        pp = plans(kind="sglang", role="prefill", engine_config={key: 7000})[0]
        assert pp.bootstrap_port == 7000
        assert pp.processes[0].argv.count("--disaggregation-bootstrap-port") == 1
        assert pp.processes[0].argv[-2:] == ["--disaggregation-bootstrap-port", "7000"]
