"""An instance spanning nodes, end to end, each node in its own network namespace (issue 16
acceptance): 3 node managers in namespaces motmn-n1..3 (198.18.2.11-13 on a bridge in the
root namespace, 198.18.2.1), the controller and a coordinator in the root namespace; one
simulated vLLM instance spanning n1 (DP master, ranks 0-1) and n2 (headless, ranks 2-3),
DP 4 = 2 x 2, and a second instance on n3.

* the spanning instance is assembled and ready only with both parts, and requests reach
  every DP rank (the master's per-rank counts: ranks 2-3 count what the headless node
  acknowledged);
* SIGKILL of the headless rank's process: the instance leaves ``ready``, the whole instance
  (the master on n1 too) restarts, and no request reaches it meanwhile (the old master's
  final counts and the new master's ``refused`` count, at the simulators; the requests of
  that time all succeed on the n3 instance);
* it serves again afterwards, on every rank.

Needs root and ``ip netns`` (skipped without, unless MOTOR_REQUIRE_NETNS=1: .ci/netns.sh).
"""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import netns
from tests.support.procs import stop_all as procs_stop_all

pytestmark = pytest.mark.netns

SPAN = "n1/big/0"
SOLO = "n3/solo/0"
API_PORT = 18100
MGMT_PORT = 19100
MASTER_PORT = 29550


def get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def status(url: str, timeout: float = 1.0) -> int:
    """HTTP status of GET ``url``; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, http.client.HTTPException):
        return 0


def until(pred: Any, what: str, timeout_s: float = 40.0, every_s: float = 0.05) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if pred():
                return
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            pass
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def complete(gw: int) -> int:
    c = http.client.HTTPConnection("127.0.0.1", gw, timeout=10)
    try:
        c.request("POST", "/v1/completions", json.dumps(
            {"model": "big", "prompt": "hello", "max_tokens": 2}),
            {"content-type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status
    finally:
        c.close()


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_config(tmp: Path, cport: int, gw: int, ips: list[str]) -> Path:
    def sim(name: str, host: str, **kw: Any) -> dict[str, Any]:
        return {"name": name, "kind": "sim", "model": "big", "host": host,
                "base_port": API_PORT, "health_interval_s": 0.1, "stop_timeout_s": 5,
                "engine_config": {"time_scale": 0.05},
                "restart": {"backoff_initial_s": 0.3, "backoff_max_s": 1.0}, **kw}
    span = {"nodes": ["n1", "n2"], "dp_size_local": 2, "master_port": MASTER_PORT}
    nodes = [{"name": f"n{i + 1}", "host": ip, "platform": "cpu", "mgmt_port": MGMT_PORT,
              "log_dir": str(tmp / f"logs-n{i + 1}"), "engines": []}
             for i, ip in enumerate(ips)]
    for i in (0, 1):
        nodes[i]["engines"] = [sim("big", ips[i], dp_size=4, span=span)]
    nodes[2]["engines"] = [sim("solo", ips[2])]
    cfg = {"controller": {"host": netns.BRIDGE_IP, "port": cport, "heartbeat_interval_s": 0.1,
                          "heartbeat_timeout_s": 1.0, "remove_after_s": 30.0,
                          "watch_timeout_s": 5},
           "coordinator": {"host": "127.0.0.1", "port": gw, "policy": "round_robin"},
           "nodes": nodes}
    path = tmp / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=dict(os.environ, MOTOR_LOG_LEVEL="info"))


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Node managers first in the list (they stop their engines), then the rest."""
    procs_stop_all(procs, 20.0)


STOPPED = re.compile(rb"motor sim: stopped; requests by DP rank: ((?:\d+=\d+ ?)+); refused "
                     rb"while a rank was missing: (\d+)")


def final_counts(log: Path) -> list[tuple[dict[int, int], int]]:
    """Each stopped master's (requests by DP rank, refused) from its engine log."""
    out = []
    for m in STOPPED.finditer(log.read_bytes()):
        by_rank = dict(tuple(int(x) for x in kv.split(b"=")) for kv in m.group(1).split())
        out.append((by_rank, int(m.group(2))))
    return out


def test_instance_spanning_two_nodes_restarts_as_a_whole(tmp_path: Path) -> None:
    why = netns.unavailable()
    if why is not None:
        if os.environ.get("MOTOR_REQUIRE_NETNS") == "1":
            pytest.fail(f"MOTOR_REQUIRE_NETNS=1 but {why}")
        pytest.skip(why)
    procs: list[subprocess.Popen[bytes]] = []
    managers: list[subprocess.Popen[bytes]] = []
    try:
        ips = netns.setup(3)
        cport, gw = free_port(netns.BRIDGE_IP), free_port("127.0.0.1")
        cfg = write_config(tmp_path, cport, gw, ips)
        ctrl = f"http://{netns.BRIDGE_IP}:{cport}"
        master = f"http://{ips[0]}:{API_PORT}"
        py = [sys.executable, "-m", "motor"]
        procs.append(spawn(py + ["controller", "-c", str(cfg)], tmp_path / "controller.log"))
        until(lambda: status(ctrl + "/health") == 200, "the controller up")
        procs.append(spawn(py + ["coordinator", "-c", str(cfg)], tmp_path / "coordinator.log"))
        for i in (1, 2, 3):
            managers.append(spawn(netns.in_namespace(i, py + [
                "node-manager", "-c", str(cfg), "--node", f"n{i}"]), tmp_path / f"nm{i}.log"))

        def table() -> dict[str, dict[str, Any]]:
            return {i["id"]: i for i in get(ctrl + "/v1/instances")["instances"]}

        def routable() -> set[str]:
            eps = get(f"http://127.0.0.1:{gw}/instances")["endpoints"]
            return {e["instance"] for e in eps if e["routable"]}

        until(lambda: {k: v["state"] for k, v in table().items()} ==
              {SPAN: "ready", SOLO: "ready"}, "both instances ready", 60)
        inst = table()[SPAN]
        assert inst["node"] == "n1" and inst["dp_size"] == 4
        assert [(e["host"], e["port"]) for e in inst["endpoints"]] == [(ips[0], API_PORT)]
        until(lambda: routable() == {SPAN, SOLO}, "the coordinator routes to both")

        # requests reach every DP rank of the spanning instance (and the n3 instance)
        assert [complete(gw) for _ in range(24)] == [200] * 24
        st = get(master + "/admin/stats")
        by_rank = {int(r): n for r, n in st["dp"]["requests_by_rank"].items()}
        assert sorted(by_rank) == [0, 1, 2, 3] and min(by_rank.values()) >= 1, by_rank
        assert st["dp"]["refused"] == 0
        served_before, old_pid = sum(by_rank.values()), st["pid"]
        solo = f"http://{ips[2]}:{API_PORT}"
        solo_before = get(solo + "/admin/stats")["finished"]

        # SIGKILL of the headless rank's process on n2
        parts = get(f"http://{ips[1]}:{MGMT_PORT}/v1/instances")["parts"]
        (part,) = parts
        assert part["id"] == SPAN and part["master"] is False and part["dp_ranks"] == [2, 3]
        os.kill(part["processes"][0]["pid"], signal.SIGKILL)
        until(lambda: table()[SPAN]["state"] != "ready", "the instance out of ready", 10, 0.01)
        until(lambda: SPAN not in routable(), "the coordinator stops routing to it", 5, 0.01)
        # while its master does not serve, every request goes to the n3 instance
        sent = 0
        end = time.monotonic() + 40
        while status(master + "/health", 0.5) != 200:
            assert time.monotonic() < end, "the spanning instance did not come back"
            assert complete(gw) == 200
            sent += 1
        assert sent >= 1
        until(lambda: table()[SPAN]["state"] == "ready", "the instance ready again", 30)
        until(lambda: routable() == {SPAN, SOLO}, "the coordinator routes to it again")

        # restarted as a whole: a new master process; none of those requests reached it
        st = get(master + "/admin/stats")
        assert st["pid"] != old_pid
        assert st["dp"]["refused"] == 0 and sum(st["dp"]["requests_by_rank"].values()) == 0
        assert get(solo + "/admin/stats")["finished"] >= solo_before + sent
        (old_by_rank, old_refused), *_ = final_counts(tmp_path / "logs-n1" / "n1-big-0.log")
        assert sum(old_by_rank.values()) == served_before and old_refused == 0
        parts = get(f"http://{ips[1]}:{MGMT_PORT}/v1/instances")["parts"]
        assert parts[0]["starts"] == 2 and parts[0]["epoch"] == 2

        # and it serves again, on every rank
        assert [complete(gw) for _ in range(24)] == [200] * 24
        by_rank = {int(r): n for r, n in get(master + "/admin/stats")["dp"][
            "requests_by_rank"].items()}
        assert min(by_rank.values()) >= 1, by_rank
        ctl_log = (tmp_path / "controller.log").read_text()
        assert "restarting the whole instance (epoch 2)" in ctl_log, ctl_log[-3000:]

        # the lifecycle through motor ctl: the controller orders every part itself
        def ctl(*args: str) -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(py + ["ctl", *args, "--controller", ctrl],
                                  capture_output=True, timeout=90)

        r = ctl("drain", SPAN, "--grace", "0.5")
        assert r.returncode == 0, r.stderr.decode()
        assert table()[SPAN]["state"] == "stopped"
        until(lambda: SPAN not in routable(), "the coordinator drops the stopped instance")
        until(lambda: status(master + "/health", 0.5) != 200, "the master stopped", 20)
        assert [complete(gw) for _ in range(6)] == [200] * 6      # the n3 instance serves
        r = ctl("start", SPAN)
        assert r.returncode == 0, r.stderr.decode()
        until(lambda: table()[SPAN]["state"] == "ready", "ready after start", 40)
        parts = get(f"http://{ips[1]}:{MGMT_PORT}/v1/instances")["parts"]
        assert parts[0]["epoch"] == 3
        r = ctl("restart", SPAN, "--no-drain")
        assert r.returncode == 0, r.stderr.decode()
        until(lambda: table()[SPAN]["state"] == "ready", "ready after restart", 40)
        assert get(f"http://{ips[1]}:{MGMT_PORT}/v1/instances")["parts"][0]["epoch"] == 4
        until(lambda: routable() == {SPAN, SOLO}, "routed to again after the restart")
        assert [complete(gw) for _ in range(8)] == [200] * 8
    finally:
        stop_all(managers)
        stop_all(procs)
        netns.cleanup()
    for i, p in enumerate(managers, 1):
        assert p.returncode == 0, (tmp_path / f"nm{i}.log").read_text()[-3000:]
