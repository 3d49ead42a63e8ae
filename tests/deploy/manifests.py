"""Rendering and reading deploy/k8s for the deploy tests: the overlays, their rendered objects,
the pods' environments as the kubelet would give them, and the config each pod runs with."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
#: what the Downward API gives a pod in the tests (one pod of each workload)
POD_IP = "10.1.2.3"
NAMESPACE = "motor"


def require_tool(name: str) -> str:
    """The path of tool ``name``; skips the test when it is missing, unless
    ``MOTOR_REQUIRE_DEPLOY_TOOLS=1`` (.ci/deploy.sh) makes that a failure."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("MOTOR_REQUIRE_DEPLOY_TOOLS") == "1":
            pytest.fail(f"{name} is not on PATH (MOTOR_REQUIRE_DEPLOY_TOOLS=1)")
        pytest.skip(f"{name} is not on PATH (.ci/deploy.sh installs it)")
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    """``kubectl kustomize deploy/k8s/overlays/<overlay>``: the objects, in order."""
    kubectl = require_tool("kubectl")
    r = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def raw_documents() -> list[tuple[Path, Any]]:
    """Every YAML document under deploy/k8s, with its file (kustomizations, resources, patches,
    the overlays' motor.yaml)."""
    out = []
    for p in sorted(K8S.rglob("*.yaml")):
        for d in yaml.safe_load_all(p.read_text()):
            if d is not None:
                out.append((p, d))
    return out


def workloads(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def motor_container(workload: dict[str, Any]) -> dict[str, Any] | None:
    """The container that runs motor (image ``.../motor:TAG``), None for etcd."""
    for c in workload["spec"]["template"]["spec"]["containers"]:
        if c["image"].rsplit("/", 1)[-1].split(":")[0] == "motor":
            return c
    return None


def pod_env(workload: dict[str, Any], container: dict[str, Any], pod_name: str | None = None,
            pod_ip: str = POD_IP) -> dict[str, str]:
    """The container's environment as a pod gets it (Downward API fields filled in): pod
    ``pod_name`` (default: the first, ``<workload>-0``) at ``pod_ip``."""
    pod_name = pod_name or f"{workload['metadata']['name']}-0"
    fields = {"status.podIP": pod_ip, "metadata.name": pod_name, "metadata.namespace": NAMESPACE}
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        else:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise AssertionError(f"no {kind} {name} in the rendered objects")


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    """name (or the number as text) -> containerPort."""
    out = {}
    for p in container.get("ports", []):
        out[p.get("name", str(p["containerPort"]))] = p["containerPort"]
        out[str(p["containerPort"])] = p["containerPort"]
    return out


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())
