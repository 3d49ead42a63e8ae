"""``motor run`` (motor/run.py): the environment -> the role's command and config changes, and
every refusal naming the variable, what was expected and what came."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from motor import run
from motor.errors import ConfigError
from motor.run import EnvError, plan
from tests.support.procs import program_stderr

ROOT = Path(__file__).resolve().parents[2]

CONFIG = {
    "controller": {"host": "0.0.0.0", "port": 18500},
    "coordinator": {"host": "0.0.0.0", "port": 8000, "management_port": 18300},
    "nodes": [
        {"name": "tmpl", "host": "tmpl", "mgmt_port": 18600,
         "engines": [{"name": "sim", "kind": "sim", "model": "m", "host": "tmpl",
                      "base_port": 18100, "count": 2}]},
    ],
}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    p = tmp_path / "motor.yaml"
    p.write_text(yaml.safe_dump(CONFIG))
    return p


def env_of(config: Path, **kv: str) -> dict[str, str]:
    return {"MOTOR_CONFIG": str(config), **kv}


def test_controller_advertises_the_pod_ip(config: Path) -> None:
    p = plan(env_of(config, MOTOR_ROLE="controller", POD_IP="10.0.0.5"))
    assert p.argv("F") == ["controller", "-c", "F"]
    assert p.config["controller"]["advertise_host"] == "10.0.0.5"
    assert p.changes == [("controller.advertise_host", "10.0.0.5", "POD_IP")]


def test_controller_with_etcd_on_a_wildcard_needs_an_address(tmp_path: Path) -> None:
    cfg = dict(CONFIG, controller={"host": "0.0.0.0", "etcd": {"endpoints": ["etcd:2379"]}})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(EnvError, match=r"^POD_IP: expected the pod's IP address \(controller"
                                       r".host is 0.0.0.0 .*got nothing \(not set\)$"):
        plan({"MOTOR_CONFIG": str(path), "MOTOR_ROLE": "controller"})


def test_listen_host_sets_the_role_s_host(config: Path) -> None:
    p = plan(env_of(config, MOTOR_ROLE="coordinator", MOTOR_LISTEN_HOST="127.0.0.1",
                    MOTOR_CONTROLLER="ctl"))
    assert p.config["coordinator"]["host"] == "127.0.0.1"
    assert ("coordinator.host", "127.0.0.1", "MOTOR_LISTEN_HOST") in p.changes


def test_coordinator_follows_the_controller_service(config: Path) -> None:
    p = plan(env_of(config, MOTOR_ROLE="coordinator", MOTOR_CONTROLLER="motor-controller",
                    MOTOR_COORDINATOR_WORKERS="4"))
    assert p.options == ["--controller", "http://motor-controller:18500", "--workers", "4"]
    p = plan(env_of(config, MOTOR_ROLE="coordinator", MOTOR_CONTROLLER="http://10.0.0.1:1/"))
    assert p.options == ["--controller", "http://10.0.0.1:1"]


def test_a_wildcard_controller_host_needs_motor_controller(config: Path) -> None:
    with pytest.raises(EnvError, match=r"^MOTOR_CONTROLLER: expected the controller's Service "
                                       r"name or URL \(controller.host of the config is "
                                       r"0.0.0.0 and controller.peers is empty\), got nothing"):
        plan(env_of(config, MOTOR_ROLE="coordinator"))


def test_decode_first_coordinator_gets_its_metaserver_url(tmp_path: Path) -> None:
    cfg = {"controller": {"host": "127.0.0.1"},
           "coordinator": {"host": "0.0.0.0", "port": 8000, "mode": "pd_decode_first"}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    p = plan({"MOTOR_CONFIG": str(path), "MOTOR_ROLE": "coordinator", "POD_IP": "10.0.0.9"})
    assert p.config["coordinator"]["pd"]["metaserver_url"] == "http://10.0.0.9:8000/v1/metaserver"
    assert p.options == []   # controller.host 127.0.0.1: the config's URL


def test_engine_pod_is_its_template_renamed_at_the_pod_ip(config: Path) -> None:
    p = plan(env_of(config, MOTOR_ROLE="engine-pod", POD_NAME="motor-engine-3",
                    POD_IP="10.0.0.7", MOTOR_CONTROLLER="motor-controller"))
    assert p.argv("F") == ["node-manager", "-c", "F", "--node", "motor-engine-3",
                           "--controller", "http://motor-controller:18500"]
    node = p.config["nodes"][0]
    assert (node["name"], node["host"], node["engines"][0]["host"]) == \
        ("motor-engine-3", "10.0.0.7", "10.0.0.7")
    assert [v for _w, _x, v in p.changes] == ["POD_NAME", "POD_IP", "POD_IP"]


def test_engine_pod_template_is_named_when_the_config_has_several(tmp_path: Path) -> None:
    cfg = dict(CONFIG, nodes=[dict(CONFIG["nodes"][0], name="a"),
                              dict(CONFIG["nodes"][0], name="b", host="b",
                                   engines=[dict(CONFIG["nodes"][0]["engines"][0], host="b")])])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    base = {"MOTOR_CONFIG": str(path), "MOTOR_ROLE": "engine-pod", "POD_NAME": "p-0",
            "POD_IP": "10.0.0.1", "MOTOR_CONTROLLER": "ctl"}
    with pytest.raises(EnvError, match=r"^MOTOR_NODE_TEMPLATE: expected one of the config's 2 "
                                       r"nodes \(a, b\), got nothing \(not set\)$"):
        plan(base)
    p = plan({**base, "MOTOR_NODE_TEMPLATE": "b"})
    assert [n["name"] for n in p.config["nodes"]] == ["a", "p-0"]
    with pytest.raises(EnvError, match=r"^POD_NAME: expected a name that is not another node "
                                       r"of the config \(a\), got 'a'$"):
        plan({**base, "MOTOR_NODE_TEMPLATE": "b", "POD_NAME": "a"})


def test_node_manager_runs_a_node_as_it_is(config: Path) -> None:
    p = plan(env_of(config, MOTOR_ROLE="node-manager", MOTOR_CONTROLLER="ctl"))
    assert p.argv("F") == ["node-manager", "-c", "F", "--node", "tmpl",
                           "--controller", "http://ctl:18500"]
    assert p.changes == []
    with pytest.raises(EnvError, match=r"^MOTOR_NODE: expected one of the config's nodes "
                                       r"\(tmpl\), got 'other'$"):
        plan(env_of(config, MOTOR_ROLE="node-manager", MOTOR_NODE="other",
                    MOTOR_CONTROLLER="ctl"))


@pytest.mark.parametrize(("env", "message"), [
    ({}, "MOTOR_ROLE: expected one of controller, coordinator, node-manager, engine-pod, got "
         "nothing (not set)"),
    ({"MOTOR_ROLE": "gateway"}, "MOTOR_ROLE: expected one of controller, coordinator, "
                                "node-manager, engine-pod, got 'gateway'"),
    ({"MOTOR_ROLE": "engine-pod", "POD_IP": "10.0.0.1"},
     "POD_NAME: expected the pod's name (the node's name for MOTOR_ROLE engine-pod), got "
     "nothing (not set)"),
    ({"MOTOR_ROLE": "engine-pod", "POD_NAME": "p-0"},
     "POD_IP: expected the pod's IP address (where the engines of MOTOR_ROLE engine-pod "
     "listen), got nothing (not set)"),
    ({"MOTOR_ROLE": "engine-pod", "POD_NAME": "p-0", "POD_IP": "10.0.0.300"},
     "POD_IP: expected the pod's IP address (an IPv4 or IPv6 address, not 0.0.0.0 / ::), got "
     "'10.0.0.300'"),
    ({"MOTOR_ROLE": "controller", "POD_IP": "0.0.0.0"},
     "POD_IP: expected the pod's IP address (an IPv4 or IPv6 address, not 0.0.0.0 / ::), got "
     "'0.0.0.0'"),
    ({"MOTOR_ROLE": "engine-pod", "POD_NAME": "a/b", "POD_IP": "10.0.0.1"},
     "POD_NAME: expected a pod name (a DNS subdomain: lower-case letters, digits, inner "
     "hyphens, dots; at most 253 characters), got 'a/b'"),
    ({"MOTOR_ROLE": "engine-pod", "POD_NAME": "Motor_Prefill", "POD_IP": "10.0.0.1"},
     "POD_NAME: expected a pod name (a DNS subdomain: lower-case letters, digits, inner "
     "hyphens, dots; at most 253 characters), got 'Motor_Prefill'"),
    ({"MOTOR_ROLE": "engine-pod", "MOTOR_ENGINE_START_ATTEMPTS": "abc"},
     "MOTOR_ENGINE_START_ATTEMPTS: expected an integer >= 1, got 'abc'"),
    ({"MOTOR_ROLE": "coordinator", "MOTOR_CONTROLLER": "ftp://x:1"},
     "MOTOR_CONTROLLER: expected the controller's Service name (a host name) or a URL "
     "http://HOST:PORT, got 'ftp://x:1'"),
    ({"MOTOR_ROLE": "coordinator", "MOTOR_CONTROLLER": "bad_name"},
     "MOTOR_CONTROLLER: expected the controller's Service name (a host name) or a URL "
     "http://HOST:PORT, got 'bad_name'"),
    ({"MOTOR_ROLE": "coordinator", "MOTOR_CONTROLLER": "c", "MOTOR_COORDINATOR_WORKERS": "0"},
     "MOTOR_COORDINATOR_WORKERS: expected an integer 1..64, got '0'"),
    ({"MOTOR_ROLE": "coordinator", "MOTOR_LISTEN_HOST": "not a host"},
     "MOTOR_LISTEN_HOST: expected an IP address or host name, got 'not a host'"),
    ({"MOTOR_ROLE": "controller", "MOTOR_LOG_LEVEL": "loud"},
     "MOTOR_LOG_LEVEL: expected one of debug, info, warning, error, got 'loud'"),
    ({"MOTOR_ROLE": "controller", "MOTOR_LOG_FORMAT": "xml"},
     "MOTOR_LOG_FORMAT: expected one of text, json, got 'xml'"),
    ({"MOTOR_ROLE": "controller", "POD_NAMESPACE": "Motor"},
     "POD_NAMESPACE: expected a namespace (a DNS label: lower-case letters, digits, inner "
     "hyphens), got 'Motor'"),
])
def test_bad_variables_are_named(config: Path, env: dict[str, str], message: str) -> None:
    with pytest.raises(EnvError) as e:
        plan(env_of(config, **env))
    assert str(e.value) == message
    assert e.value.variable == message.split(":")[0]


def test_a_missing_config_file_names_motor_config(tmp_path: Path) -> None:
    with pytest.raises(EnvError) as e:
        plan({"MOTOR_ROLE": "controller", "MOTOR_CONFIG": str(tmp_path / "no.yaml")})
    assert str(e.value) == (f"MOTOR_CONFIG: expected a config file (YAML or JSON), got "
                            f"'{tmp_path / 'no.yaml'}' (no such file)")


def test_a_change_the_schema_refuses_names_the_variable(tmp_path: Path) -> None:
    # the coordinator's API port on the engine pod's address: two listeners on one port
    cfg = dict(CONFIG, coordinator={"host": "10.0.0.1", "port": 18100})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(ConfigError) as e:
        plan({"MOTOR_CONFIG": str(path), "MOTOR_ROLE": "engine-pod", "POD_NAME": "p-0",
              "POD_IP": "10.0.0.1", "MOTOR_CONTROLLER": "ctl"})
    text = str(e.value)
    assert "as changed by the environment" in text and "from POD_IP" in text
    assert "nodes[0].engines[0].base_port" in text


def test_motor_run_refuses_a_bad_environment_with_status_2(config: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "motor", "run"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "MOTOR_CONFIG": str(config),
                            "MOTOR_ROLE": "engine-pod", "POD_NAME": "p-0"})
    assert r.returncode == 2 and r.stdout == ""
    assert program_stderr(r.stderr).splitlines() == [
        "motor run: POD_IP: expected the pod's IP address (where the engines of MOTOR_ROLE "
        "engine-pod listen), got nothing (not set)"]


def test_dry_run_prints_the_command_and_the_changes(config: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "motor", "run", "--dry-run"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "MOTOR_CONFIG": str(config),
                            "MOTOR_ROLE": "engine-pod", "POD_NAME": "p-0", "POD_IP": "10.0.0.2",
                            "MOTOR_CONTROLLER": "ctl"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "motor node-manager -c <changed config> --node p-0 --controller http://ctl:18500",
        f"config: {config}",
        "  nodes[0].name = 'p-0' (POD_NAME)",
        "  nodes[0].host = '10.0.0.2' (POD_IP)",
        "  nodes[0].engines[0].host = '10.0.0.2' (POD_IP)"]


def test_deployment_doc_carries_the_env_table() -> None:
    text = (ROOT / "docs" / "deployment.md").read_text()
    start, end = "<!-- env-table: python -m motor.run -->\n", "<!-- /env-table -->"
    assert start in text and end in text
    table = text.split(start, 1)[1].split(end, 1)[0]
    assert table == run.env_table(), "run: python -m motor.run, and paste it into docs/deployment.md"


def test_known_env() -> None:
    assert run.known_env("MOTOR_ROLE") and run.known_env("POD_IP")
    assert run.known_env("HCCL_SOCKET_IFNAME") and run.known_env("VLLM_USE_V1")
    assert not run.known_env("MOTOR_RUL") and not run.known_env("PODIP")
