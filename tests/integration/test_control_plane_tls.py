"""`motor up` with control-plane mTLS (``controller.tls``) and TLS on the API port
(``coordinator.tls`` with a client CA): the cluster starts, the official openai client gets a
chat completion over HTTPS, the controller and a node manager's management API refuse plain
HTTP and clients without a certificate, SIGTERM stops everything."""
from __future__ import annotations

import json
import os
import signal
import socket
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

from tests.support.procs import free_ports, pids_matching, read_line_with


def _pem_pair(ca: trustme.CA, d: Path, name: str) -> tuple[Path, Path]:
    cert = ca.issue_cert("127.0.0.1")
    c, k = d / f"{name}.pem", d / f"{name}.key"
    cert.private_key_pem.write_to_path(str(k))
    cert.cert_chain_pems[0].write_to_path(str(c))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(c), append=True)
    return c, k


def _get(url: str, ctx: ssl.SSLContext | None = None) -> object:
    with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
        return json.loads(r.read())


def _refused(url: str, ctx: ssl.SSLContext | None = None) -> None:
    """GET ``url`` gets no HTTP answer at all (the connection fails or is cut)."""
    with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)) as e:
        _get(url, ctx)
    assert not isinstance(e.value, urllib.error.HTTPError), e.value


@pytest.mark.parametrize("workers", [1, 2])   # 2: the feed process follows the controller
def test_up_with_control_plane_mtls_and_https_api(tmp_path: Path, workers: int) -> None:
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    plane_cert, plane_key = _pem_pair(ca, tmp_path, "plane")     # every control-plane process
    api_cert, api_key = _pem_pair(ca, tmp_path, "api")           # the coordinator's API port
    user_cert, user_key = _pem_pair(ca, tmp_path, "user")        # an API client (mTLS)
    ctl, gw, mgmt = free_ports(3)
    base, _ = free_ports(2, consecutive=True)
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"""
controller:
  port: {ctl}
  heartbeat_interval_s: 0.2
  tls: {{ca_file: {ca_file}, cert_file: {plane_cert}, key_file: {plane_key}}}
coordinator:
  port: {gw}
  workers: {workers}
  tls: {{cert_file: {api_cert}, key_file: {api_key}, client_ca_file: {ca_file}}}
nodes:
  - name: n0
    mgmt_port: {mgmt}
    engines:
      - {{name: sim, kind: sim, model: motor-sim, count: 2, base_port: {base},
         health_interval_s: 0.2, engine_config: {{time-scale: 0.05}}}}
""")
    p = subprocess.Popen([sys.executable, "-m", "motor", "up", "-c", str(cfg),
                          "--log-dir", str(tmp_path / "logs")],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        line = read_line_with(p, b"motor is up", 25)
        logs = tmp_path / "logs"
        assert b"motor is up" in line, (line, [(f.name, f.read_text()[-2000:])
                                               for f in logs.glob("*.log")])
        assert f"https://127.0.0.1:{gw}/v1".encode() in line, line

        # the official openai client over HTTPS, verifying the API's certificate against the
        # test CA and presenting a client certificate (coordinator.tls.client_ca_file)
        user = ssl.create_default_context(cafile=str(ca_file))
        user.load_cert_chain(str(user_cert), str(user_key))
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{gw}/v1", api_key="unused",
                               http_client=openai.DefaultHttpx2Client(verify=user))
        out = client.chat.completions.create(model="motor-sim", max_tokens=4,
                                             messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content and out.usage.completion_tokens == 4
        client.close()

        # the controller: mTLS only
        plane = ssl.create_default_context(cafile=str(ca_file))
        plane.load_cert_chain(str(plane_cert), str(plane_key))
        nodes = _get(f"https://127.0.0.1:{ctl}/v1/nodes", plane)
        assert [n["node"] for n in nodes["nodes"]] == ["n0"]
        _refused(f"http://127.0.0.1:{ctl}/v1/nodes")                        # plain HTTP
        _refused(f"https://127.0.0.1:{ctl}/v1/nodes",                       # no certificate
                 ssl.create_default_context(cafile=str(ca_file)))
        # the node manager's management API: the same server context
        assert _get(f"https://127.0.0.1:{mgmt}/health", plane) == {"status": "ok"}
        _refused(f"http://127.0.0.1:{mgmt}/health")
        _refused(f"https://127.0.0.1:{mgmt}/health", ssl.create_default_context(cafile=str(ca_file)))

        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(20) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        try:
            os.killpg(p.pid, signal.SIGKILL)   # anything of its group left
        except ProcessLookupError:
            pass
    time.sleep(0.3)
    assert pids_matching("motor", "--port", str(base)) == []
    assert pids_matching("motor", "--port", str(base + 1)) == []
    assert pids_matching("motor", str(cfg)) == []
    for port in (ctl, gw, mgmt):   # every listener is gone
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_tls_config_errors_are_refused_before_anything_starts(tmp_path: Path) -> None:
    """Exit status 2 and one line naming the field (and the file), nothing started."""
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = _pem_pair(ca, tmp_path, "plane")
    ctl, gw = free_ports(2)
    base, _ = free_ports(2, consecutive=True)
    engines = (f"nodes:\n  - name: n0\n    engines: [{{name: sim, kind: sim, model: motor-sim, "
               f"count: 1, base_port: {base}}}]\n")
    missing = tmp_path / "missing.pem"
    bad_cert = tmp_path / "bad-cert.yaml"
    bad_cert.write_text(f"controller: {{port: {ctl}, tls: {{ca_file: {ca_file}, cert_file: "
                        f"{missing}}}}}\ncoordinator: {{port: {gw}}}\n" + engines)
    no_plane = tmp_path / "no-plane.yaml"
    no_plane.write_text(f"controller: {{port: {ctl}}}\ncoordinator: {{port: {gw}, tls: "
                        f"{{cert_file: {cert}, key_file: {key}, client_ca_file: {ca_file}}}}}\n"
                        + engines)
    plain = tmp_path / "plain.yaml"
    plain.write_text(f"controller: {{port: {ctl}}}\n" + engines)
    cases = [
        (["up", "-c", str(bad_cert)],
         f"motor up: controller.tls.cert_file: expected a readable PEM file, got '{missing}' "
         f"(no such file)"),
        (["node-manager", "-c", str(bad_cert)],
         f"motor node-manager: controller.tls.cert_file: expected a readable PEM file, got "
         f"'{missing}' (no such file)"),
        (["coordinator", "-c", str(bad_cert)],
         f"motor coordinator: controller.tls.cert_file: expected a readable PEM file, got "
         f"'{missing}' (no such file)"),
        (["node-manager", "-c", str(plain), "--controller", f"https://127.0.0.1:{ctl}"],
         f"motor node-manager: --controller: an https:// controller URL needs controller.tls "
         f"(the CA and the certificate to present), got 'https://127.0.0.1:{ctl}' with "
         f"controller.tls null"),
    ]
    for argv, message in cases:
        r = subprocess.run([sys.executable, "-m", "motor"] + argv, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2, (argv, r.stderr)
        assert r.stderr.strip().splitlines()[-1] == message, (argv, r.stderr)
    r = subprocess.run([sys.executable, "-m", "motor", "up", "-c", str(no_plane)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "coordinator.tls.client_ca_file: motor up's readiness probe of the coordinator " \
           "needs a client certificate" in r.stderr
    assert pids_matching("motor", "--port", str(base)) == []


def test_an_api_certificate_for_another_host_fails_the_start_at_once(tmp_path: Path) -> None:
    """A certificate that does not verify never will: motor up says so at the first probe
    (naming the field to look at) instead of waiting out --ready-timeout."""
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    plane_cert, plane_key = _pem_pair(ca, tmp_path, "plane")
    other = ca.issue_cert("other.example.com")
    api_cert, api_key = tmp_path / "api.pem", tmp_path / "api.key"
    other.cert_chain_pems[0].write_to_path(str(api_cert))
    other.private_key_pem.write_to_path(str(api_key))
    ctl, gw = free_ports(2)
    base, _ = free_ports(2, consecutive=True)
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(f"""
controller:
  port: {ctl}
  heartbeat_interval_s: 0.2
  tls: {{ca_file: {ca_file}, cert_file: {plane_cert}, key_file: {plane_key}}}
coordinator:
  port: {gw}
  tls: {{cert_file: {api_cert}, key_file: {api_key}}}
nodes:
  - name: n0
    engines:
      - {{name: sim, kind: sim, model: motor-sim, count: 1, base_port: {base},
         health_interval_s: 0.2, engine_config: {{time-scale: 0.05}}}}
""")
    p = subprocess.Popen([sys.executable, "-m", "motor", "up", "-c", str(cfg), "--log-dir",
                          str(tmp_path / "logs"), "--ready-timeout", "600"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         start_new_session=True)
    try:
        _, err = p.communicate(timeout=120)   # far less than the 600 s ready timeout
        assert p.returncode == 1, err
        assert b"certificate verification failed" in err and b"coordinator.tls" in err, err
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(0.3)
    assert pids_matching("motor", str(cfg)) == []
