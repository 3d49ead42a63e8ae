"""Config schema and loading: defaults, and errors that name field, expected and received."""
from __future__ import annotations

import json

import pytest

from motor.config import ConfigError, load_config, load_default_config, parse_config
from motor.config.schema import DeploymentMode, EngineKind, PolicyName, Role


def test_embedded_default_is_simulated_union_on_loopback():
    cfg = load_default_config()
    assert cfg.coordinator.mode == DeploymentMode.UNION
    assert cfg.coordinator.policy == PolicyName.ROUND_ROBIN
    engines = [e for n in cfg.nodes for e in n.engines]
    assert engines and all(e.kind == EngineKind.SIM and e.host == "127.0.0.1" for e in engines)
    assert cfg.controller.host == "127.0.0.1"


def test_yaml_and_json_files_load_the_same(tmp_path):
    data = {"coordinator": {"port": 9001, "policy": "least_load", "mode": "pd_prefill_first"},
            "nodes": [{"name": "n1", "engines": [
                {"name": "p", "role": "prefill", "model": "m", "kind": "vllm",
                 "engine_config": {"max-model-len": 2048}},
                {"name": "d", "role": "decode", "model": "m", "kind": "vllm", "base_port": 18200}]}]}
    jp = tmp_path / "c.json"
    jp.write_text(json.dumps(data))
    yp = tmp_path / "c.yaml"
    yp.write_text("coordinator:\n  port: 9001\n  policy: least_load\n  mode: pd_prefill_first\n"
                  "nodes:\n  - name: n1\n    engines:\n"
                  "      - {name: p, role: prefill, model: m, kind: vllm, engine_config: {max-model-len: 2048}}\n"
                  "      - {name: d, role: decode, model: m, kind: vllm, base_port: 18200}\n")
    a, b = load_config(jp), load_config(yp)
    assert a == b
    e = a.nodes[0].engines[0]
    assert e.role == Role.PREFILL and e.engine_config == {"max-model-len": 2048}
    assert e.model_name == "m"


@pytest.mark.parametrize("data, expect", [
    ({"coordinator": {"policy": "fastest"}}, ["coordinator.policy", "round_robin", "'fastest'"]),
    ({"coordinator": {"port": 70000}}, ["coordinator.port", "65535", "70000"]),
    ({"coordinator": {"prot": 1}}, ["coordinator.prot", "unknown field"]),
    ({"nodes": [{"name": "a", "engines": [{"name": "e", "role": "prefil", "model": "m"}]}]},
     ["nodes[0].engines[0].role", "'prefill'", "'prefil'"]),
    ({"nodes": [{"name": "a", "engines": [{"name": "e"}]}]},
     ["nodes[0].engines[0].model", "missing"]),
    ({"nodes": [{"name": "a", "engines": [{"name": "e", "model": "m", "count": 0}]}]},
     ["nodes[0].engines[0].count", "expected an integer >= 1", "got 0"]),
])
def test_errors_name_field_expected_and_received(data, expect):
    with pytest.raises(ConfigError) as ei:
        parse_config(data, "test.yaml")
    msg = str(ei.value)
    assert "test.yaml" in msg
    for part in expect:
        assert part in msg, (part, msg)


def test_port_clash_between_engines_is_an_error():
    data = {"nodes": [{"name": "a", "engines": [
        {"name": "e1", "model": "m", "count": 2, "base_port": 9000},
        {"name": "e2", "model": "m", "base_port": 9001}]}]}
    with pytest.raises(ConfigError, match="port 9001"):
        parse_config(data)


def test_duplicate_node_names_rejected():
    with pytest.raises(ConfigError, match="unique"):
        parse_config({"nodes": [{"name": "a"}, {"name": "a"}]})


def test_config_error_is_a_value_error_and_bad_files_are_clear(tmp_path):
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text("coordinator: [1, 2\n")
    with pytest.raises(ConfigError, match="expected valid YAML, got .* at line"):
        load_config(p)
    p.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p)


def test_configuration_reference_is_current():
    import os

    from motor.config.doc import render
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "configuration.md")
    with open(path) as f:
        assert f.read() == render(), "run: python -m motor.config.doc > docs/configuration.md"


def test_example_config_loads():
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "cluster.yaml")
    cfg = load_config(path)
    assert cfg.nodes[0].engines[0].count == 3


def test_embedded_pd_config_has_prefill_and_decode():
    cfg = load_default_config("pd")
    roles = sorted({e.role.value for n in cfg.nodes for e in n.engines})
    assert roles == ["decode", "prefill"]
    assert cfg.coordinator.mode.value == "pd_prefill_first"
    with pytest.raises(ConfigError, match="'union'"):
        load_default_config("bogus")
