"""A whole HA control plane as real processes on 127.0.0.1, for the etcd chaos tests.

3 etcd members, 3 ``motor controller`` processes (controller ``i`` talks to etcd member ``i``
only, so stopping a member cuts exactly one controller off etcd while the quorum holds), 2
``motor node-manager`` processes with 2 simulated engines each, one ``motor coordinator``
following every controller (``controller.peers``), and ``motor bench`` as the closed-loop load.
Every process runs in its own process group and is killed at :meth:`HaCluster.close`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from pathlib import Path
from typing import Any

import yaml

from tests.support.etcd import EtcdCluster
from tests.support.procs import free_ports

ENV = dict(os.environ, MOTOR_LOG_LEVEL="info")
N_CONTROLLERS = 3
NODES = ("n1", "n2")
ENGINES_PER_NODE = 2


def get(url: str, timeout: float = 2.0) -> Any:
    """GET a JSON document; None when the server is down or answers another status."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, urllib.error.URLError, HTTPException, ValueError):
        return None


def post(url: str, body: dict[str, Any], timeout: float = 10.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


class HaCluster:
    def __init__(self, tmp: Path, lease_ttl_s: int = 2, policy: str = "round_robin",
                 sim_config: dict[str, Any] | None = None) -> None:
        self.tmp = tmp
        self.policy = policy
        self.sim_config = {"time_scale": 4, **(sim_config or {})}
        self.etcd = EtcdCluster(3, str(tmp))
        ports = free_ports(N_CONTROLLERS + 1 + len(NODES))
        self.cports = ports[:N_CONTROLLERS]
        self.api_port = ports[N_CONTROLLERS]
        self.mports = ports[N_CONTROLLERS + 1:]
        #: each node's engines take base_port + k (the node manager's plan): consecutive ports
        self.base_ports = [free_ports(ENGINES_PER_NODE, consecutive=True)[0] for _ in NODES]
        self.lease_ttl_s = lease_ttl_s
        self.controllers: list[subprocess.Popen[bytes] | None] = [None] * N_CONTROLLERS
        self.others: list[subprocess.Popen[bytes]] = []
        self.configs: list[Path] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.cports]

    @property
    def instance_ids(self) -> list[str]:
        return sorted(f"{n}/sim/{k}" for n in NODES for k in range(ENGINES_PER_NODE))

    def _config(self, i: int) -> Path:
        nodes = []
        for j, name in enumerate(NODES):
            base = self.base_ports[j]
            nodes.append({"name": name, "mgmt_port": self.mports[j], "platform": "cpu",
                          "log_dir": str(self.tmp / f"logs-{name}"),
                          "engines": [{"name": "sim", "kind": "sim", "model": "motor-sim",
                                       "count": ENGINES_PER_NODE, "base_port": base,
                                       "health_interval_s": 0.2,
                                       "engine_config": dict(self.sim_config)}]})
        cfg = {
            "controller": {"host": "127.0.0.1", "port": self.cports[i],
                           "heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3.0,
                           "remove_after_s": 60.0, "watch_timeout_s": 5.0,
                           "peers": self.urls,
                           "etcd": {"endpoints": [self.etcd.endpoints[i]],
                                    "prefix": "/chaos", "lease_ttl_s": self.lease_ttl_s}},
            "coordinator": {"host": "127.0.0.1", "port": self.api_port, "policy": self.policy},
            "nodes": nodes,
        }
        path = self.tmp / f"cluster-{i}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return path

    def _spawn(self, args: list[str], name: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "motor", *args], stdout=log,
                                    stderr=subprocess.STDOUT, env=ENV, start_new_session=True)

    def start(self) -> HaCluster:
        self.etcd.start()
        self.configs = [self._config(i) for i in range(N_CONTROLLERS)]
        for i in range(N_CONTROLLERS):
            self.start_controller(i)
        for name in NODES:
            self.others.append(self._spawn(["node-manager", "-c", str(self.configs[0]),
                                            "--node", name], f"nm-{name}"))
        self.others.append(self._spawn(["coordinator", "-c", str(self.configs[0])],
                                       "coordinator"))
        self.wait_converged(60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            models = get(f"http://127.0.0.1:{self.api_port}/v1/models")
            if models and models.get("data"):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("coordinator not serving")
        return self

    def start_controller(self, i: int) -> None:
        self.controllers[i] = self._spawn(["controller", "-c", str(self.configs[i])],
                                          f"controller-{i}")

    def kill_controller(self, i: int) -> None:
        p = self.controllers[i]
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)

    # ------------------------------------------------------------------ views
    def leaders(self) -> list[int]:
        """Indices of the controllers that say they lead now."""
        out = []
        for i, u in enumerate(self.urls):
            doc = get(u + "/v1/leader", 1.0)
            if doc and doc.get("is_leader"):
                out.append(i)
        return out

    def table(self, i: int) -> dict[str, Any] | None:
        doc = get(self.urls[i] + "/v1/instances", 2.0)
        return doc if isinstance(doc, dict) and "instances" in doc else None

    def converged(self) -> int | None:
        """The leader's index when exactly one leads and its table holds every instance,
        each once and ready, and it heard from both nodes."""
        leaders = self.leaders()
        if len(leaders) != 1:
            return None
        t = self.table(leaders[0])
        if t is None:
            return None
        ids = [i["id"] for i in t["instances"]]
        if sorted(ids) != self.instance_ids:
            return None
        if any(i["state"] != "ready" for i in t["instances"]):
            return None
        nodes = get(self.urls[leaders[0]] + "/v1/nodes")
        if not nodes or sorted(n["node"] for n in nodes["nodes"]) != list(NODES):
            return None
        if any(n["last_heartbeat_age_s"] > 1.5 for n in nodes["nodes"]):
            return None
        return leaders[0]

    def wait_converged(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lead = self.converged()
            if lead is not None:
                return lead
            time.sleep(0.1)
        raise AssertionError(f"cluster did not converge in {timeout_s} s: leaders "
                             f"{self.leaders()}, tables "
                             f"{[self.table(i) for i in range(N_CONTROLLERS)]}\n"
                             + self.logs_tail())

    def logs_tail(self, n: int = 2000) -> str:
        out = []
        for f in sorted(self.tmp.glob("*.log")):
            if f.name.startswith("etcd-"):
                continue
            out.append(f"--- {f.name}\n" + f.read_bytes()[-n:].decode("utf-8", "replace"))
        return "\n".join(out)

    # ------------------------------------------------------------------- load
    def engine_port(self, instance_id: str) -> int:
        """The HTTP port of instance ``n<j>/sim/<k>``'s engine."""
        node, _, k = instance_id.split("/")
        return self.base_ports[NODES.index(node)] + int(k)

    def received(self, instance_id: str) -> int | None:
        """Requests the engine of ``instance_id`` took so far (None when it does not answer):
        the simulator's own accounting (running + waiting + finished + aborted)."""
        st = get(f"http://127.0.0.1:{self.engine_port(instance_id)}/admin/stats", 1.0)
        if st is None:
            return None
        return int(st["running"] + st["waiting"] + st["finished"] + st["aborted"])

    def wait_load(self, load: subprocess.Popen[bytes] | None = None,
                  timeout_s: float = 90.0) -> None:
        """Until the engines took at least 20 more requests than now.

        ``motor bench`` may need many seconds to start on a loaded 2-core machine (a fault
        injected before its first request would be injected without load), so the wait is
        for the load itself, up to ``timeout_s``; it ends at once, with the logs, when
        ``load`` (the bench's process) exited first."""
        start = sum(self.received(i) or 0 for i in self.instance_ids)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(self.received(i) or 0 for i in self.instance_ids) >= start + 20:
                return
            if load is not None and load.poll() is not None:
                raise AssertionError(f"the load generator exited ({load.returncode}) before "
                                     "load reached the engines\n" + self.logs_tail())
            time.sleep(0.1)
        seen = {i: self.received(i) for i in self.instance_ids}
        raise AssertionError(f"no load reached the engines in {timeout_s:.0f} s (engines "
                             f"took {seen}, {start} at the start; load generator "
                             f"{'running' if load is not None and load.poll() is None else 'gone'})"
                             "\n" + self.logs_tail())

    def ctl(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[bytes]:
        """``motor ctl ARGS --controller <every controller>`` (its output captured)."""
        return subprocess.run([sys.executable, "-m", "motor", "ctl", *args, "--controller",
                               ",".join(self.urls)], capture_output=True, env=ENV,
                              timeout=timeout_s, start_new_session=True)

    def bench(self, duration_s: float, name: str, concurrency: int = 16,
              extra: list[str] | None = None) -> subprocess.Popen[bytes]:
        """``motor bench`` in a closed loop of ``concurrency`` streams for ``duration_s``."""
        out = self.tmp / f"{name}.json"
        return self._spawn(["bench", "--url", f"http://127.0.0.1:{self.api_port}",
                            "--model", "motor-sim", "--concurrency", str(concurrency),
                            "--duration", str(duration_s), "--num-requests", "1000000",
                            "--input-len", "64", "--output-len", "24", "--timeout", "60",
                            *(extra or []), "--json", str(out)], name)

    def bench_result(self, p: subprocess.Popen[bytes], name: str, timeout_s: float = 120
                     ) -> dict[str, Any]:
        p.wait(timeout_s)
        doc = json.loads((self.tmp / f"{name}.json").read_text())
        summary = doc["summary"]
        summary["exit_status"] = p.returncode
        summary["errors"] = sorted({r.get("error") for r in doc.get("requests", [])
                                    if r.get("error")})[:5]
        return summary

    def close(self) -> None:
        for p in [*self.others, *self.controllers]:
            if p is not None and p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        self.etcd.close()


@contextmanager
def running(tmp: Path, **kw: Any) -> Iterator[HaCluster]:
    """A started :class:`HaCluster` (``kw`` as its constructor's), its logs printed if
    anything fails, every process stopped at the end (a module fixture's body)."""
    c = HaCluster(tmp, **kw)
    try:
        c.start()
        yield c
    except BaseException:
        print(c.logs_tail())
        raise
    finally:
        c.close()
