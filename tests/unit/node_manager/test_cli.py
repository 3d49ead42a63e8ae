"""``python -m motor node-manager`` start-up errors: a busy or invalid management port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from tests.support.procs import program_stderr

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp))
    env.pop("MOTOR_ENGINE_LOG_DIR", None)
    return subprocess.run([sys.executable, "-m", "motor", "node-manager", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def test_busy_management_port_is_one_line(tmp_path: Path) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        cfg = tmp_path / "c.yaml"
        cfg.write_text("controller: {host: 127.0.0.1, port: 1}\n"
                       f"nodes: [{{name: node0, host: 127.0.0.1, mgmt_port: {port}, engines: []}}]\n")
        r = _run(tmp_path, "-c", str(cfg))
        assert r.returncode == 1
        assert program_stderr(r.stderr) == (f"motor node-manager: cannot listen on 127.0.0.1:{port} "
                                            "(nodes[0].mgmt_port): address already in use")
        r = _run(tmp_path, "-c", str(cfg), "--port", str(port))
        assert r.returncode == 1
        assert program_stderr(r.stderr) == (f"motor node-manager: cannot listen on 127.0.0.1:{port} "
                                            "(--port): address already in use")
        # nothing was started: no temp engine log dir left behind
        assert not [p for p in os.listdir(tmp_path) if p.startswith("motor-")]
    finally:
        s.close()


def test_port_out_of_range(tmp_path: Path) -> None:
    r = _run(tmp_path, "--port", "-1")
    assert r.returncode == 2
    assert "argument --port: expected a port number 0..65535" in r.stderr
