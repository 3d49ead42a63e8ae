"""`coordinator.workers = 2`: two worker processes on one port, metrics summed, a killed worker
is restarted while the other keeps serving."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

from tests.support.procs import free_ports, spawn, stop, wait_http

BODY = json.dumps({"model": "motor-sim", "prompt": "hello", "max_tokens": 2}).encode()


def post(port: int) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=BODY,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()
        return r.status


def worker_pid(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/instances", timeout=5) as r:
        return json.loads(r.read())["worker_pid"]


def requests_total(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith("motor_coordinator_requests_total{") and 'route="completions"' in ln)


def test_two_workers_share_the_port_and_survive_kill9(tmp_path):
    sim, gw = free_ports(2)
    procs = [spawn(["sim", "--port", str(sim), "--time-scale", "0"], str(tmp_path / "sim.log")),
             spawn(["coordinator", "--port", str(gw), "--workers", "2", "--backend",
                    f"http://127.0.0.1:{sim}"], str(tmp_path / "coord.log"))]
    try:
        wait_http(f"http://127.0.0.1:{sim}/health")
        wait_http(f"http://127.0.0.1:{gw}/readiness")
        pids = set()
        deadline = time.monotonic() + 20
        while len(pids) < 2 and time.monotonic() < deadline:
            wait_http(f"http://127.0.0.1:{gw}/readiness")
            pids.add(worker_pid(gw))
        assert len(pids) == 2, "both workers answer on the same port"
        for _ in range(40):
            assert post(gw) == 200
        assert requests_total(gw) == 40  # summed over both workers, whichever answers
        victim = pids.pop()
        os.kill(victim, signal.SIGKILL)
        ok = 0
        for _ in range(40):
            try:
                ok += post(gw) == 200
            except OSError:
                pass  # a connection queued on the dead worker's socket may be reset
        assert ok >= 30
        new = set()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (new - pids - {victim}):
            try:
                new.add(worker_pid(gw))
            except OSError:
                pass
        assert new - pids - {victim}, "the killed worker was replaced by a new process"
        assert requests_total(gw) >= 40 + ok  # the dead worker's counts are kept
    finally:
        for p in procs:
            stop(p)
