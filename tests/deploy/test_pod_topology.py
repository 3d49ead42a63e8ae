"""The PD-separated overlay brought up as pods on this machine, and two pods taken down.

Every pod of ``kubectl kustomize deploy/k8s/overlays/pd`` (3 etcd members, 2 controllers, 2
coordinators, 2 prefill and 2 decode engine pods) runs in its own network namespace with its
own address in 198.18.1.0/24 (:mod:`tests.deploy.netns`), started the way its manifest starts
it: etcd with the StatefulSet's command line, every motor pod with the image's entrypoint
(``deploy/docker/entrypoint.sh`` -> ``motor run``) and exactly the environment its container
declares, the Downward API fields filled in as the kubelet would (``POD_IP``, ``POD_NAME``,
``POD_NAMESPACE``). What the test puts in place of Kubernetes, and nothing more:

* **Volumes**: the ConfigMap's ``motor.yaml``, the API-key Secret, the engines' log
  ``emptyDir`` and etcd's data volume are directories of the test; ``MOTOR_CONFIG``,
  ``MOTOR_ENGINE_LOG_DIR`` and etcd's ``--data-dir`` point there instead of the mount paths.
* **The config**: the ConfigMap's own, with simulated engines (``kind: sim``, ``platform:
  cpu``) instead of vLLM on NPUs, and ``api_keys_file`` at the Secret's stand-in; every other
  field (etcd endpoints by Service name, ``0.0.0.0`` listeners, ports, mode, policy, workers)
  is the manifest's.
* **DNS**: each pod sees an ``/etc/hosts`` (``ip netns exec`` bind-mounts
  ``/etc/netns/<ns>/hosts`` over it) with what cluster DNS would answer: every etcd member's
  ``motor-etcd-N.motor-etcd``, the headless engine Services, and the ``motor-controller``
  Service's virtual IP.
* **The controller Service** (a ClusterIP one): :class:`ServiceProxy`, a TCP proxy in this
  process on the virtual IP (198.18.1.250, on the bridge), sending each new connection to the
  next controller pod whose ``/readiness`` probe passed (as kube-proxy's userspace mode did);
  a pod taken down leaves its endpoints at once (a deleted pod's endpoint goes).

Then requests go through both coordinators' pod addresses with the official ``openai``
client (streamed and not, chat and completions, ``max_retries=0``: every failure counts), and
under a steady load from 4 client threads the leader controller's pod and then a decode pod
are taken down (every process in the namespace SIGKILLed, its veth and namespace deleted).
Measured, and printed on one line per fault: the requests and client failures after each
fault; the time to a new leader; the time until both coordinators had dropped the dead decode
pod's endpoint from their table ("noticed"), and the failures among requests started before
and after it. Required: 0 failures after the controller pod went, 0 among requests started
after the coordinators noticed the decode pod gone.

Skips when network namespaces cannot be made or etcd is missing, unless
``MOTOR_REQUIRE_NETNS=1`` or ``MOTOR_REQUIRE_DEPLOY_TOOLS=1`` (.ci/deploy.sh) make that a
failure. 25 - 35 s on 2 cores.
"""
from __future__ import annotations

import asyncio
import copy
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy import netns, pod_load
from tests.deploy.manifests import NAMESPACE, ROOT, find, motor_container, pod_env, render

ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"
ETCD = os.environ.get("MOTOR_ETCD_BIN") or shutil.which("etcd") or "/usr/bin/etcd"
#: the controller Service's virtual IP (served by :class:`ServiceProxy` on the bridge)
CONTROLLER_SERVICE_IP = "198.18.1.250"
#: first address of each workload's pods (pod i gets + i)
FIRST_IP = {"motor-etcd": 11, "motor-controller": 21, "motor-coordinator": 31,
            "motor-prefill": 41, "motor-decode": 51}
API_KEY = "motor-pod-test-key-0123456789abcdef"


def _require(why: str) -> None:
    flags = [f for f in ("MOTOR_REQUIRE_NETNS", "MOTOR_REQUIRE_DEPLOY_TOOLS")
             if os.environ.get(f) == "1"]
    if flags:
        pytest.fail(f"{why} ({flags[0]}=1)")
    pytest.skip(why)


def _get(url: str, timeout: float = 2.0) -> Any:
    """A JSON document, None when the server is down or answers another status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, urllib.error.URLError, HTTPException, ValueError):
        return None


def _get_text(url: str, timeout: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _wait(what: str, cond: Any, timeout_s: float, logs: Any = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_s} s" + (f"\n{logs()}" if logs else ""))


# ---------------------------------------------------------------- the controller Service


class ServiceProxy:
    """A ClusterIP Service in userspace: ``listen`` (the virtual IP and port) forwards each
    accepted connection to the next endpoint (round robin) among those whose readiness probe
    (``GET http://IP:PORT<path>``, every ``period_s``) answered 200 last time. An endpoint
    :meth:`remove` d is never picked again (a deleted pod). Runs on its own event loop in a
    daemon thread; :meth:`close` stops it."""

    def __init__(self, listen: tuple[str, int], endpoints: list[str], port: int,
                 path: str = "/readiness", period_s: float = 0.5) -> None:
        self.listen, self.port, self.path, self.period_s = listen, port, path, period_s
        self.endpoints = list(endpoints)
        self.ready: list[str] = []
        self._next = 0
        self._conns: set[asyncio.Task[Any]] = set()
        #: what it did, one line each (``time.monotonic()``-stamped): readiness changes and
        #: every connection's endpoint and end
        self.events: list[str] = []
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="service-proxy", daemon=True)
        self._thread.start()
        self._prober = threading.Thread(target=self._probe, name="service-probe", daemon=True)
        self._prober.start()
        assert self._started.wait(10), "the Service proxy did not start"

    def remove(self, ip: str) -> None:
        self.endpoints = [e for e in self.endpoints if e != ip]
        self.ready = [e for e in self.ready if e != ip]
        self.events.append(f"{time.monotonic():.2f} removed {ip}: ready {self.ready}")

    def _probe(self) -> None:
        while not self._stop.is_set():
            ready = []
            for ip in list(self.endpoints):
                try:
                    with urllib.request.urlopen(f"http://{ip}:{self.port}{self.path}",
                                                timeout=1.0) as r:
                        if r.status == 200:
                            ready.append(ip)
                except (OSError, urllib.error.URLError, HTTPException):
                    pass
            ready = [e for e in ready if e in self.endpoints]
            if ready != self.ready:
                self.events.append(f"{time.monotonic():.2f} ready {ready}")
            self.ready = ready
            self._stop.wait(self.period_s)

    def _pick(self) -> str | None:
        ready = self.ready
        if not ready:
            return None
        self._next += 1
        return ready[self._next % len(ready)]

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        pipes: list[asyncio.Task[None]] = []
        uw = None
        t0, how = time.monotonic(), "?"
        try:
            ip = self._pick()
            if ip is None:     # no ready endpoint: the connection is refused
                how = "no endpoint"
                return
            try:
                ur, uw = await asyncio.wait_for(asyncio.open_connection(ip, self.port), 2.0)
            except (OSError, TimeoutError) as e:
                how = f"{ip}: connect failed ({type(e).__name__})"
                return
            pipes = [asyncio.ensure_future(self._pipe(reader, uw)),
                     asyncio.ensure_future(self._pipe(ur, writer))]
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            how = f"{ip}: closed"
        except asyncio.CancelledError:   # close(): the handler ends, not cancelled
            how = "stopped"
        finally:
            for p in pipes:
                p.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            if uw is not None:
                uw.close()
            writer.close()
            self._conns.discard(task)
            self.events.append(f"{t0:.2f} +{time.monotonic() - t0:.2f} s {how}")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def main() -> None:
            server = await asyncio.start_server(self._serve, *self.listen)
            self._started.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.1)
            server.close()
            conns = list(self._conns)
            for t in conns:
                t.cancel()
            await asyncio.gather(*conns, return_exceptions=True)
            await server.wait_closed()

        try:
            self._loop.run_until_complete(main())
        finally:
            self._loop.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._prober.join(5)


# ---------------------------------------------------------------- the cluster


@dataclass
class PodSpec:
    """A pod of the rendered manifests: its workload, name, address and how it starts."""
    workload: str
    name: str
    ip: str
    argv: list[str]
    env: dict[str, str]


def _pod_names(w: dict[str, Any]) -> list[str]:
    name, n = w["metadata"]["name"], int(w["spec"]["replicas"])
    if w["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(n)]
    # a Deployment's pods: <name>-<ReplicaSet hash>-<suffix>
    return [f"{name}-6d5f8c7b9-{'abcdefgh'[i]}x7k2" for i in range(n)]


def _sim_config(data: dict[str, Any], secrets: Path) -> dict[str, Any]:
    """The ConfigMap's config with simulated engines on CPU and the API keys from the Secret's
    stand-in; nothing else changed."""
    cfg: dict[str, Any] = copy.deepcopy(data)
    for node in cfg["nodes"]:
        node["platform"] = "cpu"
        for e in node["engines"]:
            e["kind"] = "sim"
    cfg["coordinator"]["api_keys_file"] = str(secrets)
    return cfg


def _etcd_argv(c: dict[str, Any], env: dict[str, str], data_dir: Path) -> list[str]:
    """The etcd container's command, ``$(VAR)`` expanded from its env as the kubelet does,
    ``--data-dir`` moved to ``data_dir`` (the volume's stand-in)."""
    command: list[str] = c["command"]
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[str(m.group(1))], a) for a in command]
    assert argv[0] == "etcd", argv
    out = [ETCD]
    for a in argv[1:]:
        out.append(f"--data-dir={data_dir}" if a.startswith("--data-dir=") else a)
    return out


class PodCluster:
    """The rendered pd overlay as pods on a :class:`netns.PodNetwork`."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.objs = render("pd")
        self.net: netns.PodNetwork | None = None
        self.proxy: ServiceProxy | None = None
        self.specs: dict[str, PodSpec] = {}
        self.by_workload: dict[str, list[str]] = {}
        self.config = self._write_config()
        self.t_start = 0.0

    def _write_config(self) -> dict[str, Any]:
        cm = find(self.objs, "ConfigMap", "motor-config")
        data = yaml.safe_load(cm["data"]["motor.yaml"])
        secrets = self.tmp / "secret-motor-api-keys"
        secrets.mkdir()
        (secrets / "pod-test").write_text(API_KEY + "\n")
        cfg = _sim_config(data, secrets)
        (self.tmp / "configmap").mkdir()
        (self.tmp / "configmap" / "motor.yaml").write_text(yaml.safe_dump(cfg))
        return cfg

    def plan(self) -> None:
        """Every pod's name, address, argv and environment from the rendered workloads."""
        base_env = {"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
                    "LANG": "C.UTF-8"}
        for w in (o for o in self.objs if o["kind"] in ("Deployment", "StatefulSet")):
            wname = w["metadata"]["name"]
            names = _pod_names(w)
            self.by_workload[wname] = names
            for i, pod_name in enumerate(names):
                ip = f"198.18.1.{FIRST_IP[wname] + i}"
                home = self.tmp / "pods" / pod_name
                home.mkdir(parents=True)
                c = motor_container(w)
                if c is None:   # etcd
                    c = w["spec"]["template"]["spec"]["containers"][0]
                    env = pod_env(w, c, pod_name=pod_name, pod_ip=ip)
                    argv = _etcd_argv(c, env, home / "data")
                    env = {**base_env, **env, "HOME": str(home)}
                else:
                    env = pod_env(w, c, pod_name=pod_name, pod_ip=ip)
                    assert env["MOTOR_CONFIG"] == "/etc/motor/motor.yaml", wname
                    env["MOTOR_CONFIG"] = str(self.tmp / "configmap" / "motor.yaml")
                    if "MOTOR_ENGINE_LOG_DIR" in env:
                        env["MOTOR_ENGINE_LOG_DIR"] = str(home / "log")
                    env = {**base_env, **env, "HOME": str(home)}
                    argv = ["bash", str(ENTRYPOINT)]
                self.specs[pod_name] = PodSpec(wname, pod_name, ip, argv, env)

    def hosts(self) -> str:
        """What cluster DNS answers, as an /etc/hosts."""
        lines = ["127.0.0.1 localhost", f"{CONTROLLER_SERVICE_IP} motor-controller "
                 f"motor-controller.{NAMESPACE}.svc.cluster.local"]
        for s in self.specs.values():
            if self.kind(s.workload) == "StatefulSet":
                svc = s.workload
                lines.append(f"{s.ip} {s.name}.{svc} {s.name}.{svc}.{NAMESPACE}.svc.cluster.local")
                lines.append(f"{s.ip} {svc} {svc}.{NAMESPACE}.svc.cluster.local")
        return "\n".join(lines) + "\n"

    def kind(self, workload: str) -> str:
        return next(str(o["kind"]) for o in self.objs if o["metadata"]["name"] == workload
                    and o["kind"] in ("Deployment", "StatefulSet"))

    def start(self) -> None:
        self.t_start = time.monotonic()
        self.net = netns.PodNetwork()
        for s in self.specs.values():
            self.net.add_pod(s.name.removeprefix("motor-"), s.ip)
        self.net.write_hosts(self.hosts())
        self.net.add_service_ip(CONTROLLER_SERVICE_IP)
        port = int(self.config["controller"]["port"])
        self.proxy = ServiceProxy((CONTROLLER_SERVICE_IP, port),
                                  [self.specs[n].ip for n in self.by_workload["motor-controller"]],
                                  port)
        for n in self.by_workload["motor-etcd"]:
            self.spawn(n)
        for n in self.by_workload["motor-etcd"]:
            _wait(f"etcd {n} healthy",
                  lambda n=n: (_get(f"http://{self.specs[n].ip}:2379/health") or {})
                  .get("health") == "true", 30, self.logs)
        for w in ("motor-controller", "motor-prefill", "motor-decode", "motor-coordinator"):
            for n in self.by_workload[w]:
                self.spawn(n)

    def pod(self, name: str) -> netns.Pod:
        assert self.net is not None
        return self.net.pods[name.removeprefix("motor-")]

    def spawn(self, name: str) -> None:
        assert self.net is not None
        s, pod = self.specs[name], self.pod(name)
        with open(self.tmp / "pods" / name / "pod.log", "ab") as log:
            p = subprocess.Popen(self.net.argv(pod, s.argv), env=s.env,
                                 cwd=self.tmp / "pods" / name, stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        pod.procs.append(p)

    def take_down(self, name: str) -> None:
        """The pod is deleted: out of the Service's endpoints, every process killed, its
        veth and namespace gone."""
        assert self.net is not None and self.proxy is not None
        self.proxy.remove(self.specs[name].ip)
        self.net.take_down(self.pod(name))

    def logs(self, n: int = 2500) -> str:
        out = []
        if self.proxy is not None:
            out.append("--- the motor-controller Service\n" + "\n".join(self.proxy.events[-60:]))
        for d in sorted((self.tmp / "pods").iterdir()):
            f = d / "pod.log"
            if f.exists():
                out.append(f"--- {d.name}\n" + f.read_bytes()[-n:].decode("utf-8", "replace"))
        return "\n".join(out)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
        if self.net is not None:
            self.net.close()

    # ------------------------------------------------------------------ views
    def url(self, name: str, port: int) -> str:
        return f"http://{self.specs[name].ip}:{port}"

    @property
    def controller_port(self) -> int:
        return int(self.config["controller"]["port"])

    def leader(self) -> str | None:
        """The controller pod that leads, when exactly one of the live ones says so."""
        assert self.net is not None
        leads = [n for n in self.by_workload["motor-controller"] if self.pod(n).up and
                 (_get(self.url(n, self.controller_port) + "/v1/leader", 1.0) or {})
                 .get("is_leader")]
        return leads[0] if len(leads) == 1 else None

    def expected_instances(self, skip: tuple[str, ...] = ()) -> list[str]:
        out = []
        for group, node in (("motor-prefill", "prefill"), ("motor-decode", "decode")):
            tmpl = next(x for x in self.config["nodes"] if x["name"] == node)
            for pod in self.by_workload[group]:
                if pod in skip:
                    continue
                for e in tmpl["engines"]:
                    out += [f"{pod}/{e['name']}/{k}" for k in range(e.get("count", 1))]
        return sorted(out)

    def table_ready(self, leader: str, skip: tuple[str, ...] = ()) -> bool:
        """The leader's table holds every instance (of the live pods) ready, at its pod's
        address, and hears from every live engine pod."""
        t = _get(self.url(leader, self.controller_port) + "/v1/instances")
        if not t:
            return False
        ready = {i["id"]: i for i in t["instances"] if i["state"] == "ready"}
        if sorted(ready) != self.expected_instances(skip):
            return False
        for iid, i in ready.items():
            if i["endpoints"][0]["host"] != self.specs[iid.split("/")[0]].ip:
                return False
        return True

    def coordinator_endpoints(self, name: str) -> dict[str, bool] | None:
        """instance id -> ready, as coordinator pod ``name``'s feed has them (its management
        port's /instances), None when it does not answer."""
        port = int(self.config["coordinator"]["management_port"])
        doc = _get(self.url(name, port) + "/instances", 1.0)
        if doc is None:
            return None
        return {e["instance"]: bool(e["ready"]) for e in doc["endpoints"]}

    def coordinators_route_everything(self) -> bool:
        want = self.expected_instances()
        port = int(self.config["coordinator"]["management_port"])
        for n in self.by_workload["motor-coordinator"]:
            eps = self.coordinator_endpoints(n)
            if eps is None or sorted(k for k, r in eps.items() if r) != want:
                return False
            try:
                with urllib.request.urlopen(self.url(n, port) + "/readiness", timeout=1) as r:
                    if r.status != 200:
                        return False
            except (OSError, urllib.error.URLError, HTTPException):
                return False
        return True


# ---------------------------------------------------------------- clients


@dataclass
class Outcome:
    coordinator: str
    stream: bool
    start: float
    end: float
    error: str | None


class Load:
    """:mod:`tests.deploy.pod_load` in a process of its own (in the root namespace: clients
    outside the cluster), 2 clients per coordinator, until :meth:`stop`."""

    def __init__(self, tmp: Path, urls: dict[str, str], model: str) -> None:
        self.path = tmp / "load.jsonl"
        self.outcomes: list[Outcome] = []
        with open(tmp / "load.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.deploy.pod_load", "--out", str(self.path),
                 "--model", model, "--key", API_KEY, "--per", "2",
                 *(f"{n}={u}" for n, u in urls.items())],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def read(self) -> list[Outcome]:
        if self.path.exists():
            lines = self.path.read_text().splitlines()
            self.outcomes = [Outcome(d["coordinator"], d["stream"], d["start"], d["end"],
                                     d["error"]) for d in map(json.loads, lines) if d]
        return self.outcomes

    def wait_started(self, n: int, timeout_s: float = 30.0) -> None:
        _wait(f"{n} requests of the load", lambda: len(self.read()) >= n or
              self.proc.poll() is not None, timeout_s)
        assert self.proc.poll() is None, (self.path.parent / "load.log").read_text()[-3000:]

    def stop(self) -> None:
        """SIGTERM: the requests in flight finish; killed if they do not in time."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(pod_load.TIMEOUT_S + 5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.read()

    def between(self, t0: float, t1: float = float("inf")) -> list[Outcome]:
        """Requests started in [t0, t1)."""
        return [o for o in self.outcomes if t0 <= o.start < t1]


def _failures(outs: list[Outcome]) -> list[Outcome]:
    return [o for o in outs if o.error is not None]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for ln in text.splitlines():
        if not ln.startswith(name + "{") and not ln.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in ln for k, v in labels.items()):
            total += float(ln.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------- the test


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[PodCluster]:
    why = netns.unavailable()
    if why:
        _require(why)
    if not (os.path.exists(ETCD) and os.access(ETCD, os.X_OK)):
        _require(f"etcd is not installed ({ETCD}); Debian: apt-get install etcd-server")
    if shutil.which("kubectl") is None:
        _require("kubectl is not on PATH (Debian: apt-get install kubernetes-client)")
    stale = netns.cleanup_stale()
    if stale:
        print(f"removed what an earlier run left: {', '.join(stale)}")
    c = PodCluster(tmp_path)
    try:
        c.plan()
        c.start()
        yield c
    finally:
        c.close()
        gc.collect()   # finalizers of this test's objects run now, not inside a later import
        left = netns.namespaces()
        assert left == [], f"namespaces left after teardown: {left}"


@pytest.mark.deploy
@pytest.mark.timeout(240)
def test_pd_overlay_as_pods_serves_and_survives_pod_loss(cluster: PodCluster) -> None:
    import openai
    c = cluster
    # the topology the manifests give
    assert {w: len(p) for w, p in c.by_workload.items()} == {
        "motor-etcd": 3, "motor-controller": 2, "motor-coordinator": 2,
        "motor-prefill": 2, "motor-decode": 2}
    model = next(e["served_model_name"] for n in c.config["nodes"] for e in n["engines"])
    coords = {n: c.url(n, int(c.config["coordinator"]["port"]))
              for n in c.by_workload["motor-coordinator"]}

    leader = _wait("one controller leads", c.leader, 60, c.logs)
    _wait("the leader's table has every engine pod's instance ready",
          lambda: c.table_ready(leader), 60, c.logs)
    _wait("both coordinators route to every instance", c.coordinators_route_everything, 60,
          c.logs)
    t_up = time.monotonic() - c.t_start

    # requests through both coordinators: streamed and not, chat and completions
    async def smoke(url: str) -> None:
        c1 = pod_load.client(url, API_KEY)
        assert [m.id async for m in c1.models.list()] == [model]
        for stream in (False, True):
            for chat in (False, True):
                await pod_load.one_request(c1, model, stream, chat)
        c2 = pod_load.client(url, "wrong")
        with pytest.raises(openai.AuthenticationError):   # the Secret's key is required
            await c2.models.list()
        await c1.close()
        await c2.close()

    for url in coords.values():
        asyncio.run(smoke(url))

    load = Load(c.tmp, coords, model)
    try:
        load.wait_started(8)
        time.sleep(1.0)
        # fault 1: the leader controller's pod
        t1 = time.monotonic()
        c.take_down(leader)
        new_leader = _wait("another controller leads", c.leader, 30, c.logs)
        t_lead = time.monotonic() - t1
        assert new_leader != leader
        _wait("the new leader's table has every instance ready",
              lambda: c.table_ready(new_leader), 30, c.logs)
        time.sleep(2.0)
        # fault 2: a decode pod
        t2 = time.monotonic()
        victim = c.by_workload["motor-decode"][-1]
        c.take_down(victim)
        gone = [i for i in c.expected_instances() if i.startswith(victim + "/")]

        def noticed() -> bool:
            for n in coords:
                eps = c.coordinator_endpoints(n)
                if eps is None or any(eps.get(i) for i in gone):
                    return False
            return True

        _wait("both coordinators drop the dead decode pod's endpoint", noticed, 30, c.logs)
        t_noticed = time.monotonic()
        _wait("the leader's table has the other instances ready",
              lambda: c.table_ready(new_leader, skip=(victim,)), 30, c.logs)
        time.sleep(3.0)
    finally:
        load.stop()
    t_end = time.monotonic()

    # the controller fault's requests are those over before the decode fault: one still in
    # flight at t2 may have its decode leg on the pod taken down (a PD leg is not moved off
    # an engine that goes silent; it waits for its timeout), so it counts with that fault
    ctl = [o for o in load.between(t1, t2) if o.end < t2]
    before = [o for o in load.between(t1, t_noticed) if o.start >= t2 or o.end >= t2]
    after = load.between(t_noticed)
    metrics = {n: _get_text(c.url(n, int(c.config["coordinator"]["management_port"]))
                            + "/metrics") for n in coords}
    pd_ok = sum(_metric(m, "motor_coordinator_pd_requests_total", outcome="ok")
                for m in metrics.values())
    retries = sum(_metric(m, "motor_coordinator_retries_total") for m in metrics.values())
    print(f"\nnetwork made, pods started, leader elected, both coordinators routing to all "
          f"{len(c.expected_instances())} instances in {t_up:.1f} s; "
          f"{len(load.outcomes)} requests under load, {pd_ok:.0f} PD requests ok, "
          f"{retries:.0f} retries inside the coordinators")
    print(f"leader controller pod {leader} down: new leader {new_leader} after {t_lead:.2f} s; "
          f"{len(ctl)} requests, {len(_failures(ctl))} failed")
    print(f"decode pod {victim} down: coordinators noticed after {t_noticed - t2:.2f} s; "
          f"before: {len(before)} requests, {len(_failures(before))} failed; "
          f"after: {len(after)} requests in {t_end - t_noticed:.1f} s, "
          f"{len(_failures(after))} failed")
    for o in _failures(load.between(t1)):
        print(f"  failed at +{o.start - t1:.2f} s via {o.coordinator} "
              f"({'stream' if o.stream else 'plain'}): {o.error}")
    assert {o.coordinator for o in after if o.error is None} == set(coords)
    assert _failures(ctl) == [], c.logs()
    assert _failures(after) == [], c.logs()
    assert len(after) >= 4
    assert pd_ok > 0
