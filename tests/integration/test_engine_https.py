"""HTTPS to engines registered by node managers (``engines[].tls``): ``motor up`` with two
``motor sim`` engines serving HTTPS (certificates from a trustme CA made here), the node
manager probing them over HTTPS, the coordinator (one worker, and two with the feed)
routing to them with ``coordinator.upstream_tls.ca_file`` = the test CA; a coordinator with
another CA refuses to route (503, the reason in ``/instances`` and its log) instead of
speaking plain HTTP."""
from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import trustme

from tests.support.procs import free_ports, pids_matching, read_line_with, spawn, stop, wait_http


def _pem_pair(ca: trustme.CA, d: Path, name: str) -> tuple[Path, Path]:
    cert = ca.issue_cert("127.0.0.1")
    c, k = d / f"{name}.pem", d / f"{name}.key"
    cert.private_key_pem.write_to_path(str(k))
    cert.cert_chain_pems[0].write_to_path(str(c))
    return c, k


def _config(path: Path, ctl: int, gw: int, base: int, workers: int, ca_file: Path,
            cert: Path, key: Path, upstream_ca: Path) -> Path:
    path.write_text(f"""
controller:
  port: {ctl}
  heartbeat_interval_s: 0.2
coordinator:
  port: {gw}
  workers: {workers}
  health_check_interval_s: 0.2
  upstream_tls: {{ca_file: {upstream_ca}}}
nodes:
  - name: n0
    engines:
      - {{name: sim, kind: sim, model: motor-sim, count: 2, base_port: {base},
         health_interval_s: 0.2, engine_config: {{time-scale: 0.05}},
         tls: {{cert_file: {cert}, key_file: {key}, ca_file: {ca_file}}}}}
""")
    return path


def _json(url: str, timeout_s: float = 5.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.loads(r.read())


def _chat(gw: int) -> tuple[int, dict[str, object]]:
    body = json.dumps({"model": "motor-sim", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{gw}/v1/chat/completions", body,
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_tls_errors(gw: int, n: int, timeout_s: float = 20.0) -> list[dict[str, object]]:
    """``/instances`` of the coordinator on ``gw`` once ``n`` endpoints carry a TLS error."""
    deadline = time.monotonic() + timeout_s
    eps: list[dict[str, object]] = []
    while time.monotonic() < deadline:
        try:
            eps = _json(f"http://127.0.0.1:{gw}/instances")["endpoints"]  # type: ignore[index]
            if len(eps) == n and all(e["tls_error"] for e in eps):
                return eps
        except (OSError, http.client.HTTPException, ssl.SSLError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"expected {n} endpoints with a TLS error, got {eps}")


@pytest.mark.parametrize("workers", [1, 2])   # 2: the feed scrapes and reads models over TLS
def test_engines_behind_https_are_probed_and_routed_over_tls(tmp_path: Path,
                                                               workers: int) -> None:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = _pem_pair(ca, tmp_path, "engine")
    ctl, gw, gw2 = free_ports(3)
    base, _ = free_ports(2, consecutive=True)
    cfg = _config(tmp_path / "cluster.yaml", ctl, gw, base, workers, ca_file, cert, key,
                  ca_file)
    logs = tmp_path / "logs"
    p = subprocess.Popen([sys.executable, "-m", "motor", "up", "-c", str(cfg),
                          "--log-dir", str(logs)],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    wrong: subprocess.Popen[bytes] | None = None
    try:
        line = read_line_with(p, b"motor is up", 30)
        assert b"motor is up" in line, (line, [(f.name, f.read_text()[-2000:])
                                               for f in logs.glob("*.log")])
        # the engines speak TLS only: a plain-HTTP request gets no HTTP answer, HTTPS with
        # the test CA does, and each engine says it listens on https://
        for port in (base, base + 1):
            with pytest.raises((OSError, http.client.HTTPException)) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
            assert not isinstance(e.value, urllib.error.HTTPError), e.value
            ctx = ssl.create_default_context(cafile=str(ca_file))
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=5,
                                        context=ctx) as r:
                assert r.status == 200
        engine_logs = "".join(f.read_text() for f in (logs / "engines").glob("*.log"))
        assert f"listening on https://127.0.0.1:{base} " in engine_logs
        assert f"listening on https://127.0.0.1:{base + 1} " in engine_logs

        # the controller's table says https; the coordinator routes chats there
        table = _json(f"http://127.0.0.1:{ctl}/v1/instances")
        schemes = {e["scheme"] for i in table["instances"]  # type: ignore[index]
                   for e in i["endpoints"]}
        assert schemes == {"https"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{gw}/v1", api_key="unused",
                               max_retries=0)
        for _ in range(4):        # round robin: both engines
            out = client.chat.completions.create(
                model="motor-sim", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
            assert out.usage is not None and out.usage.completion_tokens == 3
        stream = client.chat.completions.create(
            model="motor-sim", max_tokens=4, stream=True,
            messages=[{"role": "user", "content": "hi"}])
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text
        client.close()
        if workers == 1:
            eps = _json(f"http://127.0.0.1:{gw}/instances")["endpoints"]  # type: ignore[index]
            assert sorted(e["url"] for e in eps) == [f"https://127.0.0.1:{base}",
                                                     f"https://127.0.0.1:{base + 1}"]
            assert all(e["ready"] and e["tls_error"] is None for e in eps)

            # a second coordinator following the same controller, trusting another CA:
            # no engine is routable (503), the handshake's failure is named, no plain HTTP
            other = trustme.CA()
            other_file = tmp_path / "other-ca.pem"
            other.cert_pem.write_to_path(str(other_file))
            cfg2 = _config(tmp_path / "wrong-ca.yaml", ctl, gw2, base, 1, ca_file, cert, key,
                           other_file)
            log2 = tmp_path / "wrong-ca-coordinator.log"
            wrong = spawn(["coordinator", "-c", str(cfg2)], str(log2))
            wait_http(f"http://127.0.0.1:{gw2}/liveness", 20)
            eps = _wait_tls_errors(gw2, 2)
            assert all(not e["ready"] and "certificate verify failed" in str(e["tls_error"])
                       for e in eps), eps
            status, body = _chat(gw2)
            assert status == 503, body
            assert "no ready instance" in body["error"]["message"], body  # type: ignore[index]
            text2 = log2.read_text()
            assert "not routable: its TLS handshake failed: certificate verify failed" in text2
            stop(wrong)
            assert wrong.returncode == 0, log2.read_text()[-2000:]
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(20) == 0
    finally:
        if wrong is not None:
            stop(wrong)
        assert p.stdout is not None
        p.stdout.close()
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.3)
    assert pids_matching("motor", "--port", str(base)) == []
    assert pids_matching("motor", "--port", str(base + 1)) == []
    assert pids_matching("motor", str(cfg)) == []
