"""`motor up` as a user runs it: prints the endpoint, serves, and Ctrl-C / SIGTERM leaves nothing."""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support.procs import free_ports, pids_matching


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_up_serves_then_stops_everything(tmp_path, sig):
    ctl, gw = free_ports(2)
    base, _ = free_ports(2, consecutive=True)
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"""
controller: {{port: {ctl}, heartbeat_interval_s: 0.2}}
coordinator: {{port: {gw}}}
nodes:
  - name: n0
    engines:
      - {{name: sim, kind: sim, model: motor-sim, count: 2, base_port: {base},
         health_interval_s: 0.2, engine_config: {{time-scale: 0.05}}}}
""")
    p = subprocess.Popen([sys.executable, "-m", "motor", "up", "-c", str(cfg),
                          "--log-dir", str(tmp_path / "logs")],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        line = b""
        deadline = time.monotonic() + 60
        while b"motor is up" not in line and time.monotonic() < deadline:
            r, _, _ = select.select([p.stdout], [], [], 1.0)
            if r:
                line = p.stdout.readline()
                if not line:
                    break
        assert b"motor is up" in line and f":{gw}/v1".encode() in line, line
        req = urllib.request.Request(f"http://127.0.0.1:{gw}/v1/completions",
                                     data=json.dumps({"model": "motor-sim", "prompt": "hi",
                                                      "max_tokens": 3}).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert len(json.loads(r.read())["choices"][0]["text"]) == 3
        os.kill(p.pid, sig)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    time.sleep(0.3)
    assert pids_matching("motor", "--port", str(base)) == []
    assert pids_matching("motor", "--port", str(base + 1)) == []
    # controller and coordinator are gone too: their ports can be bound again
    for port in (ctl, gw):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_up_refuses_ports_in_use_and_empty_configs(tmp_path):
    ctl, gw = free_ports(2)
    base, _ = free_ports(2, consecutive=True)
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"controller: {{port: {ctl}}}\ncoordinator: {{port: {gw}}}\nnodes:\n  - name: n0\n"
                   f"    engines: [{{name: sim, kind: sim, model: motor-sim, count: 2, base_port: {base}}}]\n")
    with socket.socket() as squat:  # someone else's server on the second engine's port
        squat.bind(("127.0.0.1", base + 1))
        squat.listen()
        r = subprocess.run([sys.executable, "-m", "motor", "up", "-c", str(cfg)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"nodes[0].engines[0].base_port+1 = {base + 1}" in r.stderr
    assert pids_matching("motor", "--port", str(base)) == []
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    r = subprocess.run([sys.executable, "-m", "motor", "up", "-c", str(empty)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "at least one engine" in r.stderr
