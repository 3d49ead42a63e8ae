"""``python -m motor sim`` as a process: start-up, SIGTERM, crash faults."""
from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time

import pytest

from .helpers import post_json, request
from tests.support.procs import program_stderr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _start(model_dir: str, *extra: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "motor", "sim", "--port", "0", "--model-dir", model_dir,
         "--time-scale", "0.05", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    line = b""
    while time.monotonic() < deadline and b"\n" not in line:
        r, _, _ = select.select([proc.stdout], [], [], 0.2)
        if r:
            b = os.read(proc.stdout.fileno(), 4096)
            if not b:
                break
            line += b
    m = re.search(rb"listening on http://127\.0\.0\.1:(\d+)", line)
    if m is None:
        _kill(proc)
        raise AssertionError(f"sim did not start: {line!r}")
    return proc, int(m.group(1))


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        _kill(p)


def test_cli_serves_and_stops_on_sigterm(model_dir, procs):
    proc, port = _start(model_dir, "--model", "m1", "--max-model-len", "2048",
                        "--enable-prompt-tokens-details", "--no-enable-prefix-caching",
                        "--role", "prefill", "--dp-rank", "1")
    procs.append(proc)
    status, d = post_json(port, "/v1/completions", {"model": "m1", "prompt": "hi", "max_tokens": 2})
    assert status == 200 and d["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    status, _, body = request(port, "GET", "/metrics")
    assert b'engine="1"' in body
    status, d = post_json(port, "/v1/completions", {"model": "motor-sim", "prompt": "hi"})
    assert status == 404
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(10) == 0


def test_boolean_flags_take_values(model_dir, procs):
    proc, port = _start(model_dir, "--enable-prompt-tokens-details", "true",
                        "--enable-prefix-caching", "false")
    procs.append(proc)
    status, d = post_json(port, "/v1/completions", {"prompt": "x" * 40, "max_tokens": 1})
    status, d = post_json(port, "/v1/completions", {"prompt": "x" * 40, "max_tokens": 1})
    assert d["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_admin_crash_exits_1(model_dir, procs):
    proc, port = _start(model_dir)
    procs.append(proc)
    # the crash reaches http.client as a reset, a remote disconnect or a bad status line, as
    # timing has it
    with pytest.raises(Exception):  # noqa: B017
        post_json(port, "/admin/fault", {"mode": "crash"}, timeout=5)
    assert proc.wait(10) == 1


def test_crash_flag_with_count_crashes_on_that_request(model_dir, procs):
    proc, port = _start(model_dir, "--fault", "crash", "--fault-count", "2")
    procs.append(proc)
    status, _ = post_json(port, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 200
    with pytest.raises(Exception):  # noqa: B017 - as above, whichever error the crash gives
        post_json(port, "/v1/completions", {"prompt": "x", "max_tokens": 1}, timeout=5)
    assert proc.wait(10) == 1


def test_crash_flag_without_count_fails_start_up(model_dir):
    r = subprocess.run([sys.executable, "-m", "motor", "sim", "--port", "0", "--model-dir",
                        model_dir, "--fault", "crash"], cwd=ROOT, capture_output=True, timeout=30)
    assert r.returncode == 1 and b"crash" in r.stderr


def _listener() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def _run_sim(model_dir: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "motor", "sim", "--model-dir", model_dir,
                           *extra], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_busy_port_is_one_line_not_a_traceback(model_dir):
    s, port = _listener()
    try:
        r = _run_sim(model_dir, "--port", str(port))
        assert r.returncode == 1
        assert program_stderr(r.stderr) == (f"motor sim: cannot listen on 127.0.0.1:{port} (--port): "
                                            "address already in use")
        assert r.stdout == ""
        r = _run_sim(model_dir, "--port", "0", "--role", "prefill",
                     "--disaggregation-bootstrap-port", str(port))
        assert r.returncode == 1
        assert program_stderr(r.stderr) == (f"motor sim: cannot listen on 127.0.0.1:{port} "
                                            "(--disaggregation-bootstrap-port): address already in use")
    finally:
        s.close()


@pytest.mark.parametrize("bad", ["-1", "65536", "x"])
def test_port_out_of_range_is_an_argparse_error(model_dir, bad):
    r = _run_sim(model_dir, "--port", bad)
    assert r.returncode == 2
    assert "argument --port: expected a port number 0..65535" in r.stderr
    assert "Traceback" not in r.stderr
