"""``python -m motor controller`` start-up errors: a busy or invalid port."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.procs import program_stderr

ROOT = Path(__file__).resolve().parents[3]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "motor", "controller", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_busy_port_is_one_line(tmp_path: Path) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        r = _run("--host", "127.0.0.1", "--port", str(port))
        assert r.returncode == 1
        assert program_stderr(r.stderr) == (f"motor controller: cannot listen on 127.0.0.1:{port} "
                                            "(--port): address already in use")
        cfg = tmp_path / "c.yaml"
        cfg.write_text(f"controller: {{host: 127.0.0.1, port: {port}}}\n")
        r = _run("-c", str(cfg))
        assert r.returncode == 1
        assert program_stderr(r.stderr) == (f"motor controller: cannot listen on 127.0.0.1:{port} "
                                            "(controller.port): address already in use")
    finally:
        s.close()


@pytest.mark.parametrize("bad", ["-1", "65536"])
def test_port_out_of_range(bad: str) -> None:
    r = _run("--port", bad)
    assert r.returncode == 2
    assert "argument --port: expected a port number 0..65535" in r.stderr
    assert "Traceback" not in r.stderr
