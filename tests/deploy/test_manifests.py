"""deploy/k8s: every overlay renders (kubectl kustomize), every object is valid against a
current Kubernetes schema (kubernetes-validate), and the manifests agree with the config they
carry: it loads through motor's schema, every pod's environment is one motor run accepts,
every port is the config's, the NPUs are what the engines take, the grace periods cover the
drains. The checks on raw files run in the default suite; rendering needs kubectl (marker
``deploy``, .ci/deploy.sh)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from motor.config import parse_config
from motor.config.load import load_config
from motor.run import known_env, plan
from tests.deploy.manifests import (K8S, OVERLAYS, container_ports, find, motor_container,
                                    pod_env, raw_documents, render, require_tool, selects,
                                    workloads)

DEVICE_KINDS = ("vllm", "sglang")
NPU = "huawei.com/Ascend910"


def test_both_shapes_have_an_overlay() -> None:
    assert OVERLAYS == ["pd", "union"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_config_loads_through_motor_s_schema(overlay: str) -> None:
    cfg = load_config(K8S / "overlays" / overlay / "motor.yaml")
    assert cfg.controller.etcd is not None and cfg.coordinator.management_port
    assert cfg.coordinator.mode.value == ("union" if overlay == "union" else "pd_prefill_first")


def test_every_env_var_in_the_raw_manifests_is_known() -> None:
    seen = set()

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if isinstance(x.get("env"), list):
                for e in x["env"]:
                    if isinstance(e, dict) and "name" in e:
                        seen.add(e["name"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    for path, doc in raw_documents():
        if path.name == "etcd.yaml":   # etcd's own container
            continue
        walk(doc)
    assert "MOTOR_ROLE" in seen
    assert sorted(n for n in seen if not known_env(n)) == []


# ---------------------------------------------------------------- rendered (kubectl)


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def _config_map(objs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    cms = [o for o in objs if o["kind"] == "ConfigMap" and "motor.yaml" in o.get("data", {})]
    assert len(cms) == 1, [o["metadata"]["name"] for o in cms]
    return cms[0]["metadata"]["name"], yaml.safe_load(cms[0]["data"]["motor.yaml"])


def _pods(objs: list[dict[str, Any]], tmp: Path) -> list[tuple[dict[str, Any], dict[str, Any],
                                                              Any]]:
    """(workload, motor container, plan of its first pod) for every motor workload."""
    name, data = _config_map(objs)
    out = []
    for w in workloads(objs):
        c = motor_container(w)
        if c is None:
            continue
        spec = w["spec"]["template"]["spec"]
        env = pod_env(w, c)
        # the config as mounted: the volume of the ConfigMap at the directory of MOTOR_CONFIG
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        vols = [v["name"] for v in spec["volumes"] if v.get("configMap", {}).get("name") == name]
        assert len(vols) == 1, w["metadata"]["name"]
        assert env["MOTOR_CONFIG"] == mounts[vols[0]] + "/motor.yaml", w["metadata"]["name"]
        path = tmp / f"{w['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(data))
        out.append((w, c, plan({**env, "MOTOR_CONFIG": str(path)})))
    return out


@pytest.mark.deploy
def test_overlay_renders_the_same_objects_each_time(rendered: tuple[str, list[Any]]) -> None:
    overlay, objs = rendered
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "NetworkPolicy", "ServiceAccount", "Role",
            "RoleBinding"} <= kinds
    assert render(overlay) == objs


@pytest.mark.deploy
def test_every_object_is_valid_against_the_kubernetes_schema(
        rendered: tuple[str, list[Any]]) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        require_tool("kubernetes-validate")   # skips (or fails under MOTOR_REQUIRE_DEPLOY_TOOLS)
        raise
    version = kubernetes_validate.latest_version()
    _overlay, objs = rendered
    for o in objs:
        kubernetes_validate.validate(o, version, strict=True)
    # the validator does refuse a broken object
    broken = copy.deepcopy(workloads(objs)[0])
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.deploy
def test_rendered_config_loads_and_every_pod_starts_from_its_env(
        rendered: tuple[str, list[Any]], tmp_path: Path) -> None:
    overlay, objs = rendered
    _name, data = _config_map(objs)
    cfg = parse_config(data, f"{overlay} ConfigMap")
    pods = _pods(objs, tmp_path)
    roles = sorted(p.role for _w, _c, p in pods)
    groups = len(cfg.nodes)
    assert roles == sorted(["controller", "coordinator"] + ["engine-pod"] * groups)
    for _w, c, _p in pods:
        names = [e["name"] for e in c.get("env", [])]
        assert sorted(n for n in names if not known_env(n)) == []
        assert len(names) == len(set(names))
    # every template node is one engine group's StatefulSet
    templates = sorted(pod_env(w, c)["MOTOR_NODE_TEMPLATE"] for w, c, p in pods
                       if p.role == "engine-pod")
    assert templates == sorted(n.name for n in cfg.nodes)


def _declared(c: dict[str, Any]) -> set[int]:
    return {p["containerPort"] for p in c.get("ports", [])}


def _probe_port(c: dict[str, Any], probe: str) -> int:
    port = c[probe]["httpGet"]["port"]
    return container_ports(c)[str(port)]


@pytest.mark.deploy
def test_every_port_is_the_config_s(rendered: tuple[str, list[Any]], tmp_path: Path) -> None:
    _overlay, objs = rendered
    for w, c, p in _pods(objs, tmp_path):
        cfg = parse_config(copy.deepcopy(p.config))
        what = w["metadata"]["name"]
        ann = w["spec"]["template"]["metadata"]["annotations"]
        if p.role == "controller":
            want, metrics = {cfg.controller.port}, cfg.controller.port
            ready = live = cfg.controller.port
        elif p.role == "coordinator":
            co = cfg.coordinator
            assert co.management_port
            want, metrics = {co.port, co.management_port}, co.management_port
            ready, live = co.management_port, co.port
        else:
            node = next(n for n in cfg.nodes if n.name == pod_env(w, c)["POD_NAME"])
            assert node.mgmt_port
            engine_ports = {e.base_port + k for e in node.engines
                            for k in range(e.count * e.dp_size)}
            want, metrics = {node.mgmt_port} | engine_ports, node.mgmt_port
            ready = live = node.mgmt_port
        assert _declared(c) == want, what
        assert (_probe_port(c, "readinessProbe"), _probe_port(c, "livenessProbe")) == \
            (ready, live), what
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == \
            metrics, what
    # Services: each targets a declared port of the pods it selects, on the same number
    labels = {w["metadata"]["name"]: (w["spec"]["template"]["metadata"]["labels"],
                                      w["spec"]["template"]["spec"]["containers"][0])
              for w in workloads(objs)}
    for s in (o for o in objs if o["kind"] == "Service"):
        backends = [c for lab, c in labels.values() if selects(s["spec"]["selector"], lab)]
        assert backends, s["metadata"]["name"]
        for sp in s["spec"]["ports"]:
            for c in backends:
                assert container_ports(c)[str(sp["targetPort"])] == sp["port"], \
                    (s["metadata"]["name"], sp)
    # NetworkPolicies: each port it opens is declared by a pod it selects
    for np in (o for o in objs if o["kind"] == "NetworkPolicy"):
        sel = np["spec"]["podSelector"].get("matchLabels", {})
        selected = [c for lab, c in labels.values() if selects(sel, lab)]
        assert selected, np["metadata"]["name"]
        for rule in np["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                assert any(port["port"] in _declared(c) for c in selected), \
                    (np["metadata"]["name"], port)


@pytest.mark.deploy
def test_addresses_in_the_config_exist_in_the_manifests(rendered: tuple[str, list[Any]],
                                                        tmp_path: Path) -> None:
    _overlay, objs = rendered
    _name, data = _config_map(objs)
    cfg = parse_config(data)
    # MOTOR_CONTROLLER is the controller Service, on controller.port
    for w, c, p in _pods(objs, tmp_path):
        env = pod_env(w, c)
        if "MOTOR_CONTROLLER" in env:
            svc = find(objs, "Service", env["MOTOR_CONTROLLER"])
            assert [sp["port"] for sp in svc["spec"]["ports"]] == [cfg.controller.port]
        if p.role == "coordinator":
            keys = cfg.coordinator.api_keys_file
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            vol = next(v for v in w["spec"]["template"]["spec"]["volumes"]
                       if v["name"] == mounts[keys])
            assert "secret" in vol
        if w["kind"] == "StatefulSet":
            find(objs, "Service", w["spec"]["serviceName"])
    # controller.etcd.endpoints: the etcd StatefulSet's members, on its client port
    assert cfg.controller.etcd is not None
    etcd = find(objs, "StatefulSet", "motor-etcd")
    svc = etcd["spec"]["serviceName"]
    client = container_ports(etcd["spec"]["template"]["spec"]["containers"][0])["client"]
    assert cfg.controller.etcd.endpoints == [f"motor-etcd-{i}.{svc}:{client}"
                                             for i in range(etcd["spec"]["replicas"])]
    assert etcd["spec"]["replicas"] == 3


@pytest.mark.deploy
def test_npus_and_grace_periods_fit_the_config(rendered: tuple[str, list[Any]],
                                               tmp_path: Path) -> None:
    _overlay, objs = rendered
    for w, c, p in _pods(objs, tmp_path):
        cfg = parse_config(copy.deepcopy(p.config))
        spec = w["spec"]["template"]["spec"]
        grace = spec["terminationGracePeriodSeconds"]
        res = c["resources"]
        assert "cpu" in res["requests"] and "memory" in res["requests"]
        if p.role == "coordinator":
            pre = c["lifecycle"]["preStop"]["exec"]["command"]
            assert pre[0] == "sleep"
            assert grace >= int(pre[1]) + cfg.coordinator.drain_timeout_s + 5
        if p.role == "engine-pod":
            node = next(n for n in cfg.nodes if n.name == pod_env(w, c)["POD_NAME"])
            npus = sum(e.count * e.dp_size * e.tp_size for e in node.engines
                       if e.kind.value in DEVICE_KINDS)
            assert res["requests"][NPU] == res["limits"][NPU] == str(npus), w["metadata"]["name"]
            assert grace >= max(e.stop_timeout_s for e in node.engines) + 15
            assert spec["shareProcessNamespace"] is True
    # every Deployment behind a PodDisruptionBudget; the coordinators autoscaled
    for d in (o for o in objs if o["kind"] == "Deployment"):
        lab = d["spec"]["template"]["metadata"]["labels"]
        assert any(selects(b["spec"]["selector"]["matchLabels"], lab)
                   for b in objs if b["kind"] == "PodDisruptionBudget"), d["metadata"]["name"]
    hpa = find(objs, "HorizontalPodAutoscaler", "motor-coordinator")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "motor-coordinator"
