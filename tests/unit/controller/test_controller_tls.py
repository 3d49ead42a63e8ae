"""Control-plane mTLS (``controller.tls``) in-process: the controller refuses a client without
a certificate and one whose certificate another CA signed, at the TLS handshake; a node
manager and a coordinator's watcher with the control-plane certificate work; the node
manager's management API asks for the same; bad files and URL schemes are config errors."""
from __future__ import annotations

import asyncio
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
import trustme

from motor.config.schema import ControlPlaneTlsConfig, ControllerConfig, NodeConfig
from motor.control_tls import client_context, controller_endpoint
from motor.controller.server import ControllerServer
from motor.coordinator.controller_poll import controller_address
from motor.coordinator.endpoints import ControllerWatcher, EndpointTable
from motor.errors import ConfigError
from motor.http.client import Client
from motor.node_manager.agent import NodeAgent
from tests.support.procs import program_stderr

ROOT = Path(__file__).resolve().parents[3]


def _identity(ca: trustme.CA, d: Path, name: str,
              names: tuple[str, ...] = ("127.0.0.1", "localhost")) -> tuple[str, str]:
    cert = ca.issue_cert(*names)
    c, k = d / f"{name}.pem", d / f"{name}.key"
    cert.private_key_pem.write_to_path(str(k))
    cert.cert_chain_pems[0].write_to_path(str(c))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(c), append=True)
    return str(c), str(k)


_CAS: dict[int, trustme.CA] = {}


def _ca_of(pki: dict[str, ControlPlaneTlsConfig]) -> trustme.CA:
    """The trustme CA behind ``pki`` (to issue more certificates of the cluster)."""
    return _CAS[id(pki)]


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, ControlPlaneTlsConfig]:
    """``good``: the cluster's identity; ``other``: a certificate of another CA (trusting the
    cluster's CA, so only its own certificate is wrong)."""
    ca, other_ca = trustme.CA(), trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    cert, key = _identity(ca, tmp_path, "plane")
    ocert, okey = _identity(other_ca, tmp_path, "other")
    ncert, nkey = _identity(ca, tmp_path, "named", ("controller.example",))
    out = {"good": ControlPlaneTlsConfig(ca_file=str(ca_file), cert_file=cert, key_file=key),
            "other": ControlPlaneTlsConfig(ca_file=str(ca_file), cert_file=ocert,
                                           key_file=okey),
            "named": ControlPlaneTlsConfig(ca_file=str(ca_file), cert_file=ncert,
                                           key_file=nkey)}
    _CAS[id(out)] = ca
    return out


_REGISTER = (b'{"node": "intruder", "host": "127.0.0.1", "instances": []}')


def _try_register(port: int, ctx: ssl.SSLContext, tls12: bool) -> str:
    """POST /v1/nodes/register over a blocking TLS socket: ``handshake`` when the TLS
    handshake failed, ``no answer`` when the connection closed before any byte of an answer,
    else the answer's first line."""
    if tls12:   # the client's handshake ends after the server checked its certificate
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with socket.create_connection(("127.0.0.1", port), 5) as raw:
        try:
            s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        except (ssl.SSLError, ConnectionResetError):
            return "handshake"
        with s:
            try:
                s.sendall(b"POST /v1/nodes/register HTTP/1.1\r\nhost: x\r\ncontent-type: "
                          b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                          % (len(_REGISTER), _REGISTER))
                got = s.recv(200)
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
                return "no answer"
            return got.split(b"\r\n")[0].decode() if got else "no answer"


async def _refused(port: int, ctx_factory) -> None:
    """A client of ``ctx_factory()`` is refused: with TLS 1.2 its handshake fails, with
    TLS 1.3 (whose client handshake ends before the server's check) nothing is answered."""
    assert await asyncio.to_thread(_try_register, port, ctx_factory(), True) == "handshake"
    assert await asyncio.to_thread(_try_register, port, ctx_factory(), False) == "no answer"


async def _raw_get(port: int, ctx: ssl.SSLContext) -> bytes:
    """GET /health over TLS by hand; returns what the server sent."""
    r, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx,
                                         server_hostname="127.0.0.1")
    try:
        w.write(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        await w.drain()
        return await asyncio.wait_for(r.read(), 5)
    finally:
        w.close()
        try:
            await w.wait_closed()
        except (ssl.SSLError, ConnectionError):
            pass


def _no_cert(ca_file: str) -> ssl.SSLContext:
    """Trusts the cluster's CA, presents no certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca_file)
    return ctx


def test_controller_requires_a_client_certificate_of_its_ca(pki) -> None:
    cfg = ControllerConfig(host="127.0.0.1", port=18500, tls=pki["good"])
    assert cfg.url == "https://127.0.0.1:18500"

    async def main() -> None:
        server = ControllerServer(cfg)
        port = await server.start(port=0)
        try:
            assert server.url == f"https://127.0.0.1:{port}"
            # no certificate, or one another CA signed (the client trusts the server):
            # refused at the handshake, the request never reaches the registry
            await _refused(port, lambda: _no_cert(pki["good"].ca_file))
            await _refused(port, lambda: client_context(pki["other"]))
            assert server.registry.nodes() == []
            # the right certificate: the same request is served
            assert await asyncio.to_thread(_try_register, port, client_context(pki["good"]),
                                           True) == "HTTP/1.1 200 OK"
            assert [n["node"] for n in server.registry.nodes()] == ["intruder"]
            server.registry.deregister("intruder")

            # plain HTTP to the TLS port gets no HTTP answer
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            await w.drain()
            assert b"HTTP/1.1 200" not in await asyncio.wait_for(r.read(), 5)
            w.close()

            good = client_context(pki["good"])
            got = await _raw_get(port, good)
            assert got.startswith(b"HTTP/1.1 200") and b'{"status":"ok"}' in got
            # what motor's components use: Client.use_tls
            client = Client(tls=good)
            client.use_tls("127.0.0.1", port)
            status, body = await client.get_json_bytes("127.0.0.1", port, "/v1/nodes", 5.0)
            assert status == 200 and b'"nodes":[]' in body
            client.close()
        finally:
            await server.stop()
        # the controller's certificate must name the host connected to: one for
        # controller.example only, reached as 127.0.0.1, is refused by the client
        named = ControllerServer(ControllerConfig(host="127.0.0.1", tls=pki["named"]))
        port = await named.start(port=0)
        try:
            client = Client(tls=good)
            client.use_tls("127.0.0.1", port)
            with pytest.raises(ssl.SSLCertVerificationError, match="IP address mismatch"):
                await client.get_json_bytes("127.0.0.1", port, "/health", 5.0)
            client.close()
        finally:
            await named.stop()
    asyncio.run(main())


def test_node_manager_and_watcher_over_mtls(pki) -> None:
    async def main() -> None:
        server = ControllerServer(ControllerConfig(host="127.0.0.1", tls=pki["good"]))
        await server.start(port=0)
        agent = NodeAgent(NodeConfig(name="n0", host="127.0.0.1"), server.url, 0.1,
                          mgmt_port=0, tls=pki["good"])
        await agent.start()
        try:
            for _ in range(200):
                if agent.registered:
                    break
                await asyncio.sleep(0.02)
            assert agent.registered and agent.controller_reachable
            assert [n["node"] for n in server.registry.nodes()] == ["n0"]
            # the management API is mTLS too
            assert agent.mgmt_port is not None
            await _refused(agent.mgmt_port, lambda: _no_cert(pki["good"].ca_file))
            await _refused(agent.mgmt_port, lambda: client_context(pki["other"]))
            got = await _raw_get(agent.mgmt_port, client_context(pki["good"]))
            assert got.startswith(b"HTTP/1.1 200")

            # a coordinator's watcher follows the table over mTLS
            watcher = ControllerWatcher(EndpointTable(Client()), server.url, poll_timeout_s=1.0,
                                        tls=pki["good"])
            task = asyncio.ensure_future(watcher.run())
            await asyncio.wait_for(watcher.synced.wait(), 5)
            task.cancel()
            watcher.close()
            # one with the other CA's certificate never gets a table
            bad = ControllerWatcher(EndpointTable(Client()), server.url, poll_timeout_s=1.0,
                                    tls=pki["other"])
            task = asyncio.ensure_future(bad.run())
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(bad.synced.wait()), 1.0)
            task.cancel()
            bad.close()
        finally:
            await agent.stop()
            await server.stop()
    asyncio.run(main())


def test_urls_and_files_are_checked(pki, tmp_path: Path) -> None:
    good = pki["good"]
    assert controller_endpoint("https://127.0.0.1:18500", good) == ("127.0.0.1", 18500, True)
    assert controller_endpoint("http://c", None) == ("c", 80, False)
    assert controller_address("https://c") == ("c", 443)
    with pytest.raises(ConfigError, match="needs controller.tls"):
        controller_endpoint("https://127.0.0.1:18500", None)
    with pytest.raises(ConfigError, match="expected an https:// controller URL"):
        controller_endpoint("http://127.0.0.1:18500", good)
    with pytest.raises(ConfigError, match="expected a controller URL"):
        controller_endpoint("ftp://127.0.0.1:18500", good)
    with pytest.raises(ConfigError, match=r"controller\.tls\.cert_file: .*no such file"):
        ControllerServer(ControllerConfig(tls=good.model_copy(
            update={"cert_file": str(tmp_path / "missing.pem")})))
    with pytest.raises(ConfigError, match=r"controller\.tls\.ca_file: .*no such file"):
        client_context(good.model_copy(update={"ca_file": str(tmp_path / "none.pem")}))


def test_controller_cli_refuses_a_bad_certificate_file(pki, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"controller:\n  port: 18599\n  tls: {{ca_file: {pki['good'].ca_file}, "
                   f"cert_file: {tmp_path / 'nope.pem'}}}\n")
    r = subprocess.run([sys.executable, "-m", "motor", "controller", "-c", str(cfg)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert program_stderr(r.stderr) == (f"motor controller: controller.tls.cert_file: expected a "
                                        f"readable PEM file, got '{tmp_path / 'nope.pem'}' (no such "
                                        f"file)")


def _peer_serial(port: int, ctx: ssl.SSLContext) -> tuple[int, ssl.SSLSocket]:
    raw = socket.create_connection(("127.0.0.1", port), 5)
    s = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    der = s.getpeercert(binary_form=True)
    assert der is not None
    from cryptography import x509
    return x509.load_der_x509_certificate(der).serial_number, s


def test_control_plane_certificates_reload_without_dropping_connections(
        pki: dict[str, ControlPlaneTlsConfig], tmp_path: Path) -> None:
    """The controller's certificate files rotated in place: after the reload (what the
    5-second check or SIGHUP does) a new handshake gets the new certificate, a connection
    opened before keeps working, and a rotation to files that do not load keeps the old
    pair."""
    good = pki["good"]
    live_cert, live_key = tmp_path / "live.pem", tmp_path / "live.key"
    live_cert.write_bytes(Path(good.cert_file).read_bytes())
    live_key.write_bytes(Path(good.key_file or good.cert_file).read_bytes())
    cfg = ControlPlaneTlsConfig(ca_file=good.ca_file, cert_file=str(live_cert),
                                key_file=str(live_key))

    async def main() -> None:
        server = ControllerServer(ControllerConfig(host="127.0.0.1", tls=cfg))
        port = await server.start(port=0)
        try:
            ctx = client_context(cfg)
            first, old_conn = await asyncio.to_thread(_peer_serial, port, ctx)
            # rotate: another certificate of the same CA
            new_cert, new_key = _identity(_ca_of(pki), tmp_path, "rotated")
            live_cert.write_bytes(Path(new_cert).read_bytes())
            live_key.write_bytes(Path(new_key).read_bytes())
            assert server.reload_tls() is True
            second, new_conn = await asyncio.to_thread(_peer_serial, port, ctx)
            assert second != first
            for conn in (old_conn, new_conn):   # both still answer
                def ask(c: ssl.SSLSocket = conn) -> bytes:
                    c.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                    return c.recv(100)
                assert (await asyncio.to_thread(ask)).startswith(b"HTTP/1.1 200")
                conn.close()
            # a half-written rotation: the key does not match -> the previous pair stays
            live_key.write_bytes(Path(good.key_file or good.cert_file).read_bytes())
            assert server.reload_tls() is False
            third, conn = await asyncio.to_thread(_peer_serial, port, ctx)
            conn.close()
            assert third == second
        finally:
            await server.stop()
    asyncio.run(main())
