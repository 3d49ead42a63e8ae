"""`motor up` as a user runs it: prints the endpoint, serves, and Ctrl-C / SIGTERM leaves nothing."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.support.procs import free_ports, pids_matching, program_stderr, read_line_with


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
        line = read_line_with(p, b"motor is up", 60)
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


def test_bad_options_are_refused_before_anything_starts(tmp_path):
    """Each refused with exit status 2, the usage line and one error line naming the option,
    no traceback, and no process started."""
    ctl, gw = free_ports(2)
    base, _ = free_ports(2, consecutive=True)
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"controller: {{port: {ctl}}}\ncoordinator: {{port: {gw}}}\nnodes:\n  - name: n0\n"
                   f"    engines: [{{name: sim, kind: sim, model: motor-sim, count: 2, base_port: {base}}}]\n")
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (["up", "-c", str(cfg), "--log-dir", str(a_file)],
         f"motor up: error: argument --log-dir: expected a directory, got '{a_file}' (a file)"),
        (["up", "-c", str(cfg), "--ready-timeout", "-1"],
         "motor up: error: argument --ready-timeout: expected a number > 0, got -1"),
        (["up", "-c", str(cfg), "--port", "0"],
         "motor up: error: argument --port: expected a port number 1..65535, got 0"),
        (["up", "--mode", "pd", "-c", str(cfg)],
         "motor up: error: argument --mode: expected no --mode with -c/--config (the config "
         "file gives the mode, coordinator.mode), got 'pd'"),
        (["demo", "-c", str(cfg), "--num-requests", "0"],
         "motor demo: error: argument --num-requests: expected an integer >= 1, got 0"),
        (["demo", "-c", str(cfg), "--concurrency", "-3"],
         "motor demo: error: argument --concurrency: expected an integer >= 1, got -3"),
    ]
    for argv, message in cases:
        r = subprocess.run([sys.executable, "-m", "motor"] + argv, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stdout == "" and "Traceback" not in r.stderr, (argv, r.stderr)
        cmd = argv[0]
        assert program_stderr(r.stderr).splitlines() == [
            f"usage: motor {cmd} [OPTIONS] ('motor {cmd} --help' lists them)", message], r.stderr
    assert pids_matching("motor", "--port", str(base)) == []
    for port in (ctl, gw):  # nothing listens on the config's ports
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def _demo_config(tmp_path, engine_extra=""):
    ctl, gw = free_ports(2)
    base, _ = free_ports(2, consecutive=True)
    cfg = tmp_path / "demo.yaml"
    cfg.write_text(f"controller: {{port: {ctl}, heartbeat_interval_s: 0.2}}\n"
                   f"coordinator: {{port: {gw}}}\nnodes:\n  - name: n0\n    engines:\n"
                   f"      - {{name: sim, kind: sim, model: motor-sim, count: 2, base_port: {base},"
                   f" health_interval_s: 0.2, restart: {{backoff_initial_s: 0.1}},"
                   f" engine_config: {{time-scale: 0.05{engine_extra}}}}}\n")
    return cfg


def _demo_dirs(tmp):
    return {d for d in os.listdir(tmp) if d.startswith("motor-demo-")}


def test_demo_prints_no_log_path_it_deletes_and_keeps_the_logs_of_a_failure(tmp_path):
    tmp = tmp_path / "tmp"   # the demo's temporary directories go there
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp))
    r = subprocess.run([sys.executable, "-m", "motor", "demo", "-c", str(_demo_config(tmp_path)),
                        "--num-requests", "8", "--concurrency", "2"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Requests ok / failed:           8 / 0" in r.stdout
    assert "motor-demo-" not in r.stdout + r.stderr  # no path that is gone afterwards
    assert _demo_dirs(tmp) == set()
    # a failed start: the logs are kept, and where is said
    bad = tmp_path / "bad"
    bad.mkdir()
    r = subprocess.run([sys.executable, "-m", "motor", "demo",
                        "-c", str(_demo_config(bad, ", max-model-len: abc"))],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    assert "motor demo: the cluster did not start: engine instance n0/sim/" in r.stderr
    kept = _demo_dirs(tmp)
    assert len(kept) == 1, kept
    path = os.path.join(tmp, kept.pop())
    assert f"motor demo: logs kept in {path}" in r.stderr
    assert os.path.exists(os.path.join(path, "engines", "n0-sim-0.log"))
