"""Controller + node manager as real processes on 127.0.0.1 with two fake engines.

starting -> ready; kill -9 of an engine -> unhealthy -> restarted -> ready; SIGTERM of the
node manager -> instances deregistered, engines gone; both exit 0 and print nothing on stdout.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.unit.node_manager.helpers import FAKE_LAUNCHER, free_ports, pid_alive, wait_until  # noqa: E402

ENV = dict(os.environ, MOTOR_LOG_LEVEL="info")


def get(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def spawn(args: list[str], tmp: Path, name: str) -> subprocess.Popen[bytes]:
    with open(tmp / f"{name}.stderr", "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "motor", *args], stdout=subprocess.PIPE,
                                stderr=err, env=ENV, start_new_session=True)


def kill_group(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


class Watcher:
    """Long-polls the controller and records every state each instance was seen in."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.version: int | None = None
        self.seen: dict[str, list[str]] = {}
        self.table: dict[str, dict[str, Any]] = {}

    def poll(self, timeout: float = 2.0) -> None:
        q = f"?after={self.version}&timeout={timeout}" if self.version is not None else ""
        t = get(self.url + "/v1/instances" + q, timeout + 10)
        self.version = t["version"]
        self.table = {i["id"]: i for i in t["instances"]}
        for iid, inst in self.table.items():
            states = self.seen.setdefault(iid, [])
            if not states or states[-1] != inst["state"]:
                states.append(inst["state"])

    def until(self, pred: Any, what: str, timeout_s: float = 30.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.poll()
            if pred(self.table):
                return
        raise AssertionError(f"timed out waiting for {what}; seen {self.seen}, table {self.table}")


def write_config(tmp_path: Path, cport: int, base: int) -> Path:
    cfg = {
        "controller": {"host": "127.0.0.1", "port": cport, "heartbeat_interval_s": 0.1,
                       "heartbeat_timeout_s": 1.0, "remove_after_s": 3.0, "watch_timeout_s": 5},
        "nodes": [{"name": "n1", "log_dir": str(tmp_path / "logs"), "engines": [{
            "name": "fake", "kind": "sim", "model": "m", "count": 2, "base_port": base,
            "launcher": FAKE_LAUNCHER, "health_interval_s": 0.05, "stop_timeout_s": 2,
            "engine_config": {"healthy_after": 0.5},
            "restart": {"backoff_initial_s": 0.1, "backoff_max_s": 0.5}}]}],
    }
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(cfg))
    return cfile


def test_control_plane(tmp_path: Path) -> None:
    cport, mport, base = free_ports(), free_ports(), free_ports(2)
    cfile = write_config(tmp_path, cport, base)
    curl = f"http://127.0.0.1:{cport}"
    ids = ["n1/fake/0", "n1/fake/1"]
    ctrl = spawn(["controller", "-c", str(cfile)], tmp_path, "controller")
    nm: subprocess.Popen[bytes] | None = None
    engine_pids: list[int] = []
    try:
        wait_until(lambda: _ok(curl + "/health"), 20, "controller up")
        w = Watcher(curl)
        w.poll(0)
        assert w.table == {}
        nm = spawn(["node-manager", "-c", str(cfile), "--node", "n1", "--port", str(mport)],
                   tmp_path, "node-manager")
        w.until(lambda t: sorted(t) == ids and all(i["state"] == "ready" for i in t.values()),
                "both ready")
        for iid in ids:
            assert w.seen[iid][:2] == ["starting", "ready"], w.seen
        assert [e["port"] for e in w.table["n1/fake/1"]["endpoints"]] == [base + 1]

        # kill -9 one engine: unhealthy, restarted, ready again
        status = get(f"http://127.0.0.1:{mport}/v1/instances")
        procs = {i["id"]: i["processes"][0] for i in status["instances"]}
        engine_pids = [p["pid"] for p in procs.values()]
        victim = procs["n1/fake/0"]["pid"]
        os.kill(victim, signal.SIGKILL)
        w.until(lambda t: t["n1/fake/0"]["state"] == "unhealthy", "unhealthy after kill -9")
        w.until(lambda t: t["n1/fake/0"]["state"] == "ready", "ready after restart")
        assert w.seen["n1/fake/0"][-3:] == ["ready", "unhealthy", "ready"]
        assert w.seen["n1/fake/1"] == ["starting", "ready"]  # the other one never flapped
        status = get(f"http://127.0.0.1:{mport}/v1/instances")
        p0 = status["instances"][0]["processes"][0]
        assert p0["restarts"] == 1 and p0["pid"] != victim and p0["last_exit"] == -9
        engine_pids.append(p0["pid"])
        log = (tmp_path / "logs" / "n1-fake-0.log").read_text()
        assert log.count("==== motor: starting n1-fake-0") == 2

        # stop the node manager: engines stopped, node deregistered, exit 0
        nm.send_signal(signal.SIGTERM)
        out, _ = nm.communicate(timeout=30)
        assert nm.returncode == 0 and out == b""
        w.until(lambda t: t == {}, "instances removed")
        for pid in engine_pids:
            assert not pid_alive(pid), pid
        nm_log = (tmp_path / "node-manager.stderr").read_text()
        assert "deregistered" in nm_log and "Traceback" not in nm_log

        ctrl.send_signal(signal.SIGTERM)
        out, _ = ctrl.communicate(timeout=30)
        assert ctrl.returncode == 0 and out == b""
        ctrl_log = (tmp_path / "controller.stderr").read_text()
        assert "n1/fake/0: ready -> unhealthy" in ctrl_log and "Traceback" not in ctrl_log
    finally:
        for p in (nm, ctrl):
            if p is not None:
                kill_group(p)
                if p.stdout is not None:
                    p.stdout.close()
        for pid in engine_pids:
            if pid_alive(pid):
                os.killpg(pid, signal.SIGKILL)


def _ok(url: str) -> bool:
    try:
        get(url, 2)
        return True
    except (OSError, ValueError, http.client.HTTPException):
        # HTTPException: polling a loopback port nobody listens on yet can connect the
        # client to itself (TCP self-connect in the ephemeral range) and read back its own
        # request as the "status line"
        return False


def test_node_manager_killed_engines_die_and_instances_time_out(tmp_path: Path) -> None:
    """kill -9 of the node manager: its engines die with it (PDEATHSIG), the controller marks
    the instances unhealthy after heartbeat_timeout_s and removes them after remove_after_s."""
    cport, mport, base = free_ports(), free_ports(), free_ports(2)
    cfile = write_config(tmp_path, cport, base)
    curl = f"http://127.0.0.1:{cport}"
    ctrl = spawn(["controller", "-c", str(cfile)], tmp_path, "controller")
    nm: subprocess.Popen[bytes] | None = None
    engine_pids: list[int] = []
    try:
        wait_until(lambda: _ok(curl + "/health"), 20, "controller up")
        nm = spawn(["node-manager", "-c", str(cfile), "--node", "n1", "--port", str(mport)],
                   tmp_path, "node-manager")
        w = Watcher(curl)
        w.until(lambda t: len(t) == 2 and all(i["state"] == "ready" for i in t.values()),
                "both ready")
        status = get(f"http://127.0.0.1:{mport}/v1/instances")
        engine_pids = [i["processes"][0]["pid"] for i in status["instances"]]
        nm.kill()
        nm.wait(10)
        wait_until(lambda: not any(pid_alive(p) for p in engine_pids), 20, "engines gone")
        w.until(lambda t: t and all(i["state"] == "unhealthy" for i in t.values()),
                "unhealthy after heartbeat timeout")
        w.until(lambda t: t == {}, "removed after remove_after_s")
    finally:
        for p in (nm, ctrl):
            if p is not None:
                kill_group(p)
                if p.stdout is not None:
                    p.stdout.close()
        for pid in engine_pids:
            if pid_alive(pid):
                os.killpg(pid, signal.SIGKILL)


def post(url: str, obj: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(obj).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_coordinator_follows_adapters_loaded_on_controller_engines(tmp_path: Path) -> None:
    """Controller mode (issue 18): a LoRA adapter loaded at run time on an engine that a node
    manager runs (``POST /v1/load_lora_adapter``, vLLM's API, on a real ``motor sim``) is
    listed and routed by the coordinator that follows the controller, only to that engine;
    unloaded, it is a 404 again. The coordinator reads its endpoints' ``/v1/models`` itself,
    as in standalone mode."""
    cport, mport, gport, base = free_ports(), free_ports(), free_ports(), free_ports(2)
    cfg = {
        "controller": {"host": "127.0.0.1", "port": cport, "heartbeat_interval_s": 0.1,
                       "heartbeat_timeout_s": 5.0, "remove_after_s": 30.0, "watch_timeout_s": 5},
        "coordinator": {"host": "127.0.0.1", "port": gport, "policy": "round_robin",
                        "health_check_interval_s": 0.1},
        "nodes": [{"name": "n1", "log_dir": str(tmp_path / "logs"), "engines": [{
            "name": "sim", "kind": "sim", "model": "m", "count": 2, "base_port": base,
            "health_interval_s": 0.05, "stop_timeout_s": 2,
            "engine_config": {"time-scale": 0}}]}],
    }
    cfile = tmp_path / "cluster.yaml"
    cfile.write_text(yaml.safe_dump(cfg))
    curl, gurl = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{gport}"
    sims = [f"http://127.0.0.1:{base + i}" for i in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    chat = {"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def models() -> list[str]:
        return [m["id"] for m in get(gurl + "/v1/models")["data"]]

    def finished() -> list[int]:
        return [int(get(s + "/admin/stats")["finished"]) for s in sims]

    try:
        procs.append(spawn(["controller", "-c", str(cfile)], tmp_path, "controller"))
        wait_until(lambda: _ok(curl + "/health"), 20, "controller up")
        procs.append(spawn(["node-manager", "-c", str(cfile), "--node", "n1", "--port",
                            str(mport)], tmp_path, "node-manager"))
        Watcher(curl).until(lambda t: len(t) == 2 and all(i["state"] == "ready"
                                                          for i in t.values()), "both ready")
        procs.append(spawn(["coordinator", "-c", str(cfile)], tmp_path, "coordinator"))
        wait_until(lambda: _ok(gurl + "/readiness"), 30, "coordinator ready")
        assert models() == ["m"]
        assert post(gurl + "/v1/chat/completions", chat)[0] == 404

        st, out = post(sims[0] + "/v1/load_lora_adapter",
                       {"lora_name": "sql-lora", "lora_path": "/adapters/sql"})
        assert st == 200 and b"added successfully" in out
        wait_until(lambda: "sql-lora" in models(), 20, "the adapter listed")
        before = finished()
        for _ in range(4):
            st, out = post(gurl + "/v1/chat/completions", chat)
            assert st == 200 and json.loads(out)["model"] == "sql-lora"
        after = finished()
        assert (after[0] - before[0], after[1] - before[1]) == (4, 0)   # only where it is

        assert post(sims[0] + "/v1/unload_lora_adapter", {"lora_name": "sql-lora"})[0] == 200
        wait_until(lambda: "sql-lora" not in models(), 20, "the adapter gone")
        assert post(gurl + "/v1/chat/completions", chat)[0] == 404
    finally:
        for p in reversed(procs):      # coordinator, node manager (stops its engines), controller
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    pass
            kill_group(p)
            if p.stdout is not None:
                p.stdout.close()
