"""The image recipe without Docker: the Dockerfile's build and install steps are
deploy/docker/build.sh, which this test runs the same way; the wheel it builds installs into a
fresh venv with no compiler on PATH, and the image's entrypoint starts every role from the
environment alone (controller, coordinator, an engine pod with a simulated engine), each
answering on 127.0.0.1."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.procs import free_ports, stop, wait_http

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
BUILD = DOCKER / "build.sh"
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "x86_64-linux-gnu-gcc", "aarch64-linux-gnu-gcc")
#: what build.sh and the entrypoint need besides Python; nothing that compiles
TOOLS = ("bash", "sh", "env", "ls", "cat", "mktemp", "rm", "grep", "dirname", "sed", "tr",
         "uname", "tar", "mkdir", "ln", "sleep")


def _run_lines(dockerfile: str) -> list[str]:
    """RUN instructions, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile)
    return [ln.strip()[4:] for ln in text.splitlines() if ln.strip().startswith("RUN ")]


def test_the_dockerfile_builds_and_installs_with_the_build_script() -> None:
    df = (DOCKER / "Dockerfile").read_text()
    runs = _run_lines(df)
    assert sum("/src/deploy/docker/build.sh wheel /wheels /src" in r for r in runs) == 1
    assert sum("/usr/local/lib/motor/build.sh install /tmp/motor-wheels" in r for r in runs) == 1
    assert re.search(r"^ARG BASE_IMAGE=quay\.io/ascend/vllm-ascend:v\d+\.\d+\.\d+", df, re.M)
    assert df.count("FROM ${BASE_IMAGE}") == 2          # build stage and final stage
    assert re.search(r"^USER 10001:10001$", df, re.M)   # non-root
    assert 'ENTRYPOINT ["/usr/local/lib/motor/entrypoint.sh"]' in df
    assert "exec motor run" in (DOCKER / "entrypoint.sh").read_text()
    final = df.split("FROM ${BASE_IMAGE}\n", 1)[1]
    assert not re.search(r"\b(gcc|g\+\+|clang|build-essential)\b", final), \
        "the final stage installs no compiler"


def test_the_build_context_has_what_the_build_script_copies() -> None:
    ignore = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert ignore[0] == "*"
    admitted = {ln[1:] for ln in ignore if ln.startswith("!")}
    script = BUILD.read_text()
    copied = re.search(r"^\s+pyproject\.toml .*\| tar", script, re.M)
    assert copied is not None
    wanted = set(copied.group(0).split("|")[0].split())
    assert wanted <= admitted
    df = (DOCKER / "Dockerfile").read_text()
    for m in re.finditer(r"^COPY (?!--from)(.+) \S+$", df, re.M):
        for src in m.group(1).split():
            assert src == "." or src in admitted, src


# ---------------------------------------------------------------- the wheel in a fresh venv


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with motor installed from the wheel build.sh made, and the environment
    (PATH of that venv + basic tools, no compiler) the roles run in."""
    tmp = tmp_path_factory.mktemp("image")
    wheels = tmp / "wheels"
    r = subprocess.run(["bash", str(BUILD), "wheel", str(wheels)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(list(wheels.glob("motor-*.whl"))) == 1
    base = getattr(sys, "_base_executable", sys.executable)
    env_dir = tmp / "venv"
    subprocess.run([base, "-m", "venv", str(env_dir)], check=True, timeout=120)
    tools = tmp / "bin"
    tools.mkdir()
    import shutil
    for t in TOOLS:
        found = shutil.which(t)
        assert found, t
        (tools / t).symlink_to(found)
    path = f"{env_dir / 'bin'}:{tools}"
    for c in COMPILERS:
        assert shutil.which(c, path=path) is None, c
    env = {"PATH": path, "HOME": os.environ.get("HOME", str(tmp)), "TMPDIR": str(tmp),
           "LANG": "C.UTF-8"}
    for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONFIG_FILE"):
        if k in os.environ:
            env[k] = os.environ[k]
    r = subprocess.run(["bash", str(BUILD), "install", str(wheels)], capture_output=True,
                       text=True, timeout=600, env={**env, "PYTHON": str(env_dir / "bin/python")})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # motor came from the wheel, compiled: not this checkout
    r = subprocess.run([str(env_dir / "bin/python"), "-c",
                        "import motor, motor._fast.radix as r; print(motor.__file__, r.__file__)"],
                       capture_output=True, text=True, timeout=60, env=env, cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert str(env_dir) in r.stdout and str(ROOT) not in r.stdout and ".so" in r.stdout
    return tmp, env


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def _start(tmp: Path, env: dict[str, str], name: str, role_env: dict[str, str]
           ) -> subprocess.Popen[bytes]:
    log = open(tmp / f"{name}.log", "ab")
    return subprocess.Popen(["bash", str(DOCKER / "entrypoint.sh")], env={**env, **role_env},
                            cwd=tmp, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                            start_new_session=True)


@pytest.mark.deploy
@pytest.mark.timeout(900)
def test_every_role_starts_from_the_environment_alone(venv: tuple[Path, dict[str, str]]) -> None:
    tmp, env = venv
    ctl, api, mgmt, engine = free_ports(4)
    config = tmp / "motor.yaml"
    # the shape of deploy/k8s: one template node whose name and host the pod's replace
    config.write_text(yaml.safe_dump({
        "controller": {"host": "127.0.0.1", "port": ctl},
        "coordinator": {"host": "127.0.0.1", "port": api, "drain_timeout_s": 2},
        "nodes": [{"name": "engine", "host": "motor-engine", "mgmt_port": mgmt,
                   "engines": [{"name": "sim", "kind": "sim", "model": "motor-sim",
                                "host": "motor-engine", "base_port": engine}]}]}))
    common = {"MOTOR_CONFIG": str(config), "POD_IP": "127.0.0.1", "POD_NAMESPACE": "motor"}
    url = f"http://127.0.0.1:{ctl}"
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    try:
        procs.append(("controller", _start(tmp, env, "controller", {
            **common, "MOTOR_ROLE": "controller", "POD_NAME": "motor-controller-x"})))
        wait_http(f"{url}/health", 60)
        procs.append(("engine-pod", _start(tmp, env, "engine-pod", {
            **common, "MOTOR_ROLE": "engine-pod", "POD_NAME": "motor-engine-0",
            "MOTOR_CONTROLLER": url, "MOTOR_ENGINE_LOG_DIR": str(tmp / "engine-logs")})))
        wait_http(f"http://127.0.0.1:{mgmt}/health", 60)
        procs.append(("coordinator", _start(tmp, env, "coordinator", {
            **common, "MOTOR_ROLE": "coordinator", "POD_NAME": "motor-coordinator-x",
            "MOTOR_CONTROLLER": url})))
        wait_http(f"http://127.0.0.1:{api}/health", 60)
        # the engine pod registered as its pod, at its pod's address, and became routable
        wait_http(f"http://127.0.0.1:{api}/readiness", 120)
        table = _get(f"{url}/v1/instances")
        assert [(i["id"], i["node"], i["state"], i["endpoints"][0]["host"])
                for i in table["instances"]] == \
            [("motor-engine-0/sim/0", "motor-engine-0", "ready", "127.0.0.1")]
        req = urllib.request.Request(
            f"http://127.0.0.1:{api}/v1/completions", method="POST",
            data=json.dumps({"model": "motor-sim", "prompt": "hi", "max_tokens": 4}).encode(),
            headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200 and json.loads(r.read())["choices"]
    finally:
        logs = "".join(f"--- {n}\n" + (tmp / f"{n}.log").read_text(errors="replace")[-3000:]
                       for n, _p in procs)
        for _name, p in reversed(procs):   # coordinator, engine pod, controller
            stop(p, 30)
    for name, p in procs:
        assert p.returncode == 0, f"{name} exited with {p.returncode}\n{logs}"
    assert "motor node-manager -c" in (tmp / "engine-pod.log").read_text()
