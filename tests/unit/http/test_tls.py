"""TLS contexts with certificates from a test CA (trustme): server, mTLS, client, reload."""
from __future__ import annotations

import asyncio
import os
import ssl

import pytest
import trustme

from motor.errors import ConfigError
from motor.http.tls import CertReloader, client_context, server_context


def _write_pair(ca: trustme.CA, d, name: str = "server"):
    cert = ca.issue_cert("127.0.0.1", "localhost")
    c, k = d / f"{name}.pem", d / f"{name}.key"
    cert.cert_chain_pems[0].write_to_path(str(c))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(c), append=True)
    cert.private_key_pem.write_to_path(str(k))
    return cert, str(c), str(k)


async def _peer_serial(port: int, client: ssl.SSLContext) -> int:
    r, w = await asyncio.open_connection("127.0.0.1", port, ssl=client,
                                         server_hostname="127.0.0.1")
    der = w.get_extra_info("ssl_object").getpeercert(binary_form=True)
    w.close()
    await w.wait_closed()
    from cryptography import x509
    return x509.load_der_x509_certificate(der).serial_number


async def _serve(ctx: ssl.SSLContext):
    async def on(r, w):
        w.close()
    srv = await asyncio.start_server(on, "127.0.0.1", 0, ssl=ctx)
    return srv, srv.sockets[0].getsockname()[1]


def test_server_context_with_a_test_ca_and_reload_for_new_connections(tmp_path):
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    first, cert, key = _write_pair(ca, tmp_path)
    ctx = server_context(cert, key)
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    reloader = CertReloader(ctx, cert, key)

    async def main():
        srv, port = await _serve(ctx)
        client = client_context(str(ca_file))
        from cryptography import x509
        s1 = await _peer_serial(port, client)
        assert s1 == x509.load_pem_x509_certificate(first.cert_chain_pems[0].bytes()).serial_number
        assert not reloader.check()
        second, _, _ = _write_pair(ca, tmp_path)          # rotated in place
        os.utime(cert, (1, 1))
        assert reloader.check() and reloader.reloads == 1
        s2 = await _peer_serial(port, client)
        assert s2 != s1
        assert s2 == x509.load_pem_x509_certificate(second.cert_chain_pems[0].bytes()).serial_number
        srv.close()
        await srv.wait_closed()
    asyncio.run(main())


def test_mtls_refuses_a_client_without_a_certificate(tmp_path):
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    _, cert, key = _write_pair(ca, tmp_path)
    _, ccert, ckey = _write_pair(ca, tmp_path, "client")
    ctx = server_context(cert, key, client_ca_file=str(ca_file))

    async def main():
        srv, port = await _serve(ctx)
        ok = client_context(str(ca_file), cert_file=ccert, key_file=ckey)
        await _peer_serial(port, ok)
        anonymous = client_context(str(ca_file))
        with pytest.raises((ssl.SSLError, ConnectionResetError, asyncio.IncompleteReadError)):
            r, w = await asyncio.open_connection("127.0.0.1", port, ssl=anonymous,
                                                 server_hostname="127.0.0.1")
            # TLS 1.3: the server's alert about the missing certificate arrives on first read
            await r.readexactly(1)
        srv.close()
        await srv.wait_closed()
    asyncio.run(main())


def test_a_broken_rotation_keeps_the_old_certificate(tmp_path):
    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    first, cert, key = _write_pair(ca, tmp_path)
    ctx = server_context(cert, key)
    reloader = CertReloader(ctx, cert, key)
    with open(cert, "w") as f:
        f.write("not a certificate\n")
    assert not reloader.check()
    # a half-done rotation: a new certificate whose key is not there yet
    other = ca.issue_cert("127.0.0.1")
    other.cert_chain_pems[0].write_to_path(cert)
    os.utime(cert, (5, 5))
    assert not reloader.check()
    assert reloader.reloads == 0

    async def main():   # the live context still serves the first pair
        srv, port = await _serve(ctx)
        from cryptography import x509
        got = await _peer_serial(port, client_context(str(ca_file)))
        assert got == x509.load_pem_x509_certificate(first.cert_chain_pems[0].bytes()).serial_number
        srv.close()
        await srv.wait_closed()
    asyncio.run(main())


def test_encrypted_key_with_a_password_file(tmp_path):
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    from cryptography.hazmat.primitives import serialization
    pkey = serialization.load_pem_private_key(leaf.private_key_pem.bytes(), None)
    enc = pkey.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(b"s3cret"))
    (tmp_path / "k.pem").write_bytes(enc)
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "c.pem"))
    (tmp_path / "pw").write_text("s3cret\n")
    server_context(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), str(tmp_path / "pw"))
    (tmp_path / "pw").write_text("wrong\n")
    with pytest.raises(ConfigError, match="key_password_file: expected the password of the "
                                          "encrypted key .* does not decrypt it"):
        server_context(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"), str(tmp_path / "pw"))
    # no password file: an error naming the field, never a prompt on the terminal
    with pytest.raises(ConfigError, match="key_password_file: expected the password file of "
                                          "the encrypted key"):
        server_context(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))


@pytest.mark.parametrize("kwargs, words", [
    ({"cert_file": "/no/such.pem"}, "coordinator.tls.cert_file: expected a readable PEM file"),
    ({"cert_file": "CERT", "client_ca_file": "/no/ca.pem"},
     "coordinator.tls.client_ca_file: expected a readable PEM CA bundle"),
    ({"cert_file": "CERT", "key_password_file": "/no/pw"},
     "coordinator.tls.key_password_file: cannot read /no/pw"),
])
def test_missing_files_name_the_field(tmp_path, kwargs, words):
    ca = trustme.CA()
    _, cert, key = _write_pair(ca, tmp_path)
    kwargs = {k: (cert if v == "CERT" else v) for k, v in kwargs.items()}
    if kwargs["cert_file"] == cert:
        kwargs["key_file"] = key
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        server_context(**kwargs)
