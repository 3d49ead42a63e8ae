"""engine_config passthrough and the sim backend's argv (golden)."""
from __future__ import annotations

import sys

import pytest

from motor.config.schema import EngineConfig, NodeConfig
from motor.errors import ConfigError
from motor.node_manager.engines import engine_flags, flag_key, full_env, get_backend, plan_node


def test_flag_key_spellings() -> None:
    assert flag_key("max_model_len") == flag_key("max-model-len") == flag_key("--max-model-len") \
        == "max-model-len"


def test_scalars_and_kebab_case() -> None:
    assert engine_flags({"max_model_len": 4096, "gpu-memory-utilization": 0.9,
                         "--dtype": "bfloat16"}) == [
        "--max-model-len", "4096", "--gpu-memory-utilization", "0.9", "--dtype", "bfloat16"]


def test_booleans() -> None:
    assert engine_flags({"enforce_eager": True, "trust-remote-code": False}) == ["--enforce-eager"]
    assert engine_flags({"enable_prefix_caching": False},
                        negatable=["enable-prefix-caching"]) == ["--no-enable-prefix-caching"]
    assert engine_flags({"x": None}) == []
    assert engine_flags({"a": False, "b": True, "c": None}, negate_all=True) == ["--no-a", "--b"]


def test_lists_and_dicts() -> None:
    assert engine_flags({"allowed_origins": ["a", "b"], "empty": []}) == [
        "--allowed-origins", "a", "b"]
    assert engine_flags({"middleware": ["m1", "m2"]}, list_style="repeat") == [
        "--middleware", "m1", "--middleware", "m2"]
    assert engine_flags({"kv_transfer_config": {"kv_connector": "X", "kv_role": "kv_both",
                                                "extra": {"n": 1, "ok": True}}}) == [
        "--kv-transfer-config",
        '{"kv_connector":"X","kv_role":"kv_both","extra":{"n":1,"ok":true}}']
    with pytest.raises(ValueError):
        engine_flags({}, list_style="bogus")


def test_user_overrides_defaults_in_both_spellings() -> None:
    defaults = {"disable-access-log-for-endpoints": "/health,/metrics", "block_size": 16}
    for key in ("disable_access_log_for_endpoints", "disable-access-log-for-endpoints",
                "--disable-access-log-for-endpoints"):
        out = engine_flags({key: "/x"}, defaults=defaults)
        assert out == ["--disable-access-log-for-endpoints", "/x", "--block-size", "16"]
        assert out.count("--disable-access-log-for-endpoints") == 1
    # defaults given in underscore spelling are matched too
    assert engine_flags({"block-size": 128}, defaults={"block_size": 16}) == ["--block-size", "128"]
    # a user False / None drops the default
    assert engine_flags({"block_size": None}, defaults=defaults) == [
        "--disable-access-log-for-endpoints", "/health,/metrics"]
    # defaults never duplicated, even when listed twice in both spellings
    assert engine_flags({}, defaults=[("a_b", 1), ("a-b", 2)]) == ["--a-b", "1"]


def test_managed_first_and_not_overridable() -> None:
    out = engine_flags({"x": 1}, managed=[("host", "h"), ("port", 1)], defaults={"y": 2})
    assert out == ["--host", "h", "--port", "1", "--x", "1", "--y", "2"]
    with pytest.raises(ConfigError, match="engine_config.port"):
        engine_flags({"port": 5}, managed={"port": 1})
    with pytest.raises(ConfigError, match="same flag --max-model-len"):
        engine_flags({"max_model_len": 1, "max-model-len": 2})


def sim_engine(**kw: object) -> EngineConfig:
    base: dict[str, object] = dict(name="sim", kind="sim", model="/models/m",
                                   served_model_name="motor-sim", base_port=18100)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def test_sim_argv_golden() -> None:
    node = NodeConfig(name="node0", engines=[sim_engine(
        count=2, role="decode", engine_config={"time_scale": 0.5, "fault": ["crash"],
                                               "verbose": True, "quiet": False})])
    plans = plan_node(node)
    assert [p.id for p in plans] == ["node0/sim/0", "node0/sim/1"]
    py = sys.executable
    assert plans[1].processes[0].argv == [
        py, "-m", "motor", "sim", "--host", "127.0.0.1", "--port", "18101",
        "--model", "motor-sim", "--role", "decode", "--dp-rank", "0",
        "--time-scale", "0.5", "--fault", "crash", "--verbose", "--no-quiet"]
    assert plans[1].processes[0].name == "node0-sim-1"
    spec = plans[1].spec()
    assert spec.model == "motor-sim" and spec.role.value == "decode" and not spec.healthy
    assert [(e.port, e.dp_rank) for e in spec.endpoints] == [(18101, 0)]


def test_sim_dp_ranks_one_process_each() -> None:
    node = NodeConfig(name="n", engines=[sim_engine(count=2, dp_size=2, launcher=["fake"])])
    plans = plan_node(node)
    p1 = plans[1]
    assert [pr.endpoint.port for pr in p1.processes] == [18102, 18103]
    assert [pr.name for pr in p1.processes] == ["n-sim-1-dp0", "n-sim-1-dp1"]
    assert p1.processes[1].argv[:1] == ["fake"]
    assert p1.processes[1].argv[-2:] == ["--dp-rank", "1"]
    assert [e.dp_rank for e in p1.spec().endpoints] == [0, 1]


def test_sim_env_and_managed_error() -> None:
    node = NodeConfig(name="n", engines=[sim_engine(env={"FOO": "1", "PYTHONUNBUFFERED": "0"})])
    env = plan_node(node)[0].processes[0].env
    assert env["FOO"] == "1" and env["PYTHONUNBUFFERED"] == "0"
    assert env["MOTOR_INSTANCE_ID"] == "n/sim/0"
    full = full_env(env)
    assert "PATH" in full and full["FOO"] == "1"
    bad = NodeConfig(name="n", engines=[sim_engine(engine_config={"--port": 1})])
    with pytest.raises(ConfigError, match="engines\\[sim\\].engine_config.--port"):
        plan_node(bad)


def test_get_backend_sim() -> None:
    assert get_backend("sim") is get_backend("sim")
