"""Wrong configs as an operator writes them (issue 22): each refused at load time with one
message that names the field(s), what was expected and what was received; the command-line
entry points exit 2 on them without a traceback. A few right configs must keep loading."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from motor.config import ConfigError, load_config, load_default_config
from motor.config.engine_flags import MANAGED_FLAGS, flag_key
from motor.config.schema import EngineConfig, NodeConfig

ROOT = Path(__file__).resolve().parents[3]


def engines(*rows: str, mode: str = "union", extra: str = "") -> str:
    """A one-node config whose engines are the flow-style mappings ``rows``."""
    body = "\n".join(f"      - {r}" for r in rows)
    return (f"coordinator:\n  mode: {mode}\n{extra}nodes:\n  - name: node0\n    engines:\n"
            f"{body}\n")


P = "{name: p, role: prefill, model: m, base_port: 18100}"
D = "{name: d, role: decode, model: m, base_port: 18110}"
U = "{name: u, role: union, model: m, base_port: 18120}"

# (id, YAML text, parts the message must contain: the field(s) and the received value)
BAD: list[tuple[str, str, list[str]]] = [
    # -- the configs named in the issue ----------------------------------------------------
    ("pd_prefill_first_prefill_only", engines(P, mode="pd_prefill_first"),
     ["coordinator.mode", "pd_prefill_first", "got roles prefill", "nodes[0].engines[0].role"]),
    ("pd_bootstrap_decode_only", engines(D, mode="pd_bootstrap"),
     ["coordinator.mode", "pd_bootstrap", "got roles decode"]),
    ("pd_models_differ", engines("{name: p, role: prefill, model: a, base_port: 18100}",
                                 "{name: d, role: decode, model: b, base_port: 18110}",
                                 mode="pd_prefill_first"),
     ["nodes[0].engines[0].model", "'a'", "nodes[0].engines[1].model", "'b'", "decode"]),
    ("union_mode_prefill_role", engines(P), ["nodes[0].engines[0].role", "'prefill'", "'union'"]),
    ("coordinator_host_not_a_host", "coordinator:\n  host: 'not a host!!'\n",
     ["coordinator.host", "'not a host!!'", "IPv4 / IPv6 address", "DNS host name"]),
    ("engine_config_port", engines("{name: e, model: m, engine_config: {port: 9999}}"),
     ["nodes[0].engines[0].engine_config.port", "9999", "nodes[0].engines[0].base_port"]),
    ("heartbeat_interval_10_timeout_1",
     "controller:\n  heartbeat_interval_s: 10\n  heartbeat_timeout_s: 1\n",
     ["controller.heartbeat_timeout_s", "controller.heartbeat_interval_s", "= 20", "got 1"]),
    ("retry_backoff_above_max",
     "coordinator:\n  retries: {backoff_s: 5, backoff_max_s: 1}\n",
     ["coordinator.retries.backoff_s", "coordinator.retries.backoff_max_s = 1", "got 5"]),
    ("breaker_open_above_max", "coordinator:\n  breaker: {open_s: 60, open_max_s: 30}\n",
     ["coordinator.breaker.open_s", "coordinator.breaker.open_max_s = 30", "got 60"]),
    ("duplicate_engine_names", engines("{name: a, model: m, base_port: 18100}",
                                       "{name: a, model: m, base_port: 18110}"),
     ["nodes[0].engines: engine names must be unique within a node, got 'a' twice"]),
    # -- typos of keys (on purpose: codespell is told to leave them) -------------------------
    # -- the edge (issue 17) ------------------------------------------------------------
    ("priority_not_a_class",
     "coordinator:\n  limits:\n    keys: {a: {priority: gold}}\n",
     ["coordinator.limits.keys.a.priority", "'gold'", "interactive, batch"]),
    ("max_wait_not_a_class",
     "coordinator:\n  admission:\n    max_wait_s: {gold: 0.1}\n",
     ["coordinator.admission.max_wait_s.gold", "'gold'", "interactive, batch"]),
    ("max_wait_not_positive",
     "coordinator:\n  admission:\n    max_wait_s: {interactive: 0}\n",
     ["coordinator.admission.max_wait_s.interactive", "expected a number > 0.0, got 0"]),
    ("rpm_zero", "coordinator:\n  limits:\n    default: {rpm: 0}\n",
     ["coordinator.limits.default.rpm", "got 0"]),
    ("tls_without_cert", "coordinator:\n  tls: {key_file: k.pem}\n",
     ["coordinator.tls.cert_file", "missing"]),
    ("api_key_entry_without_name", "coordinator:\n  api_keys: [{key: sk-1}]\n",
     ["coordinator.api_keys[0]", "name"]),
    ("admission_negative_cap", "coordinator:\n  admission: {max_in_flight: -1}\n",
     ["coordinator.admission.max_in_flight", "got -1"]),
    ("admission_no_classes", "coordinator:\n  admission: {classes: []}\n",
     ["coordinator.admission.classes", "got []"]),
    ("top_level_typo", "contoller:\n  port: 18500\n",  # codespell:ignore contoller
     ["contoller", "unknown field", "did you mean 'controller'",  # codespell:ignore contoller
      "got 'contoller'"]),  # codespell:ignore contoller
    ("coordinator_key_typo", "coordinator:\n  polcy: least_load\n",  # codespell:ignore polcy
     ["coordinator.polcy", "did you mean 'policy'", "got 'polcy'"]),  # codespell:ignore polcy
    ("engine_key_kebab", engines("{name: e, model: m, base-port: 18100}"),
     ["nodes[0].engines[0].base-port", "did you mean 'base_port'"]),
    ("nested_key_typo", "coordinator:\n  retries: {max_attempt: 2}\n",
     ["coordinator.retries.max_attempt", "did you mean 'max_attempts'"]),
    ("node_key_typo", "nodes:\n  - {name: n, hots: 10.0.0.1}\n",
     ["nodes[0].hots", "did you mean 'host'"]),
    # -- wrong types -----------------------------------------------------------------------
    ("port_not_a_number", "coordinator:\n  port: eighty\n",
     ["coordinator.port", "expected a valid integer", "got 'eighty'"]),
    ("count_a_list", engines("{name: e, model: m, count: [2]}"),
     ["nodes[0].engines[0].count", "expected a valid integer", "got [2]"]),
    ("engines_a_mapping", "nodes:\n  - name: n\n    engines: {name: e, model: m}\n",
     ["nodes[0].engines", "expected a valid list", "got a mapping"]),
    ("bool_not_a_bool", "coordinator:\n  failover: {enabled: maybe}\n",
     ["coordinator.failover.enabled", "expected a valid boolean", "got 'maybe'"]),
    ("launcher_a_string", engines("{name: e, model: m, launcher: vllm serve}"),
     ["nodes[0].engines[0].launcher", "expected a valid list", "got 'vllm serve'"]),
    # -- missing required fields -----------------------------------------------------------
    ("engine_without_model", engines("{name: e}"),
     ["nodes[0].engines[0].model", "expected a value", "missing"]),
    ("node_without_name", "nodes:\n  - host: 127.0.0.1\n",
     ["nodes[0].name", "expected a value", "missing"]),
    # -- out of range ----------------------------------------------------------------------
    ("controller_port_70000", "controller:\n  port: 70000\n",
     ["controller.port", "expected an integer <= 65535", "got 70000"]),
    ("workers_0", "coordinator:\n  workers: 0\n", ["coordinator.workers", "expected an integer >= 1", "got 0"]),
    ("heartbeat_negative", "controller:\n  heartbeat_interval_s: -1\n",
     ["controller.heartbeat_interval_s", "expected a number > 0", "got -1"]),
    ("tier_credit_above_1", "coordinator:\n  kv: {tier_credit: {host: 1.5}}\n",
     ["coordinator.kv.tier_credit.host", "expected a number <= 1", "got 1.5"]),
    ("retry_status_404", "coordinator:\n  retries: {retry_statuses: [429, 404]}\n",
     ["coordinator.retries.retry_statuses", "expected 429 or a 5xx", "got 404"]),
    ("engine_count_0", engines("{name: e, model: m, count: 0}"),
     ["nodes[0].engines[0].count", "got 0"]),
    # -- enum values -----------------------------------------------------------------------
    ("mode_pd", "coordinator:\n  mode: pd\n",
     ["coordinator.mode", "'pd_prefill_first'", "got 'pd'"]),
    ("role_typo", engines("{name: e, model: m, role: prefil}"),
     ["nodes[0].engines[0].role", "'prefill'", "got 'prefil'"]),
    ("kind_typo", engines("{name: e, model: m, kind: vlm}"),
     ["nodes[0].engines[0].kind", "'vllm'", "got 'vlm'"]),
    ("restart_policy_typo", engines("{name: e, model: m, restart: {policy: on_failure}}"),
     ["nodes[0].engines[0].restart.policy", "'on-failure'", "got 'on_failure'"]),
    # -- modes without the roles they need, models mismatched ------------------------------
    ("pd_decode_first_union_only", engines(U, mode="pd_decode_first"),
     ["coordinator.mode", "pd_decode_first", "got roles union"]),
    ("pd_bootstrap_prefill_and_union", engines(P, U, mode="pd_bootstrap"),
     ["coordinator.mode", "pd_bootstrap", "got roles prefill, union"]),
    ("pd_served_names_differ",
     engines(P, "{name: d, role: decode, model: m, served_model_name: x, base_port: 18110}",
             mode="pd_prefill_first"),
     ["nodes[0].engines[0].model", "'m'", "nodes[0].engines[1].served_model_name", "'x'"]),
    ("pd_models_differ_across_nodes",
     "coordinator: {mode: pd_bootstrap}\nnodes:\n"
     "  - {name: n0, engines: [{name: p, role: prefill, model: a}]}\n"
     "  - {name: n1, host: 10.0.0.2, engines: [{name: d, role: decode, model: a},\n"
     "                                         {name: d2, role: decode, model: b,\n"
     "                                          base_port: 18200}]}\n",
     ["nodes[1].engines[1].model", "'b'", "prefill", "nodes[0].engines[0].model", "'a'"]),
    ("union_mode_decode_on_second_node",
     "nodes:\n  - {name: n0, engines: [{name: u, model: m}]}\n"
     "  - {name: n1, host: 10.0.0.2, engines: [{name: d, role: decode, model: m}]}\n",
     ["nodes[1].engines[0].role", "got 'decode'"]),
    ("pd_decode_first_two_workers", "coordinator: {mode: pd_decode_first, workers: 2}\n",
     ["coordinator.workers", "pd_decode_first", "got 2"]),
    # -- timing pairs ----------------------------------------------------------------------
    ("heartbeat_timeout_equal_interval",
     "controller: {heartbeat_interval_s: 3, heartbeat_timeout_s: 3}\n",
     ["controller.heartbeat_timeout_s", "controller.heartbeat_interval_s = 6", "got 3"]),
    ("heartbeat_interval_above_default_timeout", "controller: {heartbeat_interval_s: 10}\n",
     ["controller.heartbeat_timeout_s", "= 20", "got 5"]),
    ("restart_backoff_above_max",
     engines("{name: e, model: m, restart: {backoff_initial_s: 60, backoff_max_s: 30}}"),
     ["nodes[0].engines[0].restart.backoff_initial_s",
      "nodes[0].engines[0].restart.backoff_max_s = 30", "got 60"]),
    # -- hosts -----------------------------------------------------------------------------
    ("node_host_with_space", "nodes:\n  - {name: n, host: node 1}\n",
     ["nodes[0].host", "got 'node 1'"]),
    ("engine_host_leading_hyphen", engines("{name: e, model: m, host: -bad.example}"),
     ["nodes[0].engines[0].host", "got '-bad.example'"]),
    ("controller_host_bad_ipv4", "controller:\n  host: 300.1.2.3\n",
     ["controller.host", "got '300.1.2.3'"]),
    ("coordinator_host_bracketed_ipv6", "coordinator:\n  host: '[::1]'\n",
     ["coordinator.host", "without brackets", "got '[::1]'"]),
    ("controller_host_underscore", "controller:\n  host: my_host\n",
     ["controller.host", "got 'my_host'"]),
    ("coordinator_host_url", "coordinator:\n  host: http://127.0.0.1\n",
     ["coordinator.host", "got 'http://127.0.0.1'"]),
    # -- managed engine flags, each kind ---------------------------------------------------
    ("vllm_tensor_parallel_size",
     engines("{name: e, kind: vllm, model: m, engine_config: {tensor_parallel_size: 4}}"),
     ["nodes[0].engines[0].engine_config.tensor_parallel_size", "nodes[0].engines[0].tp_size",
      "got tensor_parallel_size: 4"]),
    ("vllm_served_model_name_dashes",
     engines("{name: e, kind: vllm, model: m, engine_config: {--served-model-name: x}}"),
     ["nodes[0].engines[0].engine_config.--served-model-name", "served_model_name", "'x'"]),
    ("vllm_data_parallel_size_with_dp_1",
     engines("{name: e, kind: vllm, model: m, engine_config: {data-parallel-size: 2}}"),
     ["nodes[0].engines[0].engine_config.data-parallel-size", "nodes[0].engines[0].dp_size"]),
    ("sglang_model_path",
     engines("{name: e, kind: sglang, model: m, engine_config: {model_path: /x}}"),
     ["nodes[0].engines[0].engine_config.model_path", "nodes[0].engines[0].model", "'/x'"]),
    ("sglang_disaggregation_mode",
     engines("{name: e, kind: sglang, model: m, engine_config: {disaggregation-mode: prefill}}"),
     ["nodes[0].engines[0].engine_config.disaggregation-mode", "nodes[0].engines[0].role"]),
    ("sglang_tp_size", engines("{name: e, kind: sglang, model: m, engine_config: {tp-size: 2}}"),
     ["nodes[0].engines[0].engine_config.tp-size", "tp_size", "2"]),
    ("sim_role", engines("{name: e, kind: sim, model: m, engine_config: {role: decode}}"),
     ["nodes[0].engines[0].engine_config.role", "nodes[0].engines[0].role", "'decode'"]),
    ("sim_host", engines("{name: e, kind: sim, model: m, engine_config: {host: 0.0.0.0}}"),
     ["nodes[0].engines[0].engine_config.host", "nodes[0].engines[0].host", "'0.0.0.0'"]),
    ("flag_in_two_spellings",
     engines("{name: e, kind: vllm, model: m, engine_config: {max_model_len: 1, "
             "max-model-len: 2}}"),
     ["nodes[0].engines[0].engine_config.max-model-len", "'max_model_len'"]),
    # -- duplicate names, port clashes -----------------------------------------------------
    ("duplicate_node_names", "nodes:\n  - {name: a}\n  - {name: a, host: 10.0.0.2}\n",
     ["nodes[1].name", "got 'a' again", "nodes[0].name"]),
    ("engine_port_is_the_coordinator_port", engines("{name: e, model: m, base_port: 8000}"),
     ["nodes[0].engines[0].base_port", "port 8000", "coordinator.port"]),
    ("dp_ranks_overlap_next_engine",
     engines("{name: a, model: m, count: 2, dp_size: 2, base_port: 9000}",
             "{name: b, model: m, base_port: 9003}"),
     ["nodes[0].engines[1].base_port", "port 9003", "instance 1, DP rank 1"]),
    ("mgmt_port_is_the_controller_port", "nodes:\n  - {name: n, mgmt_port: 18500}\n",
     ["nodes[0].mgmt_port", "port 18500", "controller.port"]),
    # -- others ----------------------------------------------------------------------------
    ("engine_name_with_space", engines("{name: a b, model: m}"),
     ["nodes[0].engines[0].name", "got 'a b'"]),
    ("metaserver_url_ftp", "coordinator:\n  pd: {metaserver_url: 'ftp://x'}\n",
     ["coordinator.pd.metaserver_url", "got 'ftp://x'"]),
]

GOOD: list[tuple[str, str]] = [
    ("controller_only", "controller:\n  host: 0.0.0.0\n  port: 18501\n"),
    ("coordinator_only_pd", "coordinator:\n  mode: pd_prefill_first\n  host: '::'\n"),
    ("empty_nodes_pd", "coordinator: {mode: pd_bootstrap}\nnodes: []\n"),
    ("node_without_engines_pd", "coordinator: {mode: pd_decode_first}\nnodes: [{name: n}]\n"),
    ("pd_with_union_fallback_and_union_model",
     engines(P, D, U, "{name: emb, role: union, model: embedder, base_port: 18130}",
             mode="pd_prefill_first")),
    ("pd_split_over_nodes",
     "coordinator: {mode: pd_decode_first}\nnodes:\n"
     "  - {name: n0, host: node-0.example.com, engines: [{name: p, role: prefill, model: m}]}\n"
     "  - {name: n1, host: 10.0.0.2, engines: [{name: d, role: decode, model: m,\n"
     "                                          host: 10.0.0.2}]}\n"),
    ("pd_served_name_pairs_with_model",
     engines("{name: p, role: prefill, model: /models/x, served_model_name: x}",
             "{name: d, role: decode, model: x, base_port: 18110}", mode="pd_bootstrap")),
    ("hosts", "controller: {host: localhost}\ncoordinator: {host: '::1'}\n"
              "nodes:\n  - {name: n, host: node-1.example.com., engines: "
              "[{name: e, model: m, host: 10.0.0.5}]}\n"),
    ("heartbeat_timeout_twice_interval",
     "controller: {heartbeat_interval_s: 2.5, heartbeat_timeout_s: 5}\n"),
    ("equal_pairs", "coordinator:\n  retries: {backoff_s: 1, backoff_max_s: 1}\n"
                    "  breaker: {open_s: 2, open_max_s: 2}\n"),
    ("motor_defaults_replaced",
     engines("{name: p, kind: vllm, role: prefill, model: m, engine_config: "
             "{kv_transfer_config: {kv_connector: NixlConnector}, data_parallel_rpc_port: 3}}",
             "{name: d, kind: sglang, role: decode, model: m, base_port: 18110, engine_config: "
             "{disaggregation-bootstrap-port: 9000, max_running_requests: 8}}",
             mode="pd_prefill_first")),
]


def _message(tmp_path: Path, text: str) -> str:
    path = tmp_path / "motor.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(path)
    return str(ei.value)


@pytest.mark.parametrize(("text", "parts"), [pytest.param(t, p, id=i) for i, t, p in BAD])
def test_bad_config_is_refused_naming_field_expected_and_received(tmp_path: Path, text: str,
                                                                  parts: list[str]) -> None:
    msg = _message(tmp_path, text)
    head, *lines = msg.splitlines()
    assert head == f"invalid config {tmp_path / 'motor.yaml'}:", msg
    for part in parts:
        assert part in msg, (part, msg)
    # one message per error, each "  <field>: ...expected..., got <value>": one "got", no dump
    assert len(lines) == 1, msg
    line = lines[0]
    assert re.match(r"  [\w.\[\]-]+: ", line), msg
    assert "expected" in line or "must be" in line, msg
    assert line.count("got ") == 1, msg
    assert "Input should" not in line and "Value error" not in line and "{'" not in line, msg


@pytest.mark.parametrize("text", [pytest.param(t, id=i) for i, t in GOOD])
def test_good_config_loads(tmp_path: Path, text: str) -> None:
    path = tmp_path / "motor.yaml"
    path.write_text(text)
    load_config(path)


@pytest.mark.parametrize("name", ["default.yaml", "pd.yaml"])
def test_embedded_configs_load_from_a_file(tmp_path: Path, name: str) -> None:
    text = resources.files("motor.config").joinpath(name).read_text(encoding="utf-8")
    (tmp_path / name).write_text(text)
    assert load_config(tmp_path / name) == load_default_config("pd" if name == "pd.yaml"
                                                               else "union")
    load_config(ROOT / "examples" / "cluster.yaml")


# -- the entry points: exit 2, the field named, no traceback --------------------------------

def _run(argv: list[str], cwd: Path, timeout: float = 30) -> tuple[int, str]:
    """``python -m motor ARGV`` in its own process group (killed whole if it outlives
    ``timeout``, as a command that did not refuse its config would); (status, stdout+stderr)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "motor", *argv], cwd=cwd, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return -1, out + err
    return p.returncode, out + err


ROWS = {i: (t, p) for i, t, p in BAD}
CLI = [("controller", "union_mode_prefill_role"), ("controller", "heartbeat_interval_10_timeout_1"),
       ("up", "engine_config_port"), ("up", "pd_models_differ"),
       ("coordinator", "coordinator_host_not_a_host"), ("coordinator", "duplicate_engine_names")]


@pytest.mark.parametrize(("command", "row"), CLI)
def test_commands_exit_2_on_a_bad_config(tmp_path: Path, command: str, row: str) -> None:
    text, parts = ROWS[row]
    path = tmp_path / "motor.yaml"
    path.write_text(text)
    rc, out = _run([command, "-c", str(path)], tmp_path)
    assert rc == 2, out
    assert parts[0] in out, out
    assert "Traceback" not in out, out


@pytest.mark.parametrize(("backends", "mode", "parts"), [
    (["http://127.0.0.1:9"], "pd_prefill_first",
     ["--backend", "prefill and one decode backend", "--mode pd_prefill_first", "got roles union"]),
    (["prefill=http://127.0.0.1:9"], "pd_bootstrap", ["--backend", "got roles prefill"]),
    (["prefill=http://127.0.0.1:9", "decode=http://127.0.0.1:8"], None,
     ["--backend", "only union backends", "got roles decode, prefill"]),
])
def test_standalone_coordinator_refuses_backends_without_the_roles_of_its_mode(
        tmp_path: Path, backends: list[str], mode: str | None, parts: list[str]) -> None:
    argv = ["coordinator", "--port", "18999", "--backend", *backends]
    rc, out = _run(argv + (["--mode", mode] if mode else []), tmp_path)
    assert rc == 2, out
    for part in parts:
        assert part in out, (part, out)
    assert "Traceback" not in out, out


# -- one table of managed flags for the schema and the engine backends ----------------------

def _managed_set_by_backends(monkeypatch: pytest.MonkeyPatch, kind: str) -> set[str]:
    """Every flag a backend passes to ``engine_flags`` as ``managed`` over the variants that
    change what it sets (role, dp_size)."""
    import importlib

    from motor.node_manager import engines as base
    mod = importlib.import_module(f"motor.node_manager.engines.{kind}")
    seen: set[str] = set()

    def spy(user: Any, **kw: Any) -> list[str]:
        seen.update(flag_key(k) for k, _ in kw.get("managed", ()))
        return base.engine_flags(user, **kw)
    monkeypatch.setattr(mod, "engine_flags", spy)
    for role in ("union", "prefill", "decode"):
        for dp in (1, 2):
            node = NodeConfig(name="n", engines=[EngineConfig(name="e", kind=kind, role=role,
                                                              model="m", dp_size=dp)])
            base.plan_node(node)
    return seen


@pytest.mark.parametrize("kind", sorted(MANAGED_FLAGS))
def test_managed_flag_table_is_what_the_backends_set(monkeypatch: pytest.MonkeyPatch,
                                                     kind: str) -> None:
    assert _managed_set_by_backends(monkeypatch, kind) == set(MANAGED_FLAGS[kind])


@pytest.mark.parametrize(("kind", "flag"),
                         [(k, f) for k in sorted(MANAGED_FLAGS) for f in MANAGED_FLAGS[k]])
def test_every_managed_flag_is_refused_at_load_and_by_the_node_manager(
        tmp_path: Path, kind: str, flag: str) -> None:
    field = MANAGED_FLAGS[kind][flag]
    key = flag.replace("-", "_")
    msg = _message(tmp_path, engines(f"{{name: e, kind: {kind}, model: m, "
                                     f"engine_config: {{{key}: 1}}}}"))
    assert f"nodes[0].engines[0].engine_config.{key}: " in msg, msg
    assert f"nodes[0].engines[0].{field}" in msg, msg
    # the node manager's own check (a NodeConfig built without the cluster's load-time check)
    from motor.node_manager.engines import plan_node
    node = NodeConfig(name="n", engines=[EngineConfig(name="e", kind=kind, model="m",
                                                      engine_config={key: 1})])
    with pytest.raises(ConfigError, match=re.escape(f"engine_config.{key}: --{flag} is set by "
                                                    f"motor from the engine's {field!r} field")):
        plan_node(node)


def test_docs_list_the_rules() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert "## Rules across fields" in text
    for needle in ("`controller.heartbeat_timeout_s`", "`coordinator.mode: pd_*`",
                   "every `host`", "`nodes[].engines[].engine_config`"):
        assert needle in text, needle

